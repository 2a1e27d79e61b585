"""What an engine is built from: the target, the draft, the tokenizer and the options, with one hash.

Without ``--target``/``--draft-path`` the demo zoo (``zoo/``) provides them. The inputs hash covers
every file's content and every option that changes the artifacts, so an identical rebuild is a
reuse and anything else is a new engine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec_kit import __version__
from specdec_kit.runtime.core.manifest import ONNX_GRAPH_INTERFACE, sha256_file
from specdec_kit.runtime.registry import zoo_heads


class BuildError(ValueError):
    """Bad input to the builder; the message names the option or file, what was expected and found."""


@dataclass
class BuildInputs:
    draft: str  # the draft kind (a hybrid's head kind)
    target: Path
    draft_path: Path | None  # None: a model-free kind (its settings come from ``lookup_path``)
    tokenizer: Path
    backend: str
    dtype: str
    tree: dict[str, Any]
    tp: int = 1
    pp: int = 1
    demo: bool = False
    trtllm_legacy_engine: str | None = None  # a TensorRT-LLM release <= 1.2: the legacy trtllm-build route
    draft_tree: bool = True  # onnxruntime: the draft's whole cycle as one graph, where the kind and tree allow it
    extra_trees: tuple[dict[str, Any], ...] = ()  # onnxruntime: more dynamic trees with a one-call graph each
    lookup: str | None = None  # a hybrid's model-free kind (``--draft griffin+suffix``)
    lookup_path: Path | None = None  # a model-free kind's settings file (alone or in a hybrid); None: its defaults
    target_store: Path | None = None  # server backends: the target written once there, the engine links to it
    weights: str = "float"  # onnxruntime: the target's weights, float (the dtype's) or int4
    draft_weights: str = "float"  # onnxruntime: the draft's weights, float or int8
    draft_format: str = "official"  # vllm: the draft's layout, official or speculators (vLLM reads both)
    file_hashes: dict[str, dict[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Extra trees as a set beside the engine's own: the engine's tree and repeats dropped, so that naming them
        changes neither the graphs nor the digest."""
        extra: list[dict[str, Any]] = []
        for tree in self.extra_trees:
            if tree != self.tree and tree not in extra:
                extra.append(tree)
        self.extra_trees = tuple(extra)

    @property
    def draft_spec(self) -> str:
        """What ``--draft`` said: the kind, or ``head+lookup``."""
        return f"{self.draft}+{self.lookup}" if self.lookup else self.draft

    def hash_files(self) -> None:
        """Every input file's content hash (the target, the draft, the tokenizer, the model-free settings)."""
        self.file_hashes = {"target": hash_tree(self.target, "target")}
        if self.draft_path is not None:
            self.file_hashes["draft"] = hash_tree(self.draft_path, "draft")
        if self.tokenizer != self.target:
            self.file_hashes["tokenizer"] = hash_tree(self.tokenizer, "tokenizer")
        if self.lookup_path is not None:
            self.file_hashes["lookup"] = {self.lookup_path.name: sha256_file(self.lookup_path)}

    def options(self) -> dict[str, Any]:
        return {
            "draft": self.draft,
            **({"lookup": self.lookup} if self.lookup else {}),
            "backend": self.backend,
            "dtype": self.dtype,
            "tree": self.tree,
            "tp": self.tp,
            "pp": self.pp,
            "kit_version": __version__,
            **({"trtllm_legacy_engine": self.trtllm_legacy_engine} if self.trtllm_legacy_engine else {}),
            **({"weights": self.weights} if self.weights != "float" else {}),  # float engines keep their old digests
            **({"draft_weights": self.draft_weights} if self.draft_weights != "float" else {}),
            **({"draft_format": self.draft_format} if self.draft_format != "official" else {}),
            **({"extra_trees": list(self.extra_trees)} if self.extra_trees else {}),
            **(
                {"graph_interface": ONNX_GRAPH_INTERFACE, "draft_tree": self.draft_tree}
                if self.backend == "onnxruntime"
                else {}
            ),
        }

    def digest(self) -> str:
        """SHA-256 over the options and every input file's content hash."""
        payload = json.dumps({"options": self.options(), "files": self.file_hashes}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


def resolve_paths(
    draft: str, target: Path | None, draft_path: Path | None, tokenizer: Path | None
) -> tuple[Path, Path | None, Path, bool]:
    """The user's paths, or the demo zoo's target and the head of this method when none are given; a named target
    (``--target smollm2``) is obtained and converted on first use, its head the kit's own unless one is given. A
    model-free kind has no head: its draft path is None."""
    from specdec_kit.runtime.models.pretrained import is_named, named_head, resolve_target
    from specdec_kit.runtime.registry import draft_kind

    if draft_kind(draft).model_free:
        if draft_path is not None:
            raise BuildError(f"--draft-path: a {draft} draft has no checkpoint (its settings: --lookup-settings FILE)")
        return _target_alone(target, tokenizer)
    if target is not None and is_named(target):
        try:
            draft_path = draft_path or named_head(str(target), draft)
            target = resolve_target(target)
        except (ValueError, RuntimeError) as exc:
            raise BuildError(str(exc)) from None
    demo = target is None and draft_path is None
    if demo:
        from specdec_kit.paths import default_zoo

        try:
            zoo = default_zoo()
        except ValueError as exc:
            raise BuildError(f"{exc}; or pass --target DIR --draft-path DIR") from None
        if not (zoo / "target" / "config.json").is_file():
            raise BuildError(
                f"{zoo}: no demo zoo; pass --target DIR --draft-path DIR "
                "(or build the zoo: python -m specdec_kit.train.zoo --out zoo)"
            )
        target, draft_path = zoo / "target", zoo / zoo_heads()[draft][1]
    elif target is None or draft_path is None:
        raise BuildError("--target and --draft-path go together (give both, or neither for the demo zoo)")
    for name, path in (("--target", target), ("--draft-path", draft_path)):
        check_checkpoint(name, path)
    return target, draft_path, checked_tokenizer(tokenizer or target), demo


def _target_alone(target: Path | None, tokenizer: Path | None) -> tuple[Path, None, Path, bool]:
    """A model-free draft's inputs: the given target (a named one obtained on first use), or the demo zoo's."""
    from specdec_kit.runtime.models.pretrained import is_named, resolve_target

    demo = target is None
    if demo:
        from specdec_kit.paths import default_zoo

        try:
            target = default_zoo() / "target"
        except ValueError as exc:
            raise BuildError(f"{exc}; or pass --target DIR") from None
    elif is_named(target):
        try:
            target = resolve_target(target)
        except (ValueError, RuntimeError) as exc:
            raise BuildError(str(exc)) from None
    check_checkpoint("--target", target)
    return target, None, checked_tokenizer(tokenizer or target), demo


def check_checkpoint(name: str, path: Path) -> None:
    if not path.is_dir():
        raise BuildError(f"{name} {path}: not a directory")
    if not (path / "config.json").is_file():
        raise BuildError(f"{path / 'config.json'}: missing; {name} must be a checkpoint directory")


def checked_tokenizer(tokenizer: Path) -> Path:
    if not ((tokenizer / "tokenizer.json").is_file() or (tokenizer / "tokenizer.model").is_file()):
        raise BuildError(f"{tokenizer}: no tokenizer.json or tokenizer.model; pass --tokenizer DIR")
    return tokenizer


def hash_tree(root: Path, label: str) -> dict[str, str]:
    """{relative path: sha256} for every file under ``root`` (unreadable files are named, not skipped)."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and "training_state" not in p.name)
    out = {}
    for file in tqdm(files, desc=f"hashing {label}", unit="file", leave=False, disable=len(files) < 8):
        try:
            out[file.relative_to(root).as_posix()] = sha256_file(file)
        except OSError as exc:
            raise BuildError(f"{file}: unreadable ({exc.strerror or exc})") from exc
    return out
