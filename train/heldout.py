"""Held-out acceptance while a head trains: how far a chain of the head's greedy drafts would be accepted on samples
it never trains on, counted as the benchmark counts acceptance: the share of drafting *cycles* whose first d drafts
are all the target's greedy tokens (``acceptance[d-1]``; tau = 1 + their sum for a chain).

A chain is drafted from every position of a held-out answer. Depth 1 is the draft's first step from the target's
features; depth d > 1 feeds the draft its own earlier steps, as decoding does (the multi-pass forward of
EAGLE/HASS/GRIFFIN, EAGLE-3's training-time test); a chain ends at its first miss. Decoding does not draft from every
position: a cycle that accepts L drafts is followed by one that starts L + 1 positions later, so which positions
start cycles depends on the head's own hits and misses. ``ChainCounts`` walks each held-out answer as greedy
decoding would (the first cycle after the prefill's token, then L + 1 on) and counts per cycle, which is what the
runtime reports on the same prompts; the mean over every position is kept beside it (``per_position``: the
first-step accuracy, and the number earlier logs recorded). The held-out samples are a fixed hash bucket of the
data's prompt ids, so the split is the same on every run and every data size.
"""

from __future__ import annotations

import copy
import hashlib
import sys
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


@dataclass
class ChainCounts:
    """Chain lengths drafted from held-out answer positions, counted per position and per decoding cycle."""

    depth: int
    max_new_tokens: int | None = None  # decode no further into an answer (the benchmark's limit); None: all of it
    position_hits: list[int] = field(default_factory=list)  # [d-1]: positions whose chain reached depth d
    positions: int = 0
    cycle_hits: list[int] = field(default_factory=list)  # [d-1]: walked cycles that accepted depth d
    cycles: int = 0

    def __post_init__(self):
        self.position_hits = self.position_hits or [0] * self.depth
        self.cycle_hits = self.cycle_hits or [0] * self.depth

    def add(self, lengths: torch.Tensor, starts: torch.Tensor) -> None:
        """``lengths`` [B, T]: the chain length (0..depth) drafted from each position; ``starts`` [B, T]: the
        positions of an answer a chain can start from (contiguous in each row). Each row is walked as greedy decoding
        walks it: its first start drafts for the prefill (which gives the first answer token itself), so the first
        cycle starts one position later; a cycle accepting L drafts moves the next one L + 1 positions on, until
        ``max_new_tokens`` are decoded."""
        lengths, starts = lengths.cpu(), starts.cpu()
        self.positions += int(starts.sum())
        for d in range(self.depth):
            self.position_hits[d] += int(((lengths > d) & starts).sum())
        for row_lengths, row_starts in zip(lengths.tolist(), starts.tolist()):
            if True not in row_starts:
                continue
            first = row_starts.index(True)
            at, end = first + 1, len(row_starts) if self.max_new_tokens is None else first + self.max_new_tokens
            while at < min(end, len(row_starts)) and row_starts[at]:
                accepted = row_lengths[at]
                self.cycles += 1
                for d in range(accepted):
                    self.cycle_hits[d] += 1
                at += accepted + 1

    def per_cycle(self) -> list[float]:
        """Acceptance per depth as the benchmark counts it (the share of decoding cycles reaching depth d)."""
        return [h / max(self.cycles, 1) for h in self.cycle_hits]

    def per_position(self) -> list[float]:
        """Acceptance per depth over every answer position (depth 1: the draft's first-step accuracy)."""
        return [h / max(self.positions, 1) for h in self.position_hits]


def wanted_ids(top: torch.Tensor, to_head: torch.Tensor | None) -> torch.Tensor:
    """The target's greedy next tokens in the head's vocabulary (-1 where unknown or outside it: never hit)."""
    known = top.clamp(min=0)
    ids = known if to_head is None else to_head[known]
    return torch.where(top >= 0, ids, torch.full_like(ids, -1))


@torch.no_grad()
def feature_draft_acceptance(
    draft,
    method: str,
    lm_head,
    to_head: torch.Tensor | None,
    data: DistilledData,
    depth: int = 3,
    max_new_tokens: int | None = None,
) -> ChainCounts:
    """Chain acceptance per depth of an EAGLE/HASS/GRIFFIN head over every batch of ``data``."""
    counts = ChainCounts(depth, max_new_tokens)
    for b in range(len(data)):
        tokens, feats, _, masks = data.batch(b)
        inputs = feats[:, :-1]
        valid = masks.valid[:, :-1] & masks.valid[:, 1:]
        want = wanted_ids(masks.top[:, 1:], to_head)  # position i drafts x_{i+2}: the target's choice after x_{i+1}
        known = valid & masks.counted[:, 1:] & (masks.top[:, 1:] >= 0)
        runner = PassRunner(draft, tokens[:, 1:], valid)
        alive, pass_in = known, inputs
        lengths = torch.zeros_like(known, dtype=torch.long)  # by the position the chain started from
        for d in range(depth):
            pred, reg = runner.run(pass_in)
            hit = alive & (lm_head(pred).argmax(-1) == want)  # at position start + d
            lengths[:, : lengths.shape[1] - d] += hit[:, d:].long()
            alive = shift_right(hit) & known  # the chain goes on one position later, from its own output
            pass_in = next_pass_features(inputs, reg if method == "griffin" else pred)
        counts.add(lengths, known)
    return counts


def heldout_due(step: int, last: int, every: int) -> bool:
    """Whether the held-out set is measured after ``step`` (every ``every`` steps and after the last)."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == last)


@dataclass
class HeldOutTracker:
    """Measures a head every ``every`` steps, logs it beside the loss and keeps the best weights by tau."""

    measure: Callable[[torch.nn.Module], ChainCounts]
    every: int
    best_tau: float = 0.0
    best_step: int = -1
    best_acceptance: list = field(default_factory=list)
    best_weights: dict = field(default_factory=dict)
    start: dict | None = None  # the measurement of the head a run started from (``init_from``), before its first step

    def record_start(self, module: torch.nn.Module) -> None:
        """Measure the head a run starts from: it is the best until a step beats it."""
        self.start = self.record(module, -1)
        print(f"held-out tau {self.start['tau']} before the first step", file=sys.stderr)

    def due(self, step: int, last: int) -> bool:
        return heldout_due(step, last, self.every)

    def record(self, module: torch.nn.Module, step: int) -> dict:
        module.eval()
        counts = self.measure(module)
        module.train()
        acceptance = counts.per_cycle()
        tau = 1.0 + sum(acceptance)
        rounded = [round(a, 4) for a in acceptance]
        if tau > self.best_tau:
            self.best_tau, self.best_step, self.best_acceptance = tau, step + 1, rounded
            self.best_weights = copy.deepcopy(module.state_dict())
        return {
            "acceptance": rounded,
            "tau": round(tau, 4),
            "cycles": counts.cycles,
            "per_position": [round(a, 4) for a in counts.per_position()],
        }

    def state(self) -> dict:
        return {
            "best_tau": self.best_tau,
            "best_step": self.best_step,
            "best_acceptance": self.best_acceptance,
            "best_weights": self.best_weights,
            "counted": "per_cycle",
            **({"start": self.start} if self.start else {}),
        }

    def restore(self, state: dict | None) -> None:
        """Go on from a saved run's best measurement; one counted per position (a run saved before the count per
        decoding cycle) is not comparable, so the run measures its best anew."""
        if state and state.get("counted") == "per_cycle":
            self.best_tau, self.best_step, self.best_weights = (
                state["best_tau"],
                state["best_step"],
                state["best_weights"],
            )
            self.best_acceptance = state.get("best_acceptance", [])
            self.start = state.get("start")

    def summary(self) -> dict:
        return {
            "heldout_best": {
                "step": self.best_step,
                "tau": round(self.best_tau, 4),
                "acceptance": self.best_acceptance,
            },
            **({"heldout_start": self.start} if self.start else {}),
        }

    def keep_best(self, module: torch.nn.Module) -> None:
        """Load the best measured weights into ``module`` (the one to save)."""
        if self.best_weights:
            module.load_state_dict(self.best_weights)
