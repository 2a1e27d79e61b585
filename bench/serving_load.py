"""The server under concurrent streaming load, speculative against plain (``specdec-bench-serving``).

Starts ``specdec-serve`` on an engine twice (``--speculation`` with the policy given, by default the server's
own, ``cost``, and ``--speculation off``), and at each concurrency level runs that many client threads, each
streaming chat requests back to back (HumanEval prompts, T=0, fixed ``max_tokens`` with ``ignore_eos``). Per
request it records the time to first token and, from vLLM-style ``continuous_usage_stats``, the inter-token latency
per token (a chunk carrying k tokens counts as k gaps of a k-th each). Reports throughput, p50/p99 TTFT and ITL,
and the server's acceptance length; writes JSON, markdown and a plot. Reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec_kit.bench.report import write_text_and_plot
from specdec_kit.bench.servers import SERVED_NAME, start_kit
from specdec_kit.bench.streams import run_level
from specdec_kit.data.prompts import humaneval
from specdec_kit.plots import concurrency_axis, legend_below, pyplot, save_figure
from specdec_kit.runtime.core.cpu import cpu_description

RESULTS = Path("bench/results")  # relative to where it runs (the repository root in the README)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="specdec-bench-serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--engine", type=Path, help="engine directory (default: build or reuse the demo zoo's GRIFFIN ONNX engine)"
    )
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=48, help="requests per concurrency level (at least one per client)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--speculation", default="cost", help="the speculative server's policy (default: the server's, cost)"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def server_tau(url: str) -> float | None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == "specdec:spec_accept_length":
            return round(family.samples[0].value, 2) if family.samples else None
    return None


def plot(rows: list[dict], path: Path, policy: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = (
        ("throughput_tok_s", "throughput (tokens/s)"),
        ("ttft_p50_ms", "time to first token p50 (ms)"),
        ("itl_p50_ms", "inter-token latency p50 (ms)"),
    )
    for mode, marker in (("speculative", "o"), ("plain", "s")):
        sel = [r for r in rows if r["mode"] == mode]
        label = f"speculative ({policy})" if mode == "speculative" else "plain"
        for ax, (key, _) in zip(axes, panels):
            ax.plot([r["concurrency"] for r in sel], [r[key] for r in sel], marker=marker, label=label)
    levels = sorted({r["concurrency"] for r in rows})
    for ax, (_, title) in zip(axes, panels):
        concurrency_axis(ax, levels)
        ax.set_ylim(bottom=0)
        ax.set_title(title)
    legend_below(fig, axes[0])
    save_figure(fig, path, tight=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    from specdec_kit.bench.engine_backends import engine_for

    engine = args.engine or engine_for("griffin", "onnxruntime", Path("engines"))
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = humaneval(32)
    rows = []
    for mode, flag in (("speculative", args.speculation), ("plain", "off")):
        server = start_kit(mode, engine, flag, max(levels), args.out / "logs" / f"serving_load-{mode}.log")
        try:
            server.wait_ready("/health/ready", 600)
            url = server.url
            run_level(url, SERVED_NAME, prompts, 1, 2, 8)  # warm-up
            for clients in levels:
                row = run_level(url, SERVED_NAME, prompts, clients, args.requests, args.max_tokens)
                row.pop("texts")
                row["mode"] = mode
                rows.append(row)
                print(
                    f"{mode:>11} x{clients:<3} {row['throughput_tok_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.1f} "
                    f"p99 {row['ttft_p99_ms']:7.1f} ms  ITL p50 {row['itl_p50_ms']:6.2f} p99 {row['itl_p99_ms']:6.2f} ms",
                    flush=True,
                )
            tau = server_tau(url)
            for row in rows:
                if row["mode"] == mode:
                    row["server_accept_length"] = tau
        finally:
            server.stop()
    ratio = {
        c: round(
            next(r["throughput_tok_s"] for r in rows if r["mode"] == "speculative" and r["concurrency"] == c)
            / next(r["throughput_tok_s"] for r in rows if r["mode"] == "plain" and r["concurrency"] == c),
            2,
        )
        for c in levels
    }
    machine = f"{cpu_description()}, CPU"
    result = {
        "engine": str(engine),
        "speculation": args.speculation,
        "max_tokens": args.max_tokens,
        "requests_per_level": args.requests,
        "machine": machine,
        "rows": rows,
        "speculative_over_plain_throughput": ratio,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_load.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"Server load: {args.requests} streaming chat requests per level, {args.max_tokens} tokens each, T=0, "
        f"speculative with --speculation {args.speculation} ({machine})",
        "",
        "| mode | streams | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tau |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['mode']} | {r['concurrency']} | {r['throughput_tok_s']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
        f"{r['itl_p50_ms']} | {r['itl_p99_ms']} | {r.get('server_accept_length')} |"
        for r in rows
    ]
    lines += ["", "speculative / plain throughput: " + ", ".join(f"{c} streams {v}x" for c, v in ratio.items())]
    write_text_and_plot(args.out, "serving_load", lines, lambda path: plot(rows, path, args.speculation))
    return 0


if __name__ == "__main__":
    sys.exit(main())
