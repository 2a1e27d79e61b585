"""Recording of the draft's logits inside vLLM, for checking them against the kit's own draft.

With ``SPECDEC_VLLM_DRAFT_TRACE=DIR`` set, every ``compute_logits`` call of a kit draft writes one file to DIR
holding, for each row it scored, the draft input's position and token id and the logits. The proposer only
hands ``compute_logits`` the rows it samples from, so the rows are matched back to the forward's inputs by
their hidden state (exact equality: they are slices of the same tensor). Dummy runs (all positions 0) are
not recorded.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch


class DraftTrace:
    ENV = "SPECDEC_VLLM_DRAFT_TRACE"

    def __init__(self, directory: Path):
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.counter = itertools.count()
        self.last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_env(cls) -> "DraftTrace | None":
        directory = os.environ.get(cls.ENV)
        return cls(Path(directory)) if directory else None

    def remember(self, input_ids: torch.Tensor, positions: torch.Tensor, for_logits: torch.Tensor) -> None:
        self.last = (input_ids.detach().clone(), positions.detach().clone(), for_logits.detach().clone())

    def record(self, hidden_states: torch.Tensor, logits: torch.Tensor) -> None:
        if self.last is None:
            return
        input_ids, positions, rows = self.last
        rows = rows.reshape(-1, rows.shape[-1])
        picked = []
        for h in hidden_states.reshape(-1, hidden_states.shape[-1]):
            match = (rows == h).all(dim=-1).nonzero()
            picked.append(int(match[0]) if len(match) else -1)
        index = torch.tensor(picked)
        known = index >= 0
        if not known.any() or bool((positions.reshape(-1)[index[known]] == 0).all()):
            return
        step = next(self.counter)
        torch.save(
            {
                "positions": positions.reshape(-1)[index[known]].cpu(),
                "tokens": input_ids.reshape(-1)[index[known]].cpu(),
                "logits": logits[known].float().cpu(),
            },
            self.directory / f"{os.getpid()}-{step:07d}.pt",
        )


def instrument(cls: type) -> None:
    """Record a vLLM draft class's logits the way the kit's own classes do, its computation unchanged (vLLM's own
    ``Eagle3LlamaForCausalLM`` runs EAGLE-3 heads and ``DFlashQwen3ForCausalLM`` DFlash heads; this lets the tier
    compare their draft logits with the kit's). An EAGLE class's forward takes the hidden states and returns a
    pair; DFlash's takes the block's ids alone (its context is in its cache) and returns the hidden states."""
    trace = DraftTrace.from_env()
    if trace is None or getattr(cls, "_specdec_traced", False):
        return
    forward, compute_logits = cls.forward, cls.compute_logits
    block = "DFlash" in cls.__name__

    def traced_forward(self, input_ids, positions, *args, **kwargs):
        out = forward(self, input_ids, positions, *args, **kwargs)
        trace.remember(input_ids, positions, out if block else out[0])
        return out

    def traced_compute_logits(self, hidden_states):
        logits = compute_logits(self, hidden_states)
        if logits is not None:
            trace.record(hidden_states, logits)
        return logits

    cls.forward, cls.compute_logits, cls._specdec_traced = traced_forward, traced_compute_logits, True
