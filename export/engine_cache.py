"""The engine cache a cluster's build Jobs share: one copy of each target, and old engines removed.

A server engine (vLLM, SGLang, TensorRT-LLM) carries its target as a Hugging Face checkpoint: 140 GB for a 70B
target, in every engine built from it (each tree, each kit version, each upgrade). Built with ``--target-store DIR``,
an engine's ``target`` is a relative link into ``DIR/<key>``, one copy per target checkpoint, tokenizer and precision,
written once under a lock; the engine's manifest still lists (and its readers still check) every file through the
link. ``EngineCache.prune`` removes a release's engines beyond its newest few (never one another release still
counts among its own, never one being built) and then the targets no engine links to.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from specdec_kit.runtime.core.manifest import MANIFEST_NAME

TARGETS = "targets"  # the store's usual place inside the cache (the chart's --target-store)
RECORDS = ".releases"


def target_key(file_hashes: dict[str, dict[str, str]], dtype: str) -> str:
    """What identifies a written target: the content of its checkpoint and tokenizer files, and the precision."""
    payload = {"target": file_hashes["target"], "tokenizer": file_hashes.get("tokenizer"), "dtype": dtype}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def build_lock(output: Path) -> Path:
    """The lock file a build of the engine at ``output`` holds (the builder's, which pruning respects)."""
    return output.parent / f".{output.name}.lock"


@contextlib.contextmanager
def locked(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock on ``path`` (created); yields False at once where ``wait`` is off and another holds it."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


def link_shared_target(
    staging: Path, store: Path, key: str, write: Callable[[Path], None], step: Callable[[str], None]
) -> None:
    """Make ``staging/target`` a relative link to ``store/key``, writing the target there (``write(directory)``)
    unless an earlier build did. The link comes first, so a prune running meanwhile sees the target in use."""
    store.mkdir(parents=True, exist_ok=True)
    shared = store / key
    (staging / "target").symlink_to(os.path.relpath(shared, staging))
    with locked(store / f".{key}.lock"):
        if shared.is_dir():
            step(f"target: the shared copy {shared}")
            return
        step(f"target: writing the shared copy {shared}")
        scratch = Path(tempfile.mkdtemp(prefix=f".{key}.writing-", dir=store))
        try:
            write(scratch)
            scratch.chmod(0o755)
            scratch.rename(shared)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise


def engine_files(root: Path) -> list[Path]:
    """Every file of an engine, those behind its shared target's link included."""
    return sorted(Path(folder) / name for folder, _, names in os.walk(root, followlinks=True) for name in names)


def disk_bytes(root: Path) -> int:
    """What a directory itself holds on disk (links not followed: a shared target is counted once, in the store)."""
    return sum((Path(folder) / name).lstat().st_size for folder, _, names in os.walk(root) for name in names)


@dataclass(frozen=True)
class CachedEngine:
    path: Path
    backend: str
    draft: str
    created: str
    own_bytes: int
    target: Path | None  # the shared target it links to, resolved


class EngineCache:
    """The engines directly under ``root`` (each a directory with a manifest), the shared targets under
    ``root/targets`` and, per release, the engines it deployed, newest first (``root/.releases/<release>.json``)."""

    def __init__(self, root: Path, store: Path | None = None):
        self.root = Path(root).absolute()
        self.store = Path(store).absolute() if store else self.root / TARGETS

    def engines(self) -> list[CachedEngine]:
        found = []
        for path in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            manifest = path / MANIFEST_NAME
            if path == self.store or not manifest.is_file():
                continue
            try:
                data = json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            link = path / "target"
            draft = data.get("draft", {})
            found.append(
                CachedEngine(
                    path=path,
                    backend=str(data.get("backend", "?")),
                    draft=f"{draft.get('kind', '?')}" + (f"+{draft['lookup']['kind']}" if "lookup" in draft else ""),
                    created=str(data.get("created", "")),
                    own_bytes=disk_bytes(path),
                    target=link.resolve() if link.is_symlink() else None,
                )
            )
        return found

    def _record_path(self, release: str) -> Path:
        if not release or "/" in release or release.startswith("."):
            raise ValueError(f"release {release!r}: expected a release name (no '/', not starting with '.')")
        return self.root / RECORDS / f"{release}.json"

    def _entries(self, release: str) -> list[dict[str, str]]:
        path = self._record_path(release)
        return json.loads(path.read_text())["engines"] if path.is_file() else []

    def _write(self, release: str, entries: list[dict[str, str]]) -> None:
        path = self._record_path(release)
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps({"release": release, "engines": entries}, indent=2) + "\n")
        scratch.rename(path)

    def deployed(self, release: str) -> list[str]:
        """The engine names ``release`` deployed, newest first."""
        return [e["engine"] for e in self._entries(release)]

    def record(self, release: str, engine: Path) -> None:
        """``release`` now serves ``engine`` (a directory directly under the cache)."""
        engine = Path(engine).absolute()
        if engine.parent.resolve() != self.root.resolve():
            raise ValueError(f"engine {engine}: not directly under the engine cache {self.root}")
        now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        rest = [e for e in self._entries(release) if e["engine"] != engine.name]
        self._write(release, [{"engine": engine.name, "recorded": now}, *rest])

    def prune(self, release: str, keep: int, step: Callable[[str], None] = print) -> list[Path]:
        """Remove ``release``'s engines beyond its newest ``keep`` (the one serving and, during a rolling update, the
        one before it, with ``keep`` 2), unless another release keeps one among its own newest ``keep`` or a build of
        it is under way; then the shared targets no engine links to. Returns what was removed."""
        if keep < 1:
            raise ValueError(f"keep {keep}: at least 1 (the engine being served)")
        names = self.deployed(release)
        others = {
            name
            for record in (self.root / RECORDS).glob("*.json")
            if record.stem != release
            for name in self.deployed(record.stem)[:keep]
        }
        removed = []
        for name in names[keep:]:
            engine = self.root / name
            if name in others:
                step(f"keeping {name}: another release serves it")
                continue
            if engine.is_dir() and self._remove_engine(engine):
                step(f"removed engine {name}")
                removed.append(engine)
            if not engine.exists():
                names.remove(name)
        self._write(release, [e for e in self._entries(release) if e["engine"] in names])
        for target in self.unused_targets():
            if self._remove(
                target, self.store / f".{target.name}.lock", unless=lambda t: t.name in self._linked_names()
            ):
                step(f"removed shared target {target.name} (no engine links to it)")
                removed.append(target)
        return removed

    def _remove_engine(self, engine: Path) -> bool:
        """Remove an engine unless a build of it holds its lock."""
        return self._remove(engine, build_lock(engine))

    @staticmethod
    def _remove(path: Path, lock: Path, unless: Callable[[Path], bool] = lambda p: False) -> bool:
        """Remove ``path`` unless its lock is held (a build) or ``unless`` says otherwise once the lock is taken; it is
        renamed away first, so a half-deleted engine or target is never found in its place."""
        with locked(lock, wait=False) as free:
            if not free or unless(path):
                return False
            doomed = path.with_name(f".{path.name}.removing-{os.getpid()}")
            path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def _linked_names(self) -> set[str]:
        """The store entries some directory of the cache links to (engines, and builds still in their staging)."""
        names = set()
        for path in self.root.iterdir():
            link = path / "target"
            if path.is_dir() and link.is_symlink():
                resolved = Path(os.path.normpath(path / os.readlink(link)))
                if resolved.parent == self.store:
                    names.add(resolved.name)
        return names

    def unused_targets(self) -> list[Path]:
        if not self.store.is_dir():
            return []
        linked = self._linked_names()
        return [
            p
            for p in sorted(self.store.iterdir())
            if p.is_dir() and not p.name.startswith(".") and p.name not in linked
        ]
