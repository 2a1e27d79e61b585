"""``specdec-bench-bandwidth``: a head's speedup over plain decoding against the memory bandwidth the machine gives at
that moment, sampled for a while.

A plain step of a small model on a CPU reads every weight once and little else, so its speed follows the memory
bandwidth; a speculative cycle verifies several tokens at once, and with ONNX Runtime's MatMul moved less with it. On
a shared machine the bandwidth a process gets moves with the other tenants' traffic, so one engine on the same
prompts can show two different speedups minutes apart. Each sample here measures a copy's GB/s (``copy_bandwidth_gbs``), then the prompts
with plain decoding and with the engine's head, taking turns (the one that goes first alternating), batch 1, greedy
(output checked identical). Writes results.json, results.md (the samples grouped by bandwidth) and results.png
(tokens/s and speedup against GB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the capital of France? Name two famous places there.",
    "Explain what a hash table is, with a short example.",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from specdec_kit.bench.head_engine import add_draft_weights_argument

    p = argparse.ArgumentParser(
        prog="specdec-bench-bandwidth", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engine", type=Path, help="an engine folder (default: the target's head engine, built if missing)")
    p.add_argument("--target", default="smollm2", help="smollm2 (the named chat target) or zoo, without --engine")
    p.add_argument("--head", default="griffin", help="the head kind, without --engine")
    add_draft_weights_argument(p)
    p.add_argument("--engines", type=Path, default=Path("engines"), help="where the default engine is built")
    p.add_argument("--seconds", type=float, default=300.0, help="how long to sample (each sample takes a few seconds)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: the demo's three)")
    p.add_argument("--out", type=Path, default=Path("bench/results/bandwidth_state"))
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.max_new_tokens < 1:
        p.error(f"expected --seconds > 0 and --max-new-tokens >= 1, got {args.seconds} and {args.max_new_tokens}")
    return args


def timed(generator, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]], object]:
    """Tokens/s over the prompts one by one, their outputs and the pooled statistics."""
    from specdec_kit.runtime.decoding.generate import RequestStats

    started = time.perf_counter()
    results = [generator.generate([ids], max_new)[0] for ids in prompts]
    seconds = time.perf_counter() - started
    tokens = sum(len(r.tokens) for r in results)
    return tokens / seconds, [r.tokens for r in results], RequestStats.combined([r.stats for r in results])


def sample(plain, method, prompts: list[list[int]], max_new: int, method_first: bool) -> dict:
    """One sample: the copy bandwidth, then plain decoding and the head taking turns."""
    from specdec_kit.runtime.core.memory_bandwidth import copy_bandwidth_gbs

    gbs = copy_bandwidth_gbs()
    order = [("method", method), ("plain", plain)] if method_first else [("plain", plain), ("method", method)]
    runs = {name: timed(generator, prompts, max_new) for name, generator in order}
    if runs["method"][1] != runs["plain"][1]:
        raise RuntimeError("LOSSLESSNESS VIOLATED: the head's greedy output differs from plain decoding's")
    stats = runs["method"][2]
    return {
        "at": time.strftime("%H:%M:%S"),
        "copy_gbs": round(gbs, 1),
        "plain_tokens_per_s": round(runs["plain"][0], 1),
        "method_tokens_per_s": round(runs["method"][0], 1),
        "speedup": round(runs["method"][0] / runs["plain"][0], 3),
        "acceptance_length": round(stats.acceptance_length, 3),
    }


def groups(samples: list[dict], width: float = 10.0) -> list[dict]:
    """The samples by bandwidth, ``width`` GB/s to a group: each group's count and medians."""
    by: dict[int, list[dict]] = {}
    for s in samples:
        by.setdefault(int(s["copy_gbs"] // width), []).append(s)
    out = []
    for key in sorted(by):
        members = by[key]
        out.append(
            {
                "copy_gbs": f"{key * width:.0f}-{(key + 1) * width:.0f}",
                "samples": len(members),
                **{
                    k: round(statistics.median(m[k] for m in members), 3 if k == "speedup" else 1)
                    for k in ("plain_tokens_per_s", "method_tokens_per_s", "speedup")
                },
            }
        )
    return out


def write_results(result: dict, out: Path) -> None:
    from specdec_kit.plots import legend_below, pyplot, save_figure

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    method = result["method"]
    lines = [
        f"Machine: {result['machine']}; {result['engine']}, batch 1, greedy, {len(result['samples'])} samples over "
        f"{result['seconds']:.0f} s",
        "",
        f"| copy GB/s | samples | plain tokens/s | {method} tokens/s | speedup (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {g['copy_gbs']} | {g['samples']} | {g['plain_tokens_per_s']:.1f} | {g['method_tokens_per_s']:.1f} | "
        f"{g['speedup']:.2f}x |"
        for g in result["groups"]
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    gbs = [s["copy_gbs"] for s in result["samples"]]
    left.scatter(gbs, [s["plain_tokens_per_s"] for s in result["samples"]], s=12, label="plain decoding")
    left.scatter(gbs, [s["method_tokens_per_s"] for s in result["samples"]], s=12, label=method)
    left.set_xlabel("memory copy GB/s at the sample")
    left.set_ylabel("tokens/s")
    left.set_ylim(bottom=0)
    right.scatter(gbs, [s["speedup"] for s in result["samples"]], s=12, color="C2")
    right.set_xlabel("memory copy GB/s at the sample")
    right.set_ylabel(f"{method} / plain decoding")
    right.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(f"{result['engine']}: speed against the machine's memory bandwidth")
    legend_below(fig, left, columns=2)
    save_figure(fig, out / "results.png")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specdec_kit.bench.head_engine import build_head_engine
    from specdec_kit.bench.lookup_bench import encode
    from specdec_kit.bench.speedup import machine
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.engine import open_engine
    from specdec_kit.runtime.loader import set_threads

    set_threads()
    path = args.engine or build_head_engine(args.target, args.head, "onnxruntime", args.draft_weights, args.engines)
    engine = open_engine(path)
    prompts = [encode(engine.tokenizer, [{"role": "user", "content": p}]) for p in args.prompt or PROMPTS]
    plain = SpeculativeGenerator(engine.target, None)
    method = SpeculativeGenerator(engine.target, engine.drafter)
    for generator in (plain, method):
        generator.generate(prompts[:1], 4)  # warm-up
    samples: list[dict] = []
    started = time.monotonic()
    with tqdm(total=round(args.seconds), desc="sampling", unit="s", file=sys.stderr) as bar:
        while time.monotonic() - started < args.seconds:
            samples.append(sample(plain, method, prompts, args.max_new_tokens, method_first=len(samples) % 2 == 0))
            bar.n = min(round(time.monotonic() - started), bar.total)
            bar.set_postfix_str(f"{samples[-1]['copy_gbs']} GB/s, {samples[-1]['speedup']:.2f}x")
    result = {
        "machine": machine(),
        "engine": f"{path.name} ({engine.draft_kind})",
        "method": engine.draft_kind,
        "seconds": time.monotonic() - started,
        "max_new_tokens": args.max_new_tokens,
        "samples": samples,
        "groups": groups(samples),
    }
    write_results(result, args.out)
    print((args.out / "results.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
