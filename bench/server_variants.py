"""One serving change measured on its own (``specdec-bench-variants``): the kit's server over one engine, started
once per variant of its options, measured side by side in interleaved rounds.

A serving change (a policy setting, a scheduling path) is worth what it gains over the same server without it, on
the same machine within the same minutes: the machine's speed drifts between runs by more than most changes gain.
Each ``--variant LABEL=OPTIONS`` starts ``specdec-serve`` on the engine with those options (``--speculation cost``
unless they name a policy); a plain server (``--speculation off``) always runs beside them, since speculation
answers to plain decoding. Rounds and load are ``specdec-bench-vllm``'s: each repeat visits every level and, within
it, every server in a rotated order, each on a quiet machine; streamed greedy completions of HumanEval prompts as
token ids, ``ignore_eos``.

Reports per variant and level: tokens/s (median of the rounds, min-max), its ratio to plain decoding and to the
first variant (each paired within a round, then the median), TTFT and ITL p50, acceptance length, and whether its
greedy texts equal plain decoding's. Writes ``server_variants.{json,md,png}``. Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from specdec_kit.bench.vllm_side_by_side import (
    RESULTS,
    add_quiet_wait_option,
    load_settings,
    measure,
    plot_levels,
    summarize,
    table,
)

PLAIN = "plain"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``LABEL=OPTIONS`` -> (label, options as ``specdec-serve`` takes them, ``--speculation POLICY`` first)."""
    label, sep, options = text.partition("=")
    label = label.strip()
    if not sep or not label or label == PLAIN or "-" in label:
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected LABEL=OPTIONS with a label of letters, digits, '_' or '+' other than "
            f"'{PLAIN}' (e.g. pooled='--cost-pool 0.25')"
        )
    flags, policy = shlex.split(options), "cost"
    for i, flag in enumerate(flags):
        if flag == "--speculation" and i + 1 < len(flags):
            policy = flags.pop(i + 1)
            flags.pop(i)
            break
        if flag.startswith("--speculation="):
            policy = flags.pop(i).split("=", 1)[1]
            break
    return label, ["--speculation", policy, *flags]


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="specdec-bench-variants", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--engine", type=Path, help="engine directory (default: build or reuse the demo zoo's GRIFFIN ONNX engine)"
    )
    p.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        required=True,
        metavar="LABEL=OPTIONS",
        help="a server variant: its label and its specdec-serve options (repeat; the first is the one the others "
        "are compared with), e.g. --variant each='--cost-pool 0' --variant pooled='--cost-pool 0.25'",
    )
    p.add_argument("--concurrency", default="16", help="concurrent streams per level, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="rounds over every level and server")
    p.add_argument("--prompts", type=int, default=8, help="HumanEval prompts")
    p.add_argument(
        "--requests-per-stream", type=int, default=4, help="a level sends max(prompts, this x streams) requests"
    )
    p.add_argument("--max-tokens", type=int, default=96)
    add_quiet_wait_option(p)
    p.add_argument("--out", type=Path, default=RESULTS, help="writes server_variants.{json,md,png} and logs/ here")
    args = p.parse_args(argv)
    labels = [label for label, _ in args.variant]
    if len(set(labels)) != len(labels):
        p.error(f"--variant: labels must differ, got {labels}")
    return args


def first_variant(labels: list[str]):
    """``summarize``'s comparison: every server against the first variant."""
    return lambda server, mode: ("kit", labels[0])


def plot(summary: list[dict], modes: list[str], path: Path) -> None:
    panels = (
        ("tokens_per_s", "throughput (tokens/s, median)"),
        ("over_own_plain", "x plain decoding (median of rounds)"),
        ("itl_p50_ms", "inter-token latency p50 (ms)"),
    )
    colors = ("#7f7f7f", "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
    series = [
        {"server": "kit", "mode": mode, "style": "-", "marker": "o", "color": colors[i % len(colors)]}
        for i, mode in enumerate(modes)
    ]
    plot_levels(summary, series, panels, path, (13, 3.8), len(modes))


def main(argv=None) -> int:
    args = parse_args(argv)
    from specdec_kit.bench.engine_backends import engine_for
    from specdec_kit.bench.report import write_text_and_plot
    from specdec_kit.bench.servers import start_kit
    from specdec_kit.data.prompts import humaneval
    from specdec_kit.runtime.loader import load_tokenizer

    engine = args.engine or engine_for("griffin", "onnxruntime", Path("engines"))
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = load_tokenizer(engine / "tokenizer")  # the engine's own: prompts go as its token ids
    prompts = [tokenizer(p)["input_ids"] for p in humaneval(args.prompts)]
    variants = [(PLAIN, ["--speculation", "off"]), *args.variant]
    servers = {}
    t0 = time.time()
    try:
        for label, flags in variants:
            print(f"starting {label}: specdec-serve --engine {engine} {shlex.join(flags)}", flush=True)
            log = args.out / "logs" / f"variant-{label}.log"
            servers[f"kit-{label}"] = start_kit(label, engine, flags[1], max(levels), log, flags[2:])
            servers[f"kit-{label}"].wait_ready("/health/ready", 600)
        print(f"all {len(servers)} servers ready after {time.time() - t0:.0f} s; measuring", flush=True)
        rows = measure(servers, prompts, levels, args)
    finally:
        for server in servers.values():
            server.stop()
    labels = [label for label, _ in args.variant]
    summary = summarize(rows, compared_with=first_variant(labels))
    for row in rows:
        row.pop("texts")
    meta = {"engine": str(engine), "variants": {label: flags for label, flags in variants}, **load_settings(args)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_variants.json").write_text(
        json.dumps({"settings": meta, "summary": summary, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        f"The kit's server in {len(variants)} variants on {engine.name}, {args.prompts} HumanEval prompts as token ids, "
        f"{args.max_tokens} tokens each, T=0, {args.repeats} interleaved rounds",
        "",
        *(f"- {label}: `{shlex.join(flags)}`" for label, flags in variants),
        "",
        *table(summary, compared=f"x {labels[0]}", reference="text = plain"),
    ]
    write_text_and_plot(args.out, "server_variants", lines, lambda path: plot(summary, [PLAIN, *labels], path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
