"""The optimisation schedule every trainer shares (steps, batch shape, learning rate, warm-up, seed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class Schedule:
    steps: int = 500
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 30
    seed: int = 0
