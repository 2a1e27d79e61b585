"""Held-out acceptance while a head trains: how far a chain of the head's greedy drafts would be accepted on samples
it never trains on, counted as the benchmark counts acceptance (the share of drafting cycles whose first d drafts are
all the target's greedy tokens: ``acceptance[d-1]``; tau = 1 + their sum for a chain).

Every position of a held-out answer starts a chain. Depth 1 is the draft's first step from the target's features;
depth d > 1 feeds the draft its own earlier steps, as decoding does (the multi-pass forward of EAGLE/HASS/GRIFFIN,
EAGLE-3's training-time test); a chain ends at its first miss. The held-out samples are a fixed hash bucket of the
data's prompt ids, so the split is the same on every run and every data size.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec_kit.train.distilled import DistilledData
from specdec_kit.train.draft_forward import PassRunner, next_pass_features
from specdec_kit.train.losses import shift_right

HELD_OUT_PERCENT = 2  # of the prompt ids


def is_held_out(prompt_id: str, percent: int = HELD_OUT_PERCENT) -> bool:
    return int(hashlib.sha256(prompt_id.encode()).hexdigest(), 16) % 100 < percent


def split(percent: int = HELD_OUT_PERCENT) -> tuple[Callable[[dict], bool], Callable[[dict], bool]]:
    """Selectors of a data set's samples (``DistilledData(select=...)``) by prompt id: (for training, held out)."""
    return (
        lambda meta: not is_held_out(meta["prompt_id"], percent),
        lambda meta: is_held_out(meta["prompt_id"], percent),
    )


def wanted_ids(top: torch.Tensor, to_head: torch.Tensor | None) -> torch.Tensor:
    """The target's greedy next tokens in the head's vocabulary (-1 where unknown or outside it: never hit)."""
    known = top.clamp(min=0)
    ids = known if to_head is None else to_head[known]
    return torch.where(top >= 0, ids, torch.full_like(ids, -1))


@torch.no_grad()
def feature_draft_acceptance(
    draft, method: str, lm_head, to_head: torch.Tensor | None, data: DistilledData, depth: int = 3
) -> list[float]:
    """Chain acceptance per depth of an EAGLE/HASS/GRIFFIN head over every batch of ``data``."""
    hits, starts = [0] * depth, 0
    for b in range(len(data)):
        tokens, feats, _, masks = data.batch(b)
        inputs = feats[:, :-1]
        valid = masks.valid[:, :-1] & masks.valid[:, 1:]
        want = wanted_ids(masks.top[:, 1:], to_head)  # position i drafts x_{i+2}: the target's choice after x_{i+1}
        known = valid & masks.counted[:, 1:] & (masks.top[:, 1:] >= 0)
        runner = PassRunner(draft, tokens[:, 1:], valid)
        alive, pass_in = known, inputs
        starts += int(known.sum())
        for d in range(depth):
            pred, reg = runner.run(pass_in)
            hit = alive & (lm_head(pred).argmax(-1) == want)
            hits[d] += int(hit.sum())
            alive = shift_right(hit) & known  # the chain goes on one position later, from its own output
            pass_in = next_pass_features(inputs, reg if method == "griffin" else pred)
    return [h / max(starts, 1) for h in hits]


def heldout_due(step: int, last: int, every: int) -> bool:
    """Whether the held-out set is measured after ``step`` (every ``every`` steps and after the last)."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == last)


@dataclass
class HeldOutTracker:
    """Measures a head every ``every`` steps, logs it beside the loss and keeps the best weights by tau."""

    measure: Callable[[torch.nn.Module], list[float]]
    every: int
    best_tau: float = 0.0
    best_step: int = -1
    best_acceptance: list = field(default_factory=list)
    best_weights: dict = field(default_factory=dict)

    def due(self, step: int, last: int) -> bool:
        return heldout_due(step, last, self.every)

    def record(self, module: torch.nn.Module, step: int) -> dict:
        module.eval()
        acceptance = self.measure(module)
        module.train()
        tau = 1.0 + sum(acceptance)
        rounded = [round(a, 4) for a in acceptance]
        if tau > self.best_tau:
            self.best_tau, self.best_step, self.best_acceptance = tau, step + 1, rounded
            self.best_weights = copy.deepcopy(module.state_dict())
        return {"acceptance": rounded, "tau": round(tau, 4)}

    def state(self) -> dict:
        return {
            "best_tau": self.best_tau,
            "best_step": self.best_step,
            "best_acceptance": self.best_acceptance,
            "best_weights": self.best_weights,
        }

    def restore(self, state: dict | None) -> None:
        if state:
            self.best_tau, self.best_step, self.best_weights = (
                state["best_tau"],
                state["best_step"],
                state["best_weights"],
            )
            self.best_acceptance = state.get("best_acceptance", [])

    def summary(self) -> dict:
        return {
            "heldout_best": {"step": self.best_step, "tau": round(self.best_tau, 4), "acceptance": self.best_acceptance}
        }

    def keep_best(self, module: torch.nn.Module) -> None:
        """Load the best measured weights into ``module`` (the one to save)."""
        if self.best_weights:
            module.load_state_dict(self.best_weights)
