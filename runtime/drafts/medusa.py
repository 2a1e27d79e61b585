"""Medusa heads (reference ``medusa/model/medusa_model.py``).

Head i predicts the token i + 2 positions after the feature's position (the target's own head gives
i + 1). Each head is ``medusa_num_layers`` residual blocks x + SiLU(Wx + b) then Linear(d, V, no bias);
keys ``medusa_head.{i}.{j}.linear.{weight,bias}`` and ``medusa_head.{i}.{layers}.weight``. (The
reference repeats one ResBlock object per head, so its per-layer weights are tied; loading them into
separate blocks computes the same function.)
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.medusa_head = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden_size) for _ in range(num_layers)], nn.Linear(hidden_size, vocab_size, bias=False)
            )
            for _ in range(num_heads)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., d] -> logits [..., heads, V]."""
        return torch.stack([head(features) for head in self.medusa_head], dim=-2)
