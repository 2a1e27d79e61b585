"""Static checks: ruff's lint and format check over the repository, and basedpyright (basic mode) over the backend
contract and its ONNX Runtime implementation, which must satisfy the contract's protocols."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib
from package_layout import installed_sources

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# the modules the type checker reads (with everything they import); ort/backend.py holds each class to its protocol
TYPED = ("specdec_kit/runtime/core/contract.py", "specdec_kit/runtime/ort/backend.py")


def run(*command: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_lint() -> None:
    proc = run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format() -> None:
    proc = run(str(BIN / "ruff"), "format", "--no-cache", "--check", ".")
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}(run: ruff format .)"


def package_tree(root: Path) -> Path:
    """The package laid out as it installs, as links to the checkout's files."""
    for installed, source in installed_sources().items():
        link = root / installed
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(source)
    return root


def test_types(tmp_path: Path) -> None:
    tree = package_tree(tmp_path / "tree")
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["basedpyright"]
    config = {**settings, "include": list(TYPED)}
    (tree / "pyrightconfig.json").write_text(json.dumps(config))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [str(BIN / "basedpyright"), "--pythonpath", sys.executable, "--project", str(tree)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 errors" in proc.stdout
