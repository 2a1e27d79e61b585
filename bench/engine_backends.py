"""ONNX Runtime engine against PyTorch eager on the demo zoo, plain and speculative (``specdec-bench-engines``).

Builds (or reuses) the ``onnxruntime`` and ``torch`` engines of one draft method with
``export/build_engine.py``'s builder, then decodes the same HumanEval prompts with all four
combinations, interleaved within each repeat so drift hits all alike, one prompt at a time (batch 1,
the latency case). Reports medians of tokens/s, the ratios, and checks that every combination
produced the same greedy text. Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specdec_kit.bench.report import write_text_and_plot
from specdec_kit.data.prompts import humaneval
from specdec_kit.plots import pyplot, save_figure
from specdec_kit.runtime.core.cpu import cpu_description

RESULTS = Path("bench/results")  # relative to where it runs (the repository root in the README)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="specdec-bench-engines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--draft", default="griffin", choices=["griffin", "eagle", "eagle2", "hass", "medusa"])
    p.add_argument("--engines", type=Path, default=Path("engines"), help="where the engines are built or reused")
    p.add_argument("--prompts", type=int, default=8, help="HumanEval prompts")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS, help="writes engine_backends.{json,md,png} here")
    return p.parse_args(argv)


def engine_for(kind: str, backend: str, root: Path) -> Path:
    from specdec_kit.export.builder import build_engine
    from specdec_kit.export.cli import resolve_tree_dict
    from specdec_kit.export.inputs import BuildInputs, resolve_paths

    target, draft_path, tokenizer, demo = resolve_paths(kind, None, None, None)
    inputs = BuildInputs(
        draft=kind,
        target=target,
        draft_path=draft_path,
        tokenizer=tokenizer,
        backend=backend,
        dtype="float32",
        tree=resolve_tree_dict(kind, backend, demo),
        demo=demo,
    )
    return build_engine(inputs, root / f"{kind}-{backend}", device="cpu", replace_other=True).path


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{r['backend']}\n{r['mode']}" for r in rows]
    ax.bar(labels, [r["tokens_per_s"] for r in rows], color=["#4c72b0", "#4c72b0", "#dd8452", "#dd8452"])
    for i, r in enumerate(rows):
        ax.text(i, r["tokens_per_s"], f"{r['tokens_per_s']:.0f}", ha="center", va="bottom")
    ax.set_ylim(0, 1.18 * max(r["tokens_per_s"] for r in rows))
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("Demo zoo, batch 1, CPU: ONNX Runtime vs PyTorch eager")
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from specdec_kit.runtime.engine import open_engine
    from specdec_kit.runtime.loader import set_threads

    set_threads()
    engines = {b: open_engine(engine_for(args.draft, b, args.engines), device="cpu") for b in ("onnxruntime", "torch")}
    tok = engines["torch"].tokenizer
    prompts = [tok(p)["input_ids"] for p in humaneval(args.prompts)]
    combos = {
        (b, mode): engines[b].generator(speculative=(mode == "speculative"))
        for b in ("torch", "onnxruntime")
        for mode in ("plain", "speculative")
    }
    for gen in combos.values():
        gen.generate(prompts[:1], 8)  # warm-up: first calls allocate and (ONNX Runtime) plan memory
    times = {c: [] for c in combos}
    outputs: dict = {}
    tokens = {c: 0 for c in combos}
    accepted = {c: [0, 0] for c in combos}
    for rep in tqdm(range(args.repeats), desc="repeats"):
        order = list(combos) if rep % 2 == 0 else list(reversed(combos))
        for combo in order:
            elapsed, produced = 0.0, 0
            for i, p in enumerate(prompts):
                t0 = time.perf_counter()
                res = combos[combo].generate([p], args.new_tokens)[0]
                elapsed += time.perf_counter() - t0
                produced += len(res.tokens)
                outputs.setdefault(i, {})[combo] = res.tokens
                if rep == 0:
                    accepted[combo][0] += res.stats.accepted_tokens + res.stats.cycles
                    accepted[combo][1] += res.stats.cycles
            times[combo].append(produced / elapsed)
            tokens[combo] = produced
    identical = all(len({tuple(v) for v in per.values()}) == 1 for per in outputs.values())
    rows = [
        {
            "backend": b,
            "mode": m,
            "tokens_per_s": round(statistics.median(times[(b, m)]), 1),
            "tau": round(accepted[(b, m)][0] / max(accepted[(b, m)][1], 1), 2),
            "tokens": tokens[(b, m)],
        }
        for (b, m) in combos
    ]
    get = {(r["backend"], r["mode"]): r["tokens_per_s"] for r in rows}
    ratios = {
        "onnxruntime_over_torch_plain": round(get[("onnxruntime", "plain")] / get[("torch", "plain")], 2),
        "onnxruntime_over_torch_speculative": round(
            get[("onnxruntime", "speculative")] / get[("torch", "speculative")], 2
        ),
        "speculative_over_plain_torch": round(get[("torch", "speculative")] / get[("torch", "plain")], 2),
        "speculative_over_plain_onnxruntime": round(
            get[("onnxruntime", "speculative")] / get[("onnxruntime", "plain")], 2
        ),
        "onnxruntime_speculative_over_torch_plain": round(
            get[("onnxruntime", "speculative")] / get[("torch", "plain")], 2
        ),
    }
    machine = f"{cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    result = {
        "draft": args.draft,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "machine": machine,
        "rows": rows,
        "ratios": ratios,
        "greedy_outputs_identical": identical,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_backends.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"Demo zoo, {args.draft}, {args.prompts} HumanEval prompts x {args.new_tokens} tokens, batch 1, "
        f"median of {args.repeats} interleaved repeats ({machine})",
        "",
        "| backend | mode | tokens/s | tau |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {r['backend']} | {r['mode']} | {r['tokens_per_s']} | {r['tau']} |" for r in rows]
    lines += [
        "",
        *[f"- {k}: {v}x" for k, v in ratios.items()],
        f"- greedy outputs identical across all four: {identical}",
    ]
    write_text_and_plot(args.out, "engine_backends", lines, lambda path: plot(rows, path))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
