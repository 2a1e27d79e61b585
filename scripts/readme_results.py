"""README.md's results table, from the benchmarks' result files (never typed by hand): GRIFFIN and EAGLE-3 against
plain decoding at T=0, on SmolLM2 (``bench/results/smollm2``) and on the demo zoo (``bench/results/eagle3_rows``),
written between the markers in README.md.

    python scripts/readme_results.py            # rewrite the table in README.md
    python scripts/readme_results.py --check    # exit 1 when the table is stale (the tests run this)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import generated_table

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
# (label, result file, the prompt sets to show, in order)
SOURCES = (
    ("SmolLM2-135M-Instruct", "bench/results/smollm2/results.json", ("chat", "humaneval", "spec_bench")),
    ("demo zoo (9M)", "bench/results/eagle3_rows/results.json", ("heldout", "humaneval", "spec_bench")),
)
METHODS = ("griffin", "eagle3")
PROMPT_SETS = {"chat": "MT-Bench (chat)", "humaneval": "HumanEval", "spec_bench": "Spec-Bench", "heldout": "held-out"}


def method_cells(rows: dict[str, dict], method: str) -> list[str]:
    row = rows.get(method)
    if row is None:
        return ["-", "-"]
    return [f"{row['acceptance_length']:.2f}", f"{row['speedup']:.2f}x"]


def table() -> str:
    lines = [
        "| target | prompts | plain tokens/s | GRIFFIN tau | GRIFFIN speed | EAGLE-3 tau | EAGLE-3 speed |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, path, prompt_sets in SOURCES:
        results = json.loads((REPO / path).read_text())
        for prompt_set in prompt_sets:
            rows = {r["method"]: r for r in results["rows"] if r["prompt_set"] == prompt_set and r["temperature"] == 0}
            if "plain" not in rows:
                raise SystemExit(f"{path}: no plain row for prompt set {prompt_set!r} at T=0")
            cells = [label, PROMPT_SETS[prompt_set], f"{rows['plain']['tokens_per_s']:.1f}"]
            for method in METHODS:
                cells += method_cells(rows, method)
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return generated_table.main(README, START, END, table, "scripts/readme_results.py", argv)


if __name__ == "__main__":
    sys.exit(main())
