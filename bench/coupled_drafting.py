"""``python -m specdec_kit.bench.coupled_drafting``: what ranking a sampled row's draft children by its draws gains.

At T > 0 a feature draft ranks each node's candidate children by their chances of being the target's seeded draw
(``runtime/core/coupling.py``) instead of by its own probabilities. This benchmark decodes the same prompts at batch 1
and one temperature three ways, interleaved prompt by prompt on one engine: plain sampling, the head ranking by its
probabilities (uncoupled), and the head ranking by the draws (coupled), each prompt with its own seed. It reports the
acceptance length of both drafts, their draft and verification milliseconds per cycle, decoding tokens/s (the
prefill left out: it is plain decoding's in all three) and the median per-prompt ratio to plain, and checks that all
three produced the same tokens. Prompts: the lookup benchmark's Spec-Bench categories (multi-turn second turns after
the target's own greedy first answers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

MODES = ("plain", "uncoupled", "coupled")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.bench.coupled_drafting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("engine", type=Path, help="an engine directory with a feature draft (GRIFFIN, EAGLE, EAGLE-3)")
    p.add_argument("--categories", default="qa,multi_turn,math_reasoning,translation,summarization")
    p.add_argument("--prompts", type=int, default=6, help="prompts per category")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--out", type=Path, default=Path("bench/results/coupled_drafting"), help="writes OUT.json, OUT.md")
    return p.parse_args(argv)


def measure(path: Path, categories: list[str], prompts: int, new_tokens: int, temperature: float) -> dict:
    from specdec_kit.bench.lookup_bench import prompt_sets
    from specdec_kit.runtime.core.sampling import SamplingParams
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.decoding.generate import RequestStats, SpeculativeGenerator
    from specdec_kit.runtime.engine import open_engine

    engine = open_engine(path)
    plain = SpeculativeGenerator(engine.target, NoDrafter())
    uncoupled = engine.drafter_for(engine.tree)
    if not uncoupled.couples_draws:
        raise SystemExit(f"{path}: its {engine.manifest['draft']['kind']} draft does not rank children by the draws")
    uncoupled.couples_draws = False
    gens = {
        "plain": plain,
        "uncoupled": SpeculativeGenerator(engine.target, uncoupled),
        "coupled": SpeculativeGenerator(engine.target, engine.drafter_for(engine.tree)),
    }
    sets = prompt_sets(categories, prompts, engine.tokenizer, plain, new_tokens)
    ids = [p for ps in sets.values() for p in ps]
    for gen in gens.values():  # sessions warm
        gen.generate(ids[:1], 4, SamplingParams(temperature=temperature, seed=0))
    stats: dict[str, list] = {mode: [] for mode in MODES}
    identical = True
    for i, prompt in enumerate(ids):
        tokens = []
        for mode, gen in gens.items():
            result = gen.generate([prompt], new_tokens, SamplingParams(temperature=temperature, seed=i))[0]
            stats[mode].append(result.stats)
            tokens.append(result.tokens)
        identical &= tokens[0] == tokens[1] == tokens[2]
    rows = {}
    for mode in MODES:
        total = RequestStats.combined(stats[mode])
        rows[mode] = {
            "tokens_per_s": statistics.median(1 / s.decode_s_per_token for s in stats[mode]),
            "x_plain": statistics.median(
                p.decode_s_per_token / s.decode_s_per_token for s, p in zip(stats[mode], stats["plain"])
            ),
            **(
                {
                    "tau": total.acceptance_length,
                    "draft_ms_per_cycle": 1000 * total.draft_s / total.cycles,
                    "verify_ms_per_cycle": 1000 * total.verify_s / total.cycles,
                }
                if mode != "plain"
                else {}
            ),
        }
    return {
        "engine": str(path),
        "draft": engine.manifest["draft"]["kind"],
        "tree": engine.manifest["tree"],
        "categories": categories,
        "prompts": len(ids),
        "new_tokens": new_tokens,
        "temperature": temperature,
        "identical": identical,
        "modes": rows,
    }


def table(result: dict) -> list[str]:
    lines = [
        "| drafting | tau | draft ms/cycle | verify ms/cycle | decoding tokens/s | x plain (median ratio) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, m in result["modes"].items():
        cells = (
            [f"{m['tau']:.3f}", f"{m['draft_ms_per_cycle']:.1f}", f"{m['verify_ms_per_cycle']:.1f}"]
            if "tau" in m
            else ["-"] * 3
        )
        lines.append(f"| {mode} | {' | '.join(cells)} | {m['tokens_per_s']:.1f} | {m['x_plain']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    categories = [c for c in args.categories.split(",") if c]
    print(f"{args.engine}: {args.prompts} prompts x {len(categories)} categories, three ways ...", file=sys.stderr)
    result = measure(args.engine, categories, args.prompts, args.new_tokens, args.temperature)
    lines = [
        f"{Path(result['engine']).name} ({result['draft']}), T={result['temperature']}, batch 1, {result['prompts']} "
        f"prompts ({', '.join(categories)}) x {result['new_tokens']} tokens, the three interleaved prompt by prompt "
        "in one run (`python -m specdec_kit.bench.coupled_drafting`); medians over prompts, tau over all cycles.",
        "",
        *table(result),
        "",
        f"- the same tokens all three ways: {result['identical']}",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
