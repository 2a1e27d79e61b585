"""The line protocol of the engines' generation workers (``vllm_generate_worker.py``, ``sglang_generate_worker.py``),
which run in the engines' own interpreters without the kit: each imports this file from beside it.

The worker's arguments (``parse``), then one JSON request a line on stdin: ``{"prompts": [[token ids], ...],
"max_tokens": [n, ...], "temperature": 0.0, "top_p": 1.0, "seed": 0}``; after ``READY``, one answer a line on
stdout, after the marker ``ANSWERS``: ``[{"ids": [...], "finish": "stop"|"length"}, ...]`` in the prompts' order.
The engine's own logging goes to stderr. Prompt i samples with seed + i, as the kit's other backends do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable

MARKER = "ANSWERS "


def parse(description: str, dtype: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("model")
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs of this replica")
    p.add_argument("--eos", default="", help="comma-separated end-of-turn token ids")
    p.add_argument("--enforce-eager", action="store_true", help="no compilation or CUDA graphs: starts at once")
    return p.parse_args(argv)


@dataclass
class Request:
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float
    top_p: float
    seeds: list[int | None]  # per prompt
    eos: list[int]


def answers_channel():
    """The stdout the answers go to; everything else written to stdout (the engine's own prints) goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(out, eos: str, answer: Callable[[Request], list[tuple[list[int], bool]]]) -> None:
    """Answer requests from stdin until it ends; ``answer`` gives each prompt's ids and whether it stopped."""
    stop_ids = [int(x) for x in eos.split(",") if x]
    out.write("READY\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        raw = json.loads(line)
        seed = raw.get("seed")
        request = Request(
            raw["prompts"],
            raw["max_tokens"],
            raw.get("temperature", 0.0),
            raw.get("top_p", 1.0),
            [None if seed is None else seed + i for i in range(len(raw["prompts"]))],
            stop_ids,
        )
        answers = [{"ids": ids, "finish": "stop" if stopped else "length"} for ids, stopped in answer(request)]
        out.write(MARKER + json.dumps(answers) + "\n")
        out.flush()
