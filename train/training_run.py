"""What every trainer does around its steps, in one place: after each step the held-out measurement (when due), the
step's record in the history and, every 100 steps and after the last, the resumable state; at the end the best
held-out weights. The trainers differ in their data and their step, not in this bookkeeping, and a resumed or
time-limited run must behave alike in all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specdec_kit.train.distilled import DistilledData
from specdec_kit.train.heldout import ChainCounts, HeldOutTracker, heldout_due
from specdec_kit.train.parallel import Ranks
from specdec_kit.train.schedule import Schedule, saved_extra
from specdec_kit.train.sharding import ShardedStep, save_training_state

STATE_EVERY = 100  # steps between saved training states (and after the last)


def heldout_measure(
    heldout: DistilledData | None,
    schedule: Schedule,
    ranks: Ranks,
    lm_rows: torch.Tensor,
    device: torch.device,
    measure: Callable[..., ChainCounts],
) -> Callable[[nn.Module], ChainCounts] | None:
    """A run's held-out measurement (None without held-out data or ``eval_every``): ``measure(head, data=...)`` over
    ``heldout``, which rank 0, the rank that measures, puts on ``device`` with the LM rows its targets are scored by.
    Every rank gets the same answer, since every rank takes part in gathering a sharded head before it."""
    if heldout is None or not schedule.eval_every:
        return None
    if ranks.main:
        heldout.lm_rows = lm_rows
        heldout.to(device)
    return partial(measure, data=heldout)


@dataclass
class TrainingRun:
    """One trainer's run: ``trained`` is the module the optimizer steps (its state is saved), ``measured`` the whole
    head rank 0 measures and writes (a sharded head's gathered copy). ``measure`` (None: no held-out set) counts a
    head's held-out acceptance; under several ranks only rank 0 measures, but every rank joins the gathering of a
    sharded head before it."""

    schedule: Schedule
    trained: nn.Module
    measured: nn.Module
    opt: torch.optim.Optimizer
    ranks: Ranks
    sharded: ShardedStep | None
    history: list
    state_path: Path
    measure: Callable[[nn.Module], ChainCounts] | None = None
    tracker: HeldOutTracker | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.measure is not None and self.schedule.eval_every and self.ranks.main:
            self.tracker = HeldOutTracker(self.measure, self.schedule.eval_every)
            self.tracker.restore(saved_extra(self.state_path))  # a resumed run keeps its best measurement
            if self.schedule.init_from and not self.history:  # a run from a saved head keeps it unless beaten
                self.tracker.record_start(self.measured)

    def log(self, record: dict, step: int) -> None:
        """After ``step``: measure on the held-out set when due (into ``record``), keep the record, save the state
        when due. ``schedule.steps`` is read now: a time limit may have made this step the last."""
        last = self.schedule.steps
        if self.sharded is not None and self.measure is not None and heldout_due(step, last, self.schedule.eval_every):
            self.sharded.gather()  # every rank takes part; rank 0's whole head is then measured
        if self.tracker is not None and self.tracker.due(step, last):
            record["heldout"] = self.tracker.record(self.measured, step)
        self.history.append(record)
        if (step + 1) % STATE_EVERY == 0 or step + 1 == last:
            extra = self.tracker.state() if self.tracker else None
            save_training_state(
                self.sharded, self.trained, self.opt, self.ranks, step + 1, self.history, self.state_path, extra
            )

    def finish(self) -> bool:
        """The best held-out weights into the measured head, the ranks closed; whether this rank writes the head."""
        if self.tracker is not None:
            self.tracker.keep_best(self.measured)
        self.ranks.close()
        return self.ranks.main

    def summary(self) -> dict:
        """The best held-out measurement, for the trainer's report (empty without one)."""
        return self.tracker.summary() if self.tracker else {}
