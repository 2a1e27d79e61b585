"""Prompts for the load test: the first turn of each question of a Spec-Bench / MT-Bench jsonl."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

PROMPTS_ENV = "SPECDEC_PROMPTS"


def default_prompt_file() -> Path:
    """``$SPECDEC_PROMPTS`` when set, else the Spec-Bench questions the kit ships."""
    from specdec_kit.data.prompts import DEFAULT_SPEC_BENCH

    return Path(os.environ[PROMPTS_ENV]) if os.environ.get(PROMPTS_ENV) else DEFAULT_SPEC_BENCH


@lru_cache(maxsize=8)
def load_prompts(path: Path, max_chars: int = 0) -> list[str]:
    """Every question's first turn (no longer than ``max_chars`` when it is set); a clear error for a
    missing file, a malformed line, or a filter that leaves nothing."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: prompt file not found (give --prompts PATH to a Spec-Bench/MT-Bench jsonl)")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
            prompts.append(turns[0] if isinstance(turns[0], str) else str(turns[0]))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'turns' list ({exc})") from None
    if max_chars:
        prompts = [p for p in prompts if len(p) <= max_chars]
    if not prompts:
        raise ValueError(f"{path}: no prompts" + (f" of at most {max_chars} characters" if max_chars else ""))
    return prompts
