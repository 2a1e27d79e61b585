"""A table generated from data and kept between two markers in a Markdown file: written, or checked for staleness
(the tests run the check), by ``helm_values_table.py`` and ``readme_results.py``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def between_markers(text: str, start: str, end: str, table: str, path: Path) -> str:
    """``text`` with what lies between ``start`` and ``end`` replaced by ``table``."""
    if start not in text or end not in text:
        raise SystemExit(f"{path}: the markers {start} and {end} are missing")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}\n{end}{tail}"


def main(path: Path, start: str, end: str, table: Callable[[], str], script: str, argv: list[str] | None) -> int:
    """Write the table into ``path``, or with ``--check`` exit 1 when the one there is stale."""
    return main_with(path, lambda text: between_markers(text, start, end, table(), path), script, argv)


def main_with(path: Path, refresh: Callable[[str], str], script: str, argv: list[str] | None) -> int:
    """``refresh`` the text of ``path`` (its generated tables) and write it, or with ``--check`` exit 1 when that
    changes anything."""
    parser = argparse.ArgumentParser(description=f"the generated tables in {path.name}")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when a table in {path.name} is stale")
    args = parser.parse_args(argv)
    current = path.read_text()
    fresh = refresh(current)
    if args.check:
        if fresh != current:
            print(f"{path}: the generated table is stale; run python {script}", file=sys.stderr)
            return 1
        return 0
    path.write_text(fresh)
    return 0
