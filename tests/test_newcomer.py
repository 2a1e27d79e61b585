"""What a new user meets first: fast ``--help``, code that speaks of the project alone, and a tree that does not
depend on being run from the source checkout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _console_scripts() -> dict[str, str]:
    """Every console script of pyproject.toml, and the README's ``python export/build_engine.py``."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    entries = {name: "from {} import {}".format(*target.split(":")) for name, target in scripts.items()}
    return {"build_engine.py": "from specdec_kit.export.cli import main", **entries}


@pytest.mark.parametrize("name", list(_console_scripts()))
def test_help_answers_without_loading_torch(name):
    """--help parses before anything heavy is imported (torch alone takes seconds to load)."""
    code = (
        f"import sys; sys.argv = [{name!r}, '--help']\n{_console_scripts()[name]}\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\nprint('TORCH LOADED' if 'torch' in sys.modules else 'light')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "usage:" in out.stdout and out.stdout.strip().endswith("light"), out.stdout[-500:] + out.stderr[-500:]


def test_edge_cli_offers_the_protocols_activation_encodings():
    from specdec_kit.edge.cli import ACT_DTYPE_NAMES
    from specdec_kit.edge.protocol import ACT_DTYPES

    assert ACT_DTYPE_NAMES == tuple(ACT_DTYPES)


def _code_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    return [
        REPO / p
        for p in listed
        if p.endswith((".py", ".sh", ".toml", ".tpl", ".yaml", "Dockerfile"))
        and not p.startswith(("tests/golden/", "helm/ci/"))
        and (REPO / p).is_file()
    ]


def test_code_speaks_of_the_project_alone():
    """No pointers to a tracker or to files outside the repository in code or comments."""
    outside = re.compile(r"shared/(docs|seeds|data)|reference/\w+\.md|issue tracker|\bissue \d+|\.\./shared")
    hits = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in _code_files()
        if p.name != "test_newcomer.py"
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_nothing_finds_the_zoo_or_writes_results_relative_to_the_package():
    """The zoo and output locations are settings (specdec_kit/paths.py), not paths inside the source tree."""
    tied = re.compile(r"parents\[\d\]\s*/\s*\"(zoo|results)\"|parent\s*/\s*\"results\"")
    owner = REPO / "specdec_kit" / "paths.py"  # the one module that owns locations (its editable-install fallback)
    hits = [
        f"{p.relative_to(REPO)}:{n}"
        for p in _code_files()
        if p.parts[-2] != "tests" and p != owner
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if tied.search(line)
    ]
    assert not hits, hits
    for built in ("build/lib/x.py", "dist/x.whl"):  # setuptools' build output never shows up as untracked files
        assert subprocess.run(["git", "check-ignore", "-q", built], cwd=REPO).returncode == 0, built


def test_plots_keep_legends_off_the_data_and_concurrency_ticks_plain():
    from specdec_kit.plots import concurrency_axis, legend_below, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax in axes:
        ax.bar([1, 4, 16], [3, 2, 1], label="bars")
        ax.plot([1, 4, 16], [1, 2, 3], label="line")
        concurrency_axis(ax, [1, 4, 16])
    legend_below(fig, axes[0])
    fig.canvas.draw()
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["1", "4", "16"]
    legend_box = fig.legends[0].get_window_extent()
    assert all(legend_box.y1 <= ax.get_window_extent().y0 for ax in axes)  # wholly below every panel
    plt.close(fig)
