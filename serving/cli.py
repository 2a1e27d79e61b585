"""``python -m specdec_kit.serving --engine DIR`` (or ``specdec-serve``): serve an engine over the OpenAI API.

ONNX Runtime and PyTorch engines run in the embedded runtime with continuous batching. TensorRT-LLM,
SGLang and vLLM engines (or ``--backend`` forcing one) start that engine's own server through the
``serve.sh`` the builder wrote, on the same host and port, so clients, the chart and the load test
need not know which backend runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from specdec_kit.runtime.core.manifest import EngineError, read_manifest
from specdec_kit.runtime.engine_flags import add_joined_vocab_argument, joined_vocab
from specdec_kit.serving.intake import DEFAULT_MAX_REQUEST_BYTES
from specdec_kit.serving.vllm_memory import KvCacheError, is_cpu_build, kv_cache_flags

SERVER_SCRIPTS = {"tensorrt-llm": "trtllm/serve.sh", "sglang": "sglang/serve.sh", "vllm": "vllm/serve.sh"}
CONTEXT_FLAG = {"sglang": "--context-length", "vllm": "--max-model-len"}


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="specdec-serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: specdec-serve --engine engines/smollm2-griffin-onnxruntime --port 8000",
    )
    p.add_argument("--engine", type=Path, required=True, help="engine directory (export/build_engine.py)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--backend",
        choices=["embedded", "sglang", "tensorrt-llm", "vllm"],
        help="default: the engine's (embedded for onnxruntime/torch engines)",
    )
    p.add_argument("--served-model-name", help="the model id clients send (default: the engine directory's name)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="largest running batch; a vLLM-CPU engine's KV cache is sized for this many sequences of "
        "--max-model-len tokens (unless VLLM_CPU_KVCACHE_SPACE or vLLM's own sizing options are given after --)",
    )
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get 429")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECDEC_API_KEY)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument(
        "--speculation",
        default="cost",
        help="'cost' (the default: per batch size the tree, among the engine's and smaller ones, or plain "
        "decoding with the most tokens/s, from each one's measured cycles or, where it has not run, "
        "the measured target cost curve, draft cost and acceptance), 'adaptive' (a fixed schedule: the "
        "tree shrinks with load; per bucket, plain decoding where it is faster), 'off' (plain "
        "decoding), 'fixed' (the engine's tree at every batch size), or a schedule like "
        "2:1,4:0.5,16:0.25,inf:0 (batch size: fraction of the engine's tree)",
    )
    p.add_argument(
        "--cost-pool",
        type=float,
        default=0.25,
        metavar="FRACTION",
        help="with --speculation cost: a batch size a candidate has not run at is predicted from its cycles at the "
        "nearest sizes within this fraction of it (batches pass through sizes just below their largest as requests "
        "finish apart); 0: every batch size measured on its own (default: 0.25)",
    )
    p.add_argument(
        "--lookup",
        choices=["ngram", "suffix"],
        help="merge model-free drafting into a head engine's trees (as an engine built with --draft HEAD+KIND): "
        "ngram (prompt lookup) or suffix (SuffixDecoding over this request and earlier responses); with "
        "--speculation cost the server weighs the merged trees, the head's alone, the model-free draft's alone and "
        "plain decoding per batch size",
    )
    p.add_argument(
        "--lookup-settings", type=Path, metavar="FILE", help="--lookup's settings as JSON (default: its own)"
    )
    add_joined_vocab_argument(p)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds to finish running and queued requests while new ones get 503 (then exit 0)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="context limit per request (prompt + completion tokens), at most the engine's (default: the engine's)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 before they are read (default: 2 MiB)",
    )
    p.add_argument(
        "--max-unread-tokens",
        type=int,
        default=2048,
        help="a stream whose client leaves more generated tokens than this unread is stopped "
        "with a slow_reader error (bounds the memory one client can hold)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the keys and values of prompt blocks (16 tokens) an earlier request computed, so a "
        "prompt that starts like an earlier one (a shared system prompt, a chat's earlier turns) "
        "computes only what is new (default: on, as in vLLM)",
    )
    p.add_argument(
        "--prefix-cache-mib",
        type=float,
        default=512.0,
        help="memory for the prefix cache; the least recently used blocks go first (default: 512)",
    )
    p.add_argument(
        "--fold-prompt-tokens",
        type=int,
        default=4,
        metavar="N",
        help="a request joining a running batch whose prompt leaves at most N tokens to compute (past its cached "
        "blocks) is read by the next decode cycle's target call, beside the batch's draft trees, instead of a prefill "
        "call of its own; longer prompts get their own prefill (every row of a shared call is padded to its widest "
        "input: on the demo zoo at 16 streams N=4 gained 1.08x over 0, N=16 lost 0.91x); 0: every request "
        "prefilled on its own (default: 4)",
    )
    p.add_argument("--no-checksums", action="store_true", help="check file sizes only when opening the engine")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        help="after --: passed to the SGLang / trtllm-serve / vLLM server (e.g. -- --nnodes 2 --node-rank 0)",
    )
    return p.parse_args(argv)


# Where each engine's server reads its API key from: the environment, never the command line (any process listing
# shows that): vLLM reads VLLM_API_KEY itself; SGLang takes a key only as --api-key, so the engine's SGLang launcher
# (sglang/launch.py) reads it from SPECDEC_API_KEY and hands it over inside its own process.
KEY_VARIABLES = {"vllm": "VLLM_API_KEY", "sglang": "SPECDEC_API_KEY"}


def external_flags(backend: str, host: str, name: str, max_model_len: int | None) -> list[str]:
    """The options the engine's own server takes for this server's host, model name and context limit
    (trtllm-serve reads its host and port from serve.sh and takes none of them: see ``trtllm_model_link``)."""
    if backend == "tensorrt-llm":
        return []
    flags = ["--host", host, "--served-model-name", name]
    if max_model_len is not None:
        flags += [CONTEXT_FLAG[backend], str(max_model_len)]
    return flags


def key_environment(backend: str, api_key: str | None) -> dict[str, str]:
    """The variable that hands the engine's server its API key (both check it on their OpenAI routes)."""
    return {KEY_VARIABLES[backend]: api_key} if api_key else {}


def trtllm_model_link(engine: Path, name: str) -> Path:
    """trtllm-serve has no option for the served model name: it names the model after its directory. A link named
    ``name`` to the engine's target (in a fresh temporary directory) makes it serve that name."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(
            f"--served-model-name {name!r}: trtllm-serve names its model after the model directory, so "
            "the name must be a single path component (no '/')"
        )
    link = Path(tempfile.mkdtemp(prefix="specdec-served-")) / name
    link.symlink_to((engine / "target").resolve(), target_is_directory=True)
    return link


def launch_external(
    engine: Path, backend: str, flags: list[str], extra: list[str], port: int, env_extra: dict[str, str] | None = None
) -> int:
    """Replace this process with the engine's own server (SGLang, trtllm-serve or vLLM)."""
    script = engine / SERVER_SCRIPTS[backend]
    if not script.is_file():
        print(f"error: {script}: missing; build the engine with --backend {backend}", file=sys.stderr)
        return 2
    env = dict(os.environ, PORT=str(port), **(env_extra or {}))
    cmd = ["bash", str(script), *flags, *(a for a in extra if a != "--")]
    print(f"starting the {backend} server: {' '.join(cmd)} (PORT={port})", flush=True)
    os.execvpe("bash", cmd, env)
    return 0  # not reached


def vllm_interpreter() -> str | None:
    """The Python a vLLM engine's ``serve.sh`` runs (``$SPECDEC_VLLM_PYTHON``, the vLLM tier's ``.venv-vllm``, else
    ``python``), checked to import vLLM; None after saying what is missing (inside the engine folder, its ``vllm/``
    would shadow a missing package and fail with a puzzling "No module named 'vllm.entrypoints'")."""
    import shutil

    from specdec_kit.paths import has_vllm, missing_vllm, vllm_python

    python = vllm_python(default=shutil.which("python") or "python")
    if not has_vllm(python):
        print(f"error: {missing_vllm(python)}", file=sys.stderr)
        return None
    return python


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.server_args and args.server_args != ["--"] and (args.backend or "") == "embedded":
        print(
            "error: arguments after -- go to an SGLang, TensorRT-LLM or vLLM server, not the embedded one",
            file=sys.stderr,
        )
        return 2
    try:
        manifest = read_manifest(args.engine, checksums=not args.no_checksums)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    backend = args.backend or ("embedded" if manifest["backend"] in ("onnxruntime", "torch") else manifest["backend"])
    if backend != "embedded":
        if manifest["backend"] != backend:
            print(
                f"error: {args.engine} is a {manifest['backend']} engine; --backend {backend} needs an engine built "
                f"with --backend {backend}",
                file=sys.stderr,
            )
            return 2
        if backend == "tensorrt-llm" and args.api_key:
            print(
                "error: an API key (--api-key or $SPECDEC_API_KEY) was given, but trtllm-serve takes none and would "
                "serve without checking it; put an authenticating gateway in front of it, or unset the key",
                file=sys.stderr,
            )
            return 2
        name = args.served_model_name or args.engine.resolve().name
        env_extra = {}
        if backend == "tensorrt-llm":
            try:
                env_extra["SPECDEC_MODEL_DIR"] = str(trtllm_model_link(args.engine, name))
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        flags = external_flags(backend, args.host, name, args.max_model_len)
        if backend == "vllm":
            python = vllm_interpreter()
            if python is None:
                return 2
            env_extra["SPECDEC_VLLM_PYTHON"] = python
            if is_cpu_build(python):
                try:
                    cache, note = kv_cache_flags(
                        args.engine, manifest, args.max_model_len, args.max_num_seqs, args.server_args, os.environ
                    )
                except KvCacheError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 2
                flags += cache
                if note:
                    print(note, flush=True)
        env_extra.update(key_environment(backend, args.api_key))
        return launch_external(args.engine, backend, flags, args.server_args, args.port, env_extra)

    import uvicorn

    from specdec_kit.runtime.engine import attach_lookup, open_engine
    from specdec_kit.runtime.heap import freeze_heap
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.serving.app import ServerConfig, create_app
    from specdec_kit.serving.cost_policy import CostPolicy, speculation_candidates
    from specdec_kit.serving.lifecycle import DrainingServer, listening_socket
    from specdec_kit.serving.metrics import ServerMetrics
    from specdec_kit.serving.policy import SpeculationPolicy, default_schedule, parse_schedule
    from specdec_kit.serving.scheduler import Scheduler

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_threads()
    try:
        engine = open_engine(  # read_manifest checked the checksums
            args.engine, device=args.device, checksums=False, joined_vocab=joined_vocab(args)
        )
        if args.lookup:
            engine = attach_lookup(engine, args.lookup, args.lookup_settings)
        elif args.lookup_settings is not None:
            raise ValueError("--lookup-settings: give --lookup KIND too")
        if args.fold_prompt_tokens < 0:
            raise ValueError(f"--fold-prompt-tokens {args.fold_prompt_tokens}: expected 0 or more")
        if args.max_model_len is not None and not 2 <= args.max_model_len <= engine.target.max_context:
            raise ValueError(
                f"--max-model-len {args.max_model_len}: expected 2 to {engine.target.max_context} "
                "(the engine's context)"
            )
        mode = args.speculation
        if mode == "adaptive":
            policy = SpeculationPolicy(default_schedule(engine.tree))
        elif mode == "cost":
            if args.cost_pool < 0:
                raise ValueError(f"--cost-pool {args.cost_pool}: expected a fraction >= 0")
            policy = CostPolicy(speculation_candidates(engine), pool=args.cost_pool)
        elif mode == "fixed":
            policy = SpeculationPolicy([(1 << 30, engine.tree)], adaptive=False)
        elif mode == "off":
            policy = SpeculationPolicy([(1 << 30, None)], adaptive=False)
        else:
            policy = SpeculationPolicy(parse_schedule(mode, engine.tree))
    except (EngineError, ValueError) as exc:  # DraftLoadError (a settings file) is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.engine.resolve().name
    config = ServerConfig(
        model_name=name,
        api_key=args.api_key,
        max_num_seqs=args.max_num_seqs,
        max_queue=args.max_queue,
        drain_timeout=args.drain_timeout,
        max_request_bytes=args.max_request_bytes,
        max_model_len=args.max_model_len,
    )
    metrics = ServerMetrics(name)
    try:
        scheduler = Scheduler(
            engine,
            metrics,
            policy,
            args.max_num_seqs,
            args.max_queue,
            args.max_unread_tokens,
            args.prefix_cache_mib if args.enable_prefix_caching else 0.0,
            args.fold_prompt_tokens,
        )
    except ValueError as exc:
        print(f"error: --prefix-cache-mib: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine, config, scheduler, metrics)
    graph = getattr(engine.target, "graph", None)  # an ONNX Runtime target step: which MatMul it runs, and why
    kernel = f", target MatMuls: kit's PackedMatMul {graph.packed_matmul}" if graph is not None else ""
    kernel += ", draft vocabulary as trained (--joined-vocab off)" if not joined_vocab(args) else ""
    print(
        f"serving {name} ({engine.backend} engine, {engine.draft_kind} draft, speculation {mode}{kernel}) on "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10),
        scheduler,
        args.drain_timeout,
    )
    freeze_heap()  # start-up's objects out of the collector's walks: no 165 ms stall in a batch's cycle
    server.run(sockets=[listening_socket(args.host, args.port)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
