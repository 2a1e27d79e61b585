"""Exported ONNX graphs kept and reused: one export of a graph, however many engines are built around it.

``torch.onnx.export`` (dynamo) takes most of an ONNX Runtime build: a minute for the demo zoo's 20-layer target on 2
cores, more for larger ones, and the same target graph is exported again for every draft, tree and weight format
built on it. A graph's key covers everything its export reads: the plan (role, input and output names, dynamic axes,
opset), the example inputs' shapes and dtypes, the module's class, weights, buffers and settings (every submodule's
plain attributes, a Hugging Face config as its dictionary), the kit's own graph code (every source file of its runtime
and export packages) and the exporter's library versions. A hit copies the graph and its weights into the engine; the
build then checks them against PyTorch as it checks a new export (logits, features, greedy identity).

The cache lives in ``$SPECDEC_CACHE/onnx-exports`` (``~/.cache/specdec-kit``), bounded by
``SPECDEC_EXPORT_CACHE_GB`` (default 4, room for SmolLM2-135M's float32 target graph; 0 turns it off): the graphs used
longest ago go first, and a graph larger than a quarter of the bound is never kept (a large target's export is not
copied into a cache it would fill).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from specdec_kit.runtime.models.pretrained import cache_root

BUDGET_ENV = "SPECDEC_EXPORT_CACHE_GB"
DEFAULT_BUDGET_GB = 4.0
OFF_HINT = f"{BUDGET_ENV}=0 exports every graph anew"
LARGEST_SHARE = 4  # a graph larger than budget / LARGEST_SHARE is not kept
STALE_STAGING_S = 3600  # a staging copy this old was left by a build that died
PLAIN = (int, float, bool, str, type(None))


def budget_bytes() -> int:
    """The cache's bound in bytes (0: no cache), from ``SPECDEC_EXPORT_CACHE_GB``."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        gb = float(raw) if raw else DEFAULT_BUDGET_GB
    except ValueError:
        raise ValueError(f"{BUDGET_ENV}={raw!r}: expected a size in GB (0 turns the export cache off)") from None
    if gb < 0:
        raise ValueError(f"{BUDGET_ENV}={raw!r}: expected a size in GB >= 0 (0 turns the export cache off)")
    return int(gb * (1 << 30))


@functools.cache
def code_fingerprint() -> str:
    """A hash of the kit's graph code: every source file of its runtime and export packages (what a plan's module
    and the export itself run)."""
    import onnx
    import onnx_ir
    import onnxscript

    import specdec_kit.export as export_package
    import specdec_kit.runtime as runtime_package

    digest = hashlib.sha256()
    for version in (torch.__version__, onnx.__version__, onnxscript.__version__, onnx_ir.__version__):
        digest.update(version.encode() + b"\0")
    for package in (runtime_package, export_package):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _add_tensor(digest, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach()
    digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}\0".encode())
    digest.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _settings(value) -> object:
    """A submodule attribute as something ``json`` can write: plain values, lists of them, a config's dictionary;
    the type's name for anything else."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_settings(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _settings(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if hasattr(value, "to_dict"):  # a Hugging Face config
        return _settings(value.to_dict())
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    return f"<{type(value).__qualname__}>"


def _add_module(digest, module: torch.nn.Module) -> None:
    digest.update(f"{type(module).__module__}.{type(module).__qualname__}\0".encode())
    for name, tensor in module.state_dict(keep_vars=False).items():
        _add_tensor(digest, name, tensor)
    for prefix, sub in module.named_modules():
        attributes = {}
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or key == "training" or isinstance(value, torch.nn.Module):
                continue  # (the export runs the module in eval mode, whatever its mode now)
            if isinstance(value, torch.Tensor):  # a tensor kept as a plain attribute, not a buffer
                _add_tensor(digest, f"{prefix}.{key}", value)
            else:
                attributes[key] = _settings(value)
        digest.update(f"{prefix}:{type(sub).__qualname__}:{json.dumps(attributes, sort_keys=True)}\0".encode())


def _add_args(digest, args) -> None:
    if isinstance(args, torch.Tensor):
        digest.update(f"T{tuple(args.shape)}:{args.dtype}:{args.device.type}\0".encode())
    elif isinstance(args, (list, tuple)):
        digest.update(f"({len(args)}\0".encode())
        for a in args:
            _add_args(digest, a)
    else:
        digest.update(f"{args!r}\0".encode())


def plan_key(plan) -> str:
    """The key of a ``GraphPlan``'s export (module docstring: what it covers)."""
    digest = hashlib.sha256(code_fingerprint().encode())
    spec = plan.spec
    digest.update(json.dumps([spec.name, list(spec.inputs), list(spec.outputs), plan.opset]).encode())
    digest.update(repr(sorted((str(k), repr(v)) for k, v in plan.dims.items())).encode())
    _add_args(digest, plan.args)
    _add_module(digest, plan.module)
    return digest.hexdigest()[:32]


def _graph_files(graphs: Path, role: str) -> list[Path]:
    return [p for p in (graphs / f"{role}.onnx", graphs / f"{role}.onnx.data") if p.exists()]


def _entry_bytes(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.iterdir() if p.is_file())


def prune(root: Path, budget: int) -> None:
    """Remove the entries used longest ago until the cache holds at most ``budget`` bytes."""
    entries = []
    for entry in root.iterdir() if root.is_dir() else ():
        try:
            if entry.name.startswith(".staging-"):  # a build's copy in progress, or one a killed build left
                if time.time() - entry.stat().st_mtime > STALE_STAGING_S:
                    shutil.rmtree(entry, ignore_errors=True)
            elif entry.is_dir():
                entries.append((entry.stat().st_mtime, _entry_bytes(entry), entry))
        except FileNotFoundError:  # removed by another build meanwhile
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= budget:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= size


def cached_export(plan, graphs: Path, export: Callable[[object, Path], Path]) -> tuple[Path, bool]:
    """``graphs/<role>.onnx`` from the cache, else from ``export(plan, graphs)`` (then kept when it fits) -> (the
    graph's path, whether the cache had it)."""
    budget = budget_bytes()
    weights = sum(t.numel() * t.element_size() for t in plan.module.state_dict().values())
    if budget == 0 or weights > budget // LARGEST_SHARE:  # too large to keep: not even worth hashing
        return export(plan, graphs), False
    root = cache_root() / "onnx-exports"
    entry = root / plan_key(plan)
    role = plan.spec.name
    if entry.is_dir():
        try:
            files = _graph_files(entry, role)
            if entry / f"{role}.onnx" not in files:  # being pruned by another build
                raise FileNotFoundError(entry / f"{role}.onnx")
            for source in files:
                shutil.copyfile(source, graphs / source.name)
            os.utime(entry)  # used now: pruned last
            return graphs / f"{role}.onnx", True
        except FileNotFoundError:  # pruned by another build while copying: export it after all
            for partial in _graph_files(graphs, role):
                partial.unlink()
    path = export(plan, graphs)
    files = _graph_files(graphs, role)
    if sum(p.stat().st_size for p in files) <= budget // LARGEST_SHARE:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
        for source in files:
            shutil.copyfile(source, staging / source.name)
        try:
            staging.rename(entry)  # whole or not at all; another build's copy of the same graph may have won
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
        prune(root, budget)
    return path, False
