"""The package as it installs: pyproject.toml's package-dir maps the top-level folders into ``specdec_kit``, a layout
static tools cannot see in the checkout; the layer test and the type checker read it from here."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def installed_sources() -> dict[Path, Path]:
    """Every Python file of the package: its path inside the installed package tree -> its file in the checkout."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found: dict[Path, Path] = {}
    for package, folder in config["package-dir"].items():
        for source in (REPO / folder).rglob("*.py"):
            found.setdefault(Path(*package.split("."), source.relative_to(REPO / folder)), source)
    return found
