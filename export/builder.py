"""Build one engine directory: load and check the inputs, write the backend's artifacts into a staging
directory beside the output, write the manifest last, then move the whole directory into place.

A failure at any point removes the staging directory, so an output path either holds a complete,
verified engine or is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from specdec_kit import __version__
from specdec_kit.export.engine_cache import build_lock, engine_files
from specdec_kit.export.engine_rules import check_engine_rules
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.export.quantize import DRAFT_WEIGHTS, TARGET_WEIGHTS, WeightFormat
from specdec_kit.export.trtllm_pytorch import check_legacy_release
from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.device import DTYPES
from specdec_kit.runtime.core.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    EngineError,
    file_entries,
    read_manifest,
    write_manifest,
)
from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_from_dict
from specdec_kit.runtime.loader import load_draft_for, load_tokenizer
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import draft_kind, kinds_for_engine

PARITY_PROMPTS = ["def add(a, b):\n    return", "import os\n\n\nclass Config:\n"]


@dataclass
class BuildResult:
    path: Path
    manifest: dict[str, Any]
    reused: bool
    seconds: float


def target_spec(target: TargetModel) -> dict[str, Any]:
    cfg = target.config
    return {
        "architecture": target.architecture,
        "num_hidden_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": target.vocab_size,
        "max_context": target.max_context,
        "rms_norm_eps": cfg.rms_norm_eps,
        "eos_token_ids": target.eos_token_ids(),
        **({"feature_layers": list(target.feature_layers)} if target.feature_layers else {}),
    }


def draft_spec(kind: str, module) -> dict[str, Any]:
    """The manifest's ``draft`` section: the kind and its family's fields for the module."""
    return {**draft_kind(kind).family.manifest_spec(module), "kind": kind}


def check_parallel(inputs: BuildInputs) -> None:
    """TP must split every head group evenly; the embedded backends run on one device. Read from the target's
    config.json before anything is loaded or written, so a bad --tp is reported as such."""
    tp, pp = inputs.tp, inputs.pp
    if tp < 1 or pp < 1:
        raise BuildError(f"--tp and --pp must be >= 1, found tp={tp}, pp={pp}")
    if inputs.backend in ("onnxruntime", "torch") and tp * pp != 1:
        raise BuildError(
            f"--tp/--pp apply to the tensorrt-llm, sglang and vllm backends; the {inputs.backend} "
            f"backend runs on one device (found tp={tp}, pp={pp})"
        )
    config_file = inputs.target / "config.json"
    try:
        config = json.loads(config_file.read_text())
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BuildError(
            f"{config_file}: cannot read the target's head and layer counts ({type(exc).__name__}: {exc})"
        ) from None
    if heads % tp:
        raise BuildError(f"{config_file}: num_attention_heads = {heads} is not divisible by --tp {tp}")
    if kv % tp and tp % kv:  # fewer KV heads than ranks is fine when each is replicated evenly
        raise BuildError(f"{config_file}: num_key_value_heads = {kv} and --tp {tp}: neither divides the other")
    if layers % pp:
        raise BuildError(f"{config_file}: num_hidden_layers = {layers} is not divisible by --pp {pp}")


def check_output(output: Path) -> None:
    """The output must be a directory (or not exist yet)."""
    if output.exists() and not output.is_dir():
        raise BuildError(f"--output {output}: is a file, expected an engine directory (a new or an existing one)")


def check_target_store(inputs: BuildInputs) -> None:
    """A shared target store is for engines that carry the target checkpoint, and must be a directory."""
    store = inputs.target_store
    if store is None:
        return
    if inputs.backend in ("onnxruntime", "torch"):
        raise BuildError(
            f"--target-store {store}: {inputs.backend} engines hold the target in their own form; only server "
            "engines (vllm, sglang, tensorrt-llm) carry the target checkpoint a store shares"
        )
    if store.exists() and not store.is_dir():
        raise BuildError(f"--target-store {store}: is a file, expected a directory (new or existing)")


def check_weights(inputs: BuildInputs) -> tuple[WeightFormat | None, WeightFormat | None]:
    """The target's and the draft's weight formats. Quantized weights are an ONNX Runtime engine's (the serving
    engines quantize in their own ways), and a model-free draft has no weights."""
    formats = []
    for flag, name, table in (
        ("--weights", inputs.weights, TARGET_WEIGHTS),
        ("--draft-weights", inputs.draft_weights, DRAFT_WEIGHTS),
    ):
        if name not in table:
            raise BuildError(f"{flag} {name}: expected one of {', '.join(table)}")
        if name != "float" and inputs.backend != "onnxruntime":
            raise BuildError(
                f"{flag} {name}: quantized weights are built for the onnxruntime backend; --backend "
                f"{inputs.backend} serves the checkpoints in --dtype (quantize with that engine's own tools, e.g. a "
                "pre-quantized checkpoint as --target)"
            )
        formats.append(table[name])
    if formats[1] is not None and inputs.draft_path is None:
        raise BuildError(f"--draft-weights {inputs.draft_weights}: a {inputs.draft} draft has no weights to quantize")
    return formats[0], formats[1]


def check_extra_trees(inputs: BuildInputs) -> None:
    """Extra trees are one-call draft graphs beside the engine's own: an ONNX Runtime engine of a kind that drafts a
    dynamic tree in a graph, built with that graph."""
    if not inputs.extra_trees:
        return
    family = draft_kind(inputs.draft).family
    has_graph = inputs.backend == "onnxruntime" and inputs.draft_tree and family.tree_graphs
    if not has_graph or not isinstance(tree_from_dict(inputs.tree), DynamicTreeConfig):
        raise BuildError(
            f"--extra-trees: one-call draft graphs beside the engine's own, and a {inputs.draft} draft on "
            f"{inputs.backend} with tree {inputs.tree}{'' if inputs.draft_tree else ' and --no-draft-tree'} has none "
            "(an onnxruntime engine of an EAGLE-style, HASS, GRIFFIN or EAGLE-3 draft with a dynamic tree has)"
        )


def check_draft_format(inputs: BuildInputs) -> None:
    """The speculators format is a vLLM engine's, for the kinds whose draft vLLM reads in it."""
    if inputs.draft_format == "official":
        return
    if inputs.draft_format != "speculators":
        raise BuildError(f"--draft-format {inputs.draft_format}: expected official or speculators")
    if inputs.backend != "vllm":
        raise BuildError(
            f"--draft-format speculators: a vLLM engine's draft layout; --backend {inputs.backend} reads the official "
            "layout"
        )
    kinds = [k for k in kinds_for_engine("vllm") if draft_kind(k).engines["vllm"].speculators]
    if inputs.draft not in kinds or inputs.lookup:
        raise BuildError(
            f"--draft-format speculators: vLLM reads {', '.join(kinds)} drafts in the speculators format, not "
            f"{inputs.draft_spec}"
        )


def _existing(output: Path, digest: str) -> dict | None:
    """The manifest at ``output`` if it is a valid engine built from these exact inputs, else None."""
    if not (output / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = read_manifest(output)
    except EngineError:
        return None
    return manifest if manifest.get("inputs", {}).get("sha256") == digest else None


def _staging_dir(output: Path) -> Path:
    parent = output.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=parent))
    except OSError as exc:
        raise BuildError(f"--output {output}: cannot write in {parent} ({exc.strerror or exc})") from exc
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the engine is an ordinary directory
    return staging


def _move_into_place(staging: Path, output: Path) -> None:
    """Replace ``output`` with ``staging`` (renames within one directory: never half an engine at ``output``)."""
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
    staging.rename(output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _save_checkpoints(staging: Path, target: TargetModel, kind: str, module) -> dict[str, str]:
    """The PyTorch backend's artifacts: the target and the draft in their own layouts (safetensors)."""
    target.hf_model.save_pretrained(staging / "target", safe_serialization=True)
    save_draft(module, staging / "draft", kind, safetensors=True)
    return {"target": "target", "draft": "draft"}


def build_engine(
    inputs: BuildInputs,
    output: Path,
    force: bool = False,
    device: str | torch.device = "cpu",
    step: Callable[[str], None] = lambda msg: None,
    replace_other: bool = False,
) -> BuildResult:
    """Build the engine of ``inputs`` at ``output``, or reuse the one there built from the same inputs. An engine
    there from other inputs is an error unless ``replace_other`` (a tool's own engine directory, e.g. a
    benchmark's, rebuilt after a head or the kit changed); ``force`` rebuilds even an identical one."""
    start = time.perf_counter()
    step("hashing inputs")
    inputs.hash_files()
    digest = inputs.digest()
    check_parallel(inputs)
    check_legacy_release(inputs.trtllm_legacy_engine, inputs.draft, inputs.backend)
    check_engine_rules(inputs.backend, inputs.draft_spec, inputs.pp, inputs.trtllm_legacy_engine)
    check_output(output)
    check_target_store(inputs)
    weights = check_weights(inputs)
    check_draft_format(inputs)
    check_extra_trees(inputs)
    with output_lock(output, step):
        return _build_locked(inputs, output, digest, force, device, step, start, weights, replace_other)


@contextlib.contextmanager
def output_lock(output: Path, step: Callable[[str], None]) -> Iterator[None]:
    """One build of an output at a time (two build Jobs of one engine, or two people): the second waits for the
    first, then finds its engine and reuses it, instead of both moving a directory into the same place."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        handle = open(build_lock(output), "a")
    except OSError as exc:
        raise BuildError(f"--output {output}: cannot write in {output.parent} ({exc.strerror or exc})") from exc
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            step(f"waiting for another build of {output} to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _build_locked(
    inputs: BuildInputs,
    output: Path,
    digest: str,
    force: bool,
    device: str | torch.device,
    step: Callable[[str], None],
    start: float,
    weights: tuple[WeightFormat | None, WeightFormat | None],
    replace_other: bool = False,
) -> BuildResult:
    if output.exists() and not force:
        found = _existing(output, digest)
        if found is not None:
            return BuildResult(output, found, reused=True, seconds=time.perf_counter() - start)
        if replace_other:
            step(f"{output} holds an engine built from other inputs: rebuilding it")
        elif any(output.iterdir()):
            raise BuildError(
                f"--output {output}: exists and is not an engine built from these inputs; "
                "pass --force to replace it or choose another --output"
            )
    dtype = DTYPES[inputs.dtype]
    step(f"loading target {inputs.target}")
    target = TargetModel.from_pretrained(inputs.target, dtype=dtype, device=device)
    step(f"loading {inputs.draft} draft {inputs.draft_path or '(model-free: its settings)'}")
    module = load_draft_for(target, inputs.draft, inputs.draft_path or inputs.lookup_path)
    target = draft_kind(inputs.draft).family.target_for(target, module)  # EAGLE-3: the target's tapped layers
    tree = tree_from_dict(inputs.tree)
    tokenizer = load_tokenizer(inputs.tokenizer)
    if len(tokenizer) > target.vocab_size:
        raise BuildError(
            f"{inputs.tokenizer}: tokenizer has {len(tokenizer)} tokens, more than the target's "
            f"vocab_size {target.vocab_size}; it is not this target's tokenizer"
        )
    manifest_target, manifest_draft = target_spec(target), draft_spec(inputs.draft, module)
    lookup_settings = None
    if inputs.lookup:  # a hybrid: the head's draft, and the model-free kind merged into its trees
        lookup_settings = load_draft_for(target, inputs.lookup, inputs.lookup_path)
        manifest_draft["lookup"] = draft_spec(inputs.lookup, lookup_settings)
    staging = _staging_dir(output)
    try:
        tokenizer.save_pretrained(staging / "tokenizer")
        extra: dict[str, Any] = {}
        if inputs.backend == "onnxruntime":
            from specdec_kit.export.onnx_build import build_onnx

            prompts = [tokenizer(p)["input_ids"] for p in PARITY_PROMPTS]
            target_weights, draft_weights = weights
            extra = build_onnx(
                staging,
                target,
                inputs.draft,
                module,
                tree,
                manifest_target,
                manifest_draft,
                prompts,
                step,
                draft_tree=inputs.draft_tree,
                target_weights=target_weights,
                draft_weights=draft_weights,
                extra_trees=[tree_from_dict(t) for t in inputs.extra_trees],
            )
        elif inputs.backend == "torch":
            step("writing the target and draft checkpoints (safetensors)")
            extra = {"artifacts": _save_checkpoints(staging, target, inputs.draft, module)}
        else:
            from specdec_kit.export.servers import build_server_export

            extra = build_server_export(staging, inputs, target, module, tree, step, lookup_settings)
        step("writing manifest.json")
        files = engine_files(staging)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "kit_version": __version__,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "backend": inputs.backend,
            "dtype": inputs.dtype,
            "inputs": {
                "sha256": digest,
                "target": str(inputs.target),
                "draft": str(inputs.draft_path),
                **({"lookup_settings": str(inputs.lookup_path)} if inputs.lookup_path else {}),
                **({"target_store": str(inputs.target_store)} if inputs.target_store else {}),
                "tokenizer": str(inputs.tokenizer),
                "demo_zoo": inputs.demo,
                "options": inputs.options(),
                "files": inputs.file_hashes,
            },
            "target": manifest_target,
            "draft": manifest_draft,
            "tree": inputs.tree,
            "tokenizer": {
                "path": "tokenizer",
                "class": type(tokenizer).__name__,
                "size": len(tokenizer),
                "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            },
            "parallel": {"tp": inputs.tp, "pp": inputs.pp},
            "artifacts": extra.pop("artifacts"),
            **extra,
            "build": {
                "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
                "host": platform.node(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "device": str(target.device),
                "seconds": round(time.perf_counter() - start, 1),
            },
            "files": file_entries(staging, files),
        }
        write_manifest(staging, manifest)
        read_manifest(staging)  # what we wrote must pass the reader's own checks
        _move_into_place(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return BuildResult(output, manifest, reused=False, seconds=time.perf_counter() - start)
