"""``python -m specdec_kit.bench.draft_cycle``: what drafting a whole cycle in one ONNX Runtime call saves.

An engine built with a dynamic tree carries a ``draft_tree`` graph: the draft's context step and its whole tree search
in one session call. This benchmark decodes the same prompts at batch 1 both ways on each engine, interleaved prompt
by prompt: in one call per cycle, and level by level through the step graph (the same tree, the same session
options). It reports the median draft milliseconds per cycle, tokens/s and acceptance of each, and checks that both
produced the same tokens. Prompts: held-out MT-Bench questions through the chat template where the tokenizer has one
(SmolLM2), else held-out HumanEval problems (the demo zoo's code model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.bench.draft_cycle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("engines", type=Path, nargs="+", help="ONNX Runtime engine directories built with a dynamic tree")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts per engine")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=Path("bench/results/draft_cycle"), help="writes OUT.json and OUT.md")
    return p.parse_args(argv)


def engine_prompts(engine, n: int) -> list[list[int]]:
    from specdec_kit.bench.chat_target import chat_ids
    from specdec_kit.data.prompts import chat_messages, humaneval

    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        return [chat_ids(tokenizer, m) for m in chat_messages("chat", n)]
    return [tokenizer(text)["input_ids"] for text in humaneval(n)]


def measure(path: Path, prompts: int, new_tokens: int) -> dict:
    """One engine: each prompt decoded in one call per cycle and level by level, alternately."""
    from specdec_kit.runtime.decoding.generate import RequestStats
    from specdec_kit.runtime.engine import open_engine

    engine = open_engine(path)
    step = engine.drafter.step
    whole = getattr(step, "whole", None)
    if whole is None:
        raise SystemExit(
            f"{path}: this engine has no draft_tree graph (built with a static tree, or by an older kit); "
            "rebuild it with a dynamic tree"
        )
    ids = engine_prompts(engine, prompts)
    gen = engine.generator()
    gen.generate(ids[:1], 4)  # sessions warm
    runs: dict[str, list] = {"one call": [], "level by level": []}
    identical = True
    for prompt in ids:
        step.whole = whole
        one = gen.generate([prompt], new_tokens)[0]
        step.whole = None
        levels = gen.generate([prompt], new_tokens)[0]
        identical &= one.tokens == levels.tokens
        runs["one call"].append(one.stats)
        runs["level by level"].append(levels.stats)
    step.whole = whole
    rows = {}
    for mode, stats in runs.items():
        total = RequestStats.combined(stats)
        rows[mode] = {
            "draft_ms_per_cycle": statistics.median(1000 * s.draft_s / s.cycles for s in stats),
            "verify_ms_per_cycle": statistics.median(1000 * s.verify_s / s.cycles for s in stats),
            "tokens_per_s": statistics.median(s.tokens_per_s for s in stats),
            "tau": total.acceptance_length,
        }
    return {
        "engine": str(path),
        "draft": engine.manifest["draft"]["kind"],
        "tree": engine.manifest["tree"],
        "target_layers": engine.manifest["target"]["num_hidden_layers"],
        "prompts": len(ids),
        "new_tokens": new_tokens,
        "identical": identical,
        "modes": rows,
    }


def table(results: list[dict]) -> list[str]:
    lines = [
        "| engine | tree (total, depth, top-k) | drafting | draft ms/cycle | verify ms/cycle | tau | tokens/s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        t = r["tree"]
        for mode, m in r["modes"].items():
            lines.append(
                f"| {Path(r['engine']).name} ({r['draft']}) | ({t['total_tokens']}, {t['depth']}, "
                f"{t['top_k']}) | {mode} | {m['draft_ms_per_cycle']:.1f} | {m['verify_ms_per_cycle']:.1f} | "
                f"{m['tau']:.2f} | {m['tokens_per_s']:.1f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    for path in args.engines:
        print(f"{path}: {args.prompts} prompts x {args.new_tokens} tokens, both ways ...", file=sys.stderr)
        results.append(measure(path, args.prompts, args.new_tokens))
    lines = [
        "Batch 1, medians over prompts, both ways interleaved in one run (`python -m specdec_kit.bench.draft_cycle`).",
        "",
        *table(results),
        "",
    ]
    lines += [f"- {Path(r['engine']).name}: outputs identical both ways: {r['identical']}" for r in results]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
