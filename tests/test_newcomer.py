"""What a new user meets first: fast ``--help``, code that speaks of the project alone, and a tree that does not
depend on being run from the source checkout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

HELP_ENTRIES = {  # the user's literal commands and the console scripts behind them
    "build_engine.py": "from specdec_kit.export.cli import main",
    "specdec-generate": "from specdec_kit.runtime.cli import main",
    "specdec-serve": "from specdec_kit.serving.cli import main",
    "specdec-loadtest-sweep": "from specdec_kit.loadtest.sweep import main",
}


@pytest.mark.parametrize("name", list(HELP_ENTRIES))
def test_help_answers_without_loading_torch(name):
    """--help parses before anything heavy is imported (torch alone takes seconds to load)."""
    code = (f"import sys; sys.argv = [{name!r}, '--help']\n{HELP_ENTRIES[name]}\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nprint('TORCH LOADED' if 'torch' in sys.modules else 'light')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "usage:" in out.stdout and out.stdout.strip().endswith("light"), out.stdout[-500:] + out.stderr[-500:]


def _code_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    return [REPO / p for p in listed if p.endswith((".py", ".sh", ".toml", ".tpl", ".yaml", "Dockerfile"))
            and not p.startswith(("tests/golden/", "helm/ci/")) and (REPO / p).is_file()]


def test_code_speaks_of_the_project_alone():
    """No pointers to a tracker or to files outside the repository in code or comments."""
    outside = re.compile(r"shared/(docs|seeds|data)|reference/\w+\.md|issue tracker|\bissue \d+|\.\./shared")
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in _code_files() if p.name != "test_newcomer.py"
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not hits, "\n".join(hits)


def test_nothing_finds_the_zoo_or_writes_results_relative_to_the_package():
    """The zoo and output locations are settings (specdec_kit/paths.py), not paths inside the source tree."""
    tied = re.compile(r"parents\[\d\]\s*/\s*\"(zoo|results)\"|parent\s*/\s*\"results\"")
    owner = REPO / "specdec_kit" / "paths.py"  # the one module that owns locations (its editable-install fallback)
    hits = [f"{p.relative_to(REPO)}:{n}" for p in _code_files() if p.parts[-2] != "tests" and p != owner
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if tied.search(line)]
    assert not hits, hits
    for built in ("build/lib/x.py", "dist/x.whl"):  # setuptools' build output never shows up as untracked files
        assert subprocess.run(["git", "check-ignore", "-q", built], cwd=REPO).returncode == 0, built
