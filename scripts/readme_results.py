"""README.md's results tables, from the benchmarks' result files (never typed by hand): every head (GRIFFIN, EAGLE-3,
and the parallel drafts P-EAGLE and DFlash) against plain decoding at T=0 with its draft's milliseconds per cycle, on
SmolLM2 (the GRIFFIN head continued over 3.26M answer tokens with the target's MatMuls run by the kit's operator,
its tree chosen among wide, shallow ones too, ``bench/results/smollm2/griffin_wide``; the committed head on an Intel
Xeon with the kit's 8-bit draft operator, alone and merged with suffix trees (``griffin+suffix``),
``bench/results/smollm2/griffin_suffix_intel``; the earlier run with EAGLE-3,
``bench/results/smollm2/heldout_calibration``)
and on the demo zoo (``bench/results/dflash_rows``); model-free drafting and the hybrid by task category on SmolLM2
(``bench/results/lookup/smollm2``); each written between its markers in README.md.

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
LOOKUP_START, LOOKUP_END = "<!-- lookup-table:start -->", "<!-- lookup-table:end -->"
LOOKUP_RESULTS = "bench/results/lookup/smollm2/results.json"
LOOKUP_METHODS = ("ngram", "suffix", "griffin", "griffin+suffix")
# (label, result file, the prompt sets to show, in order)
SOURCES = (
    (
        "SmolLM2, GRIFFIN over 4.8M tokens, tree (7, 2, 4), the kit's MatMul, attention and 8-bit draft products "
        "(AMD EPYC, copy 38 GB/s)",
        "bench/results/smollm2/griffin_suffix_amd/results.json",
        ("chat", "humaneval", "spec_bench"),
    ),
    (
        "SmolLM2, GRIFFIN over 4.8M tokens, tree (7, 2, 4), the kit's MatMul, attention and 8-bit draft products "
        "(Intel Xeon, copy 21 GB/s)",
        "bench/results/smollm2/griffin_suffix_intel/results.json",
        ("chat", "humaneval", "spec_bench"),
    ),
    (
        "SmolLM2, 2026-12-03 (AVX2), GRIFFIN before its 3.26M run",
        "bench/results/smollm2/heldout_calibration/results.json",
        ("chat", "humaneval", "spec_bench"),
    ),
    ("demo zoo (9M)", "bench/results/dflash_rows/results.json", ("heldout", "humaneval", "spec_bench")),
)
METHODS = {
    "griffin": "GRIFFIN",
    "griffin+suffix": "GRIFFIN+suffix",
    "eagle3": "EAGLE-3",
    "peagle": "P-EAGLE",
    "dflash": "DFlash",
}
PROMPT_SETS = {"chat": "MT-Bench (chat)", "humaneval": "HumanEval", "spec_bench": "Spec-Bench", "heldout": "held-out"}


def method_cell(row: dict | None) -> str:
    """tau / draft milliseconds per cycle / speed over plain decoding."""
    if row is None:
        return "-"
    return f"{row['acceptance_length']:.2f} / {row['draft_ms']:.1f} / {row['speedup']:.2f}x"


def table() -> str:
    lines = [
        "| target | prompts | plain tokens/s | "
        + " | ".join(f"{name} tau / draft ms / speed" for name in METHODS.values())
        + " |",
        "|---|---|---:|" + "---:|" * len(METHODS),
    ]
    for label, path, prompt_sets in SOURCES:
        results = json.loads((REPO / path).read_text())
        for prompt_set in prompt_sets:
            rows = {}
            for r in results["rows"]:
                if r["prompt_set"] == prompt_set and r["temperature"] == 0:
                    kind = r["method"].split(" (")[0]  # a side-by-side run names each row's tree
                    if kind in rows:
                        raise SystemExit(f"{path}: more than one {kind!r} row for prompt set {prompt_set!r} at T=0")
                    rows[kind] = r
            if "plain" not in rows:
                raise SystemExit(f"{path}: no plain row for prompt set {prompt_set!r} at T=0")
            cells = [label, PROMPT_SETS[prompt_set], f"{rows['plain']['tokens_per_s']:.1f}"]
            cells += [method_cell(rows.get(method)) for method in METHODS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lookup_table() -> str:
    """Per category: plain decoding's tokens/s, then each method's speedup end to end and its tau (T=0)."""
    results = json.loads((REPO / LOOKUP_RESULTS).read_text())
    rows = [r for r in results["rows"] if r["temperature"] == 0]
    lines = [
        "| category | plain tokens/s | " + " | ".join(f"{m} speed (tau)" for m in LOOKUP_METHODS) + " |",
        "|---|---:|" + "---:|" * len(LOOKUP_METHODS),
    ]
    for category in dict.fromkeys(r["prompt_set"] for r in rows):
        by_method = {r["method"]: r for r in rows if r["prompt_set"] == category}
        cells = [category.replace("_", " "), f"{by_method['plain']['tokens_per_s']:.1f}"]
        for method in LOOKUP_METHODS:
            r = by_method.get(method)
            cells.append("-" if r is None else f"{r['speedup']:.2f}x ({r['acceptance_length']:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def both_tables(text: str) -> str:
    text = generated_table.between_markers(text, START, END, table(), README)
    return generated_table.between_markers(text, LOOKUP_START, LOOKUP_END, lookup_table(), README)


def main(argv: list[str] | None = None) -> int:
    return generated_table.main_with(README, both_tables, "scripts/readme_results.py", argv)


if __name__ == "__main__":
    sys.exit(main())
