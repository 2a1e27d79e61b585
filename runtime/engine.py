"""Open an engine directory (``export/build_engine.py``'s output) as a ready generator.

The manifest decides everything: backend, dtype, tree, tokenizer; the caller only says where to run
(device) and may assert what it expects (backend, draft kind) so that a mismatched engine is refused
before it serves anything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from specdec_kit.runtime.core.contract import TargetStep
from specdec_kit.runtime.core.device import DTYPES, resolve_device
from specdec_kit.runtime.core.manifest import (
    ONNX_GRAPH_INTERFACE,
    ONNX_GRAPH_INTERFACE_NEWEST,
    EngineError,
    draft_label,
    read_manifest,
)
from specdec_kit.runtime.core.trees import tree_from_dict
from specdec_kit.runtime.decoding.drafting import Drafter, NoDrafter
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.joined_vocab import keep_draft_vocabulary
from specdec_kit.runtime.loader import load_tokenizer
from specdec_kit.runtime.registry import draft_kind, lookup_drafter

EMBEDDED_BACKENDS = ("onnxruntime", "torch")


@dataclass
class Engine:
    """A loaded engine: target and drafter on one backend, its tree and tokenizer, and its manifest."""

    path: Path
    manifest: dict[str, Any]
    target: TargetStep  # TargetModel or OrtTarget
    drafter: Drafter
    tokenizer: Any
    tree: Any
    drafter_for: Callable[[Any], Drafter]  # the engine's draft with another tree than its manifest's (same sessions)

    @property
    def backend(self) -> str:
        return self.manifest["backend"]

    @property
    def draft_kind(self) -> str:
        """The draft as ``--draft`` names it (a hybrid: ``griffin+suffix``)."""
        return draft_label(self.manifest)

    def generator(self, speculative: bool = True) -> SpeculativeGenerator:
        """The generation loop over this engine; ``speculative=False`` gives plain decoding on the same target."""
        decode = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer is not None else None
        return SpeculativeGenerator(self.target, self.drafter if speculative else NoDrafter(), decode=decode)


def _expect(manifest: dict, path: Path, key: str, found: Any, expected: Any) -> None:
    if expected is not None and found != expected:
        raise EngineError(
            f"{path / 'manifest.json'}: {key} is {found!r}, expected {expected!r}; "
            "this engine was built for something else (rebuild it or pick another)"
        )


TARGET_KEYS = (
    "architecture",
    "num_hidden_layers",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "max_context",
)


def _require(manifest: dict, root: Path, section: str, keys) -> None:
    missing = [k for k in keys if k not in manifest[section]]
    if missing:
        raise EngineError(f"{root / 'manifest.json'}: key {section}.{missing[0]} is missing")


def rebuild_command(manifest: dict) -> str:
    """The builder's command that made this engine, forced to build again; when something else built it (a
    benchmark, a test), the builder's command for its draft kind."""
    command = manifest.get("build", {}).get("command") or [""]
    name = Path(command[0]).name
    if name == "build_engine.py":
        return " ".join(["python", "export/build_engine.py", *command[1:], "--force"])
    if name == "specdec-build-engine":
        return " ".join([name, *command[1:], "--force"])
    return f"python export/build_engine.py --draft {manifest['draft']['kind']} ... --force"


def _ort_components(root: Path, manifest: dict, device: torch.device, tree, joined_vocab: bool):
    from specdec_kit.runtime.ort.backend import OrtGraph, OrtTarget, providers_for

    family = draft_kind(manifest["draft"]["kind"]).family
    _require(manifest, root, "target", TARGET_KEYS)
    _require(manifest, root, "draft", family.manifest_keys)
    dtype = DTYPES[manifest["dtype"]]
    onnx_info = manifest.get("onnx", {})
    interface = onnx_info.get("graph_interface", 1)
    if interface != ONNX_GRAPH_INTERFACE:
        raise EngineError(
            f"{root}: its ONNX graphs have interface {interface} and this kit runs interface "
            f"{ONNX_GRAPH_INTERFACE} ({ONNX_GRAPH_INTERFACE_NEWEST}); rebuild the engine with "
            f"{rebuild_command(manifest)}"
        )
    provider = providers_for(device)[0]
    provider = provider[0] if isinstance(provider, tuple) else provider
    use_optimized = provider in onnx_info.get("optimized_for", [])
    arts = manifest["artifacts"]

    @functools.cache  # one session per graph, whatever trees its drafters use
    def graph(role: str) -> OrtGraph:
        key = f"{role}_optimized" if use_optimized else role
        if key not in arts:
            raise EngineError(f"{root / 'manifest.json'}: key artifacts.{key} is missing")
        return OrtGraph(root / arts[key], device, optimize=not use_optimized)

    target = OrtTarget(graph("target_step"), manifest["target"], dtype)
    drafts = manifest if joined_vocab else _without_joined_vocab(manifest)  # then its file is never read
    return target, lambda tree: family.ort_drafter(graph, drafts, target, tree)


def _keeping_vocabulary(drafter_for: Callable[[Any], Drafter]) -> Callable[[Any], Drafter]:
    return lambda tree: keep_draft_vocabulary(drafter_for(tree))


def _without_joined_vocab(manifest: dict) -> dict:
    """The manifest as an ONNX Runtime engine's drafters read it when no request's tokens join the draft vocabulary."""
    onnx = {key: value for key, value in manifest.get("onnx", {}).items() if key != "joined_vocab"}
    return dict(manifest, onnx=onnx)


def hybrid_drafter_for(
    lookup_kind: str, settings: Any, head_drafter_for: Callable[[Any], Drafter]
) -> Callable[[Any], Drafter]:
    """Drafters of the head on each tree, merged with the model-free kind (its settings, its own tree)."""
    from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter

    return lambda head_tree: HybridDrafter(head_drafter_for(head_tree), lookup_drafter(lookup_kind, settings))


def with_lookup(root: Path, manifest: dict, head_drafter_for: Callable[[Any], Drafter]) -> Callable[[Any], Drafter]:
    """A hybrid engine's drafters, from the model-free kind and settings its manifest names."""
    lookup = manifest["draft"]["lookup"]
    try:
        kind = draft_kind(lookup["kind"])
        if not kind.model_free:
            raise ValueError(f"{lookup['kind']!r} is not a model-free kind")
        settings = kind.build(lookup["settings"], root / "manifest.json", 0, 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{root / 'manifest.json'}: key draft.lookup is invalid ({exc})") from exc
    return hybrid_drafter_for(lookup["kind"], settings, head_drafter_for)


def attach_lookup(engine: Engine, lookup_kind: str, settings_path: Path | None = None) -> Engine:
    """``engine`` with a model-free kind merged into its head's trees (``specdec-serve --lookup suffix``): the engine
    a hybrid build would make, from an engine already built."""
    from specdec_kit.runtime.checkpoint import load_lookup_settings
    from specdec_kit.runtime.registry import hybrid_parts

    head, lookup = hybrid_parts(f"{engine.draft_kind}+{lookup_kind}")
    return merge_lookup(engine, lookup, load_lookup_settings(settings_path, lookup))


def merge_lookup(engine: Engine, lookup: str, settings: Any) -> Engine:
    """``engine`` with the model-free kind ``lookup``, on ``settings``, merged into its head's trees (the pair
    checked by the caller: ``hybrid_parts``)."""
    drafter_for = hybrid_drafter_for(lookup, settings, engine.drafter_for)
    draft = dict(engine.manifest["draft"], lookup={"kind": lookup, **draft_kind(lookup).family.manifest_spec(settings)})
    return replace(
        engine, manifest=dict(engine.manifest, draft=draft), drafter=drafter_for(engine.tree), drafter_for=drafter_for
    )


def open_engine(
    path: str | Path,
    device: str | torch.device | None = None,
    checksums: bool = True,
    expect_backend: str | None = None,
    expect_draft: str | None = None,
    joined_vocab: bool = True,
) -> Engine:
    """Verify and load an engine for the embedded runtime (ONNX Runtime or PyTorch backends). ``joined_vocab=False``:
    a head with a reduced draft vocabulary keeps it as trained, no request's own tokens join it
    (``decoding/joined_vocab.py``; the output is the target's either way, only acceptance and draft cost change)."""
    root = Path(path)
    manifest = read_manifest(root, checksums=checksums)
    _expect(manifest, root, "backend", manifest["backend"], expect_backend)
    _expect(manifest, root, "draft kind", draft_label(manifest), expect_draft)
    backend = manifest["backend"]
    if manifest["dtype"] not in DTYPES:
        raise EngineError(f"{root / 'manifest.json'}: dtype {manifest['dtype']!r}; expected one of {sorted(DTYPES)}")
    if backend not in EMBEDDED_BACKENDS:
        commands = manifest.get("serve", {}).get("commands", {})
        serve = commands.get("serve", "the engine's serve.sh")
        raise EngineError(
            f"{root}: a {backend} engine runs in {backend}'s own server, not the embedded runtime; "
            f"serve it with: {serve}"
        )
    dev = resolve_device(device)
    try:
        kind = draft_kind(manifest["draft"]["kind"])
    except ValueError as exc:
        raise EngineError(f"{root / 'manifest.json'}: key draft.kind: {exc}") from None
    try:
        tree = tree_from_dict(manifest["tree"])
        kind.family.check_tree(tree)
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{root / 'manifest.json'}: key 'tree' is invalid ({exc})") from exc
    if backend == "onnxruntime":
        target, drafter_for = _ort_components(root, manifest, dev, tree, joined_vocab)
    else:
        from specdec_kit.runtime.loader import load_draft_for
        from specdec_kit.runtime.models.target import TargetModel

        arts = manifest["artifacts"]
        target = TargetModel.from_pretrained(root / arts["target"], dtype=manifest["dtype"], device=dev)
        module = load_draft_for(target, manifest["draft"]["kind"], root / arts["draft"])
        drafter_for = functools.partial(kind.family.torch_drafter, module, target)
        if not joined_vocab:  # a PyTorch head's joined tokens come from the target already loaded, not a file
            drafter_for = _keeping_vocabulary(drafter_for)
    if "lookup" in manifest["draft"]:
        drafter_for = with_lookup(root, manifest, drafter_for)
    tokenizer = load_tokenizer(root / manifest["tokenizer"]["path"])
    return Engine(
        path=root,
        manifest=manifest,
        target=target,
        drafter=drafter_for(tree),
        tokenizer=tokenizer,
        tree=tree,
        drafter_for=drafter_for,
    )
