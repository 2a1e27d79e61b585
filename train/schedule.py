"""The optimisation schedule every trainer shares (steps, batch shape, learning rate, warm-up, seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class Schedule:
    steps: int = 500
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 30
    seed: int = 0

    def batch_rows(self, step: int, num_blocks: int) -> torch.Tensor:
        """The blocks of ``step``: consecutive, wrapping around (so a resumed run sees the same data)."""
        return torch.arange(step * self.batch, (step + 1) * self.batch) % num_blocks

    def check_finite(self, loss: torch.Tensor, what: str, step: int) -> None:
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{what}: loss is {float(loss)} at step {step}; lower the learning rate ({self.lr})")
