"""``manifest.json``: the one contract between building an engine and running it.

The builder (``export/``) writes it last; everything that starts from an engine (runtime, server,
benchmark, chart) reads it through ``read_manifest``, which refuses a directory that is not an
engine, a manifest from a newer schema, missing keys, and any listed file that is missing, has the
wrong size or the wrong SHA-256, naming the file and the problem each time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1
# The ONNX engines' graph I/O: 2 = one key and one value buffer input per layer, read in place; 3 = the target step
# also writes its new keys/values into those buffers (bound as its outputs too) and attends under a slot mask; 4 = the
# draft_tree graph also reads each row's draw noise and inverse temperature (its sampled rows' trees guess the draws);
# 5 = the draft_tree graph also gives each node's path score (a hybrid ranks the head's nodes by them); 6 = the draft
# graphs of a reduced vocabulary over the target's rows also rank each row's joined tokens (``joined_vocab.py``).
ONNX_GRAPH_INTERFACE = 6
ONNX_GRAPH_INTERFACE_NEWEST = "draft graphs that rank each request's own tokens beside a reduced draft vocabulary"
MANIFEST_NAME = "manifest.json"
BACKENDS = ("onnxruntime", "torch", "tensorrt-llm", "sglang", "vllm")
# dtype names the kit accepts, by torch dtype name (``runtime/core/device.py`` maps them to torch dtypes)
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float64": "float64",
}
REQUIRED_KEYS = (
    "schema_version",
    "kit_version",
    "backend",
    "dtype",
    "inputs",
    "target",
    "draft",
    "tree",
    "tokenizer",
    "parallel",
    "artifacts",
    "files",
)


class EngineError(ValueError):
    """An engine directory that cannot be used; the message names the file and the problem."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entries(root: Path, files: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, bytes}} for the artifacts the manifest lists."""
    out = {}
    for file in sorted(files):
        out[file.relative_to(root).as_posix()] = {"sha256": sha256_file(file), "bytes": file.stat().st_size}
    return out


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(
            f"{path}: missing; not an engine directory (build one with python export/build_engine.py)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"{path}: unreadable or not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise EngineError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def verify_files(root: Path, files: dict[str, dict[str, Any]], checksums: bool = True) -> None:
    """Every listed file exists with its recorded size (and SHA-256 unless ``checksums`` is False)."""
    for rel, entry in files.items():
        path = root / rel
        if not path.is_file():
            raise EngineError(f"{path}: listed in {MANIFEST_NAME} but missing; the engine is incomplete (rebuild it)")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise EngineError(
                f"{path}: size {size} bytes, expected {entry.get('bytes')}; the engine is corrupted or incomplete"
            )
        if checksums:
            digest = sha256_file(path)
            if digest != entry.get("sha256"):
                raise EngineError(
                    f"{path}: SHA-256 {digest[:16]}..., expected {str(entry.get('sha256'))[:16]}...; "
                    "the file was modified or corrupted (rebuild the engine)"
                )


def read_manifest(root: str | Path, checksums: bool = True) -> dict[str, Any]:
    """Load and check ``root/manifest.json`` and the files it lists."""
    root = Path(root)
    if not root.is_dir():
        raise EngineError(f"{root}: engine directory does not exist")
    path = root / MANIFEST_NAME
    manifest = _load_json(path)
    version = manifest.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION or version < 1:
        raise EngineError(
            f"{path}: schema_version {version!r} is not supported; expected 1..{SCHEMA_VERSION} "
            "(an engine from a newer kit? rebuild it with this one)"
        )
    for key in REQUIRED_KEYS:
        if key not in manifest:
            raise EngineError(f"{path}: key {key!r} is missing")
    if manifest["backend"] not in BACKENDS:
        raise EngineError(f"{path}: backend {manifest['backend']!r}; expected one of {list(BACKENDS)}")
    verify_files(root, manifest["files"], checksums)
    for role, rel in manifest["artifacts"].items():
        if rel not in manifest["files"] and not (root / rel).is_dir():
            raise EngineError(f"{path}: artifact {role!r} points at {rel!r}, which the engine does not list")
    return manifest


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    path = root / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def draft_label(manifest: dict) -> str:
    """The engine's draft as ``--draft`` names it: its kind, or ``head+lookup`` for a hybrid."""
    draft = manifest["draft"]
    return f"{draft['kind']}+{draft['lookup']['kind']}" if "lookup" in draft else draft["kind"]
