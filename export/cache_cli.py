"""``specdec-engine-cache``: what an engine cache holds, and pruning it after a build (the chart's build Job runs
``prune`` once its engine is in place)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec_kit.export.cli import human
from specdec_kit.export.engine_cache import EngineCache, disk_bytes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specdec-engine-cache",
        description="The engines in an engine cache (each a directory with a manifest), the shared targets they link "
        "to (built with --target-store CACHE/targets) and the releases that deployed them; prune removes a "
        "release's older engines and the targets no engine links to.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="engines, their own size on disk, their shared target, who deployed them")
    listing.add_argument("cache", type=Path, help="the engine cache directory (the chart mounts it at /engine-cache)")
    prune = sub.add_parser("prune", help="record that a release serves an engine, then remove its older engines")
    prune.add_argument("cache", type=Path, help="the engine cache directory")
    prune.add_argument("--release", required=True, help="the release (Helm release name) that now serves --engine")
    prune.add_argument("--engine", type=Path, required=True, help="the engine it serves, directly under the cache")
    prune.add_argument(
        "--keep",
        type=int,
        default=2,
        help="engines of this release kept, newest first (default 2: the one now served and the one a rolling "
        "update is replacing)",
    )
    return p.parse_args(argv)


def list_cache(cache: EngineCache) -> str:
    releases = {}
    for record in sorted((cache.root / ".releases").glob("*.json")):
        for name in cache.deployed(record.stem):
            releases.setdefault(name, []).append(record.stem)
    lines = []
    for engine in cache.engines():
        target = f"shared target {engine.target.name}" if engine.target else "own target"
        who = ", ".join(releases.get(engine.path.name, [])) or "no release"
        lines.append(
            f"{engine.path.name}  {engine.backend} {engine.draft}  {human(engine.own_bytes)}  {target}  ({who})"
        )
    if cache.store.is_dir():
        unused = {p.name for p in cache.unused_targets()}
        for target in sorted(p for p in cache.store.iterdir() if p.is_dir() and not p.name.startswith(".")):
            state = "unused" if target.name in unused else "linked"
            lines.append(f"{cache.store.name}/{target.name}  {human(disk_bytes(target))}  {state}")
    return "\n".join(lines) or f"{cache.root}: no engines"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cache.is_dir():
        print(f"error: {args.cache}: not a directory (the engine cache)", file=sys.stderr)
        return 2
    cache = EngineCache(args.cache)
    try:
        if args.command == "list":
            print(list_cache(cache))
            return 0
        cache.record(args.release, args.engine)
        removed = cache.prune(args.release, args.keep, step=lambda msg: print(f"engine cache: {msg}", flush=True))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"engine cache: {len(removed)} removed; {args.release} keeps {cache.deployed(args.release)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
