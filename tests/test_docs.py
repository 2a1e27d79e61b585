"""The documentation: the site builds with warnings as errors, the README stays short and its results table current,
and every results table the pages show is included from the file its benchmark wrote, none copied by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = REPO / "bench" / "results"
SNIPPET = re.compile(r'--8<-- "([^":]+)(?::[0-9:]*)?"')


def table_rows(text: str) -> set[str]:
    """The body rows of the Markdown tables in ``text`` (header separators left out), whitespace-normalised."""
    rows = set()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|") and not re.fullmatch(r"[|:\- ]+", line):
            rows.add(re.sub(r"\s+", " ", line))
    return rows


def nav_pages(nav: list) -> set[str]:
    pages: set[str] = set()
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages |= nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert benchmarks.count("<table>") >= 8, "the benchmark tables were not included"
    assert "--8&lt;--" not in benchmarks, "a snippet marker reached the page unexpanded"
    assert (tmp_path / "site" / "zoo" / "smollm2" / "learning_curve.png").is_file(), "the plots are not published"


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages == nav_pages(config["nav"]), "pages and mkdocs.yml's nav differ"


def test_the_readme_is_short_and_its_results_table_current() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "readme_results.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_result_table_is_included_not_copied() -> None:
    pages = {p: p.read_text() for p in [*DOCS.rglob("*.md"), REPO / "README.md"]}
    included = {m for text in pages.values() for m in SNIPPET.findall(text)}
    page_rows = {page.relative_to(REPO).as_posix(): table_rows(text) for page, text in pages.items()}
    for path in sorted(RESULTS.rglob("*.md")):
        name = path.relative_to(REPO).as_posix()
        assert name in included, f'{name} is shown on no documentation page (include it with --8<-- "{name}")'
        result_rows = table_rows(path.read_text())
        copied = {page: rows & result_rows for page, rows in page_rows.items()}
        copied = {page: rows for page, rows in copied.items() if rows}
        assert not copied, f"rows of {name} copied by hand into {sorted(copied)}: include the file instead"
