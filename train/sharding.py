"""FSDP2 for the head trainers (``sharding: fsdp`` under ``torchrun``): the training step is one ``fully_shard`` unit,
so each rank keeps 1/world of the head's weights, gradients and AdamW state between steps (16 bytes a trainable
parameter in float32 become 16 / world) and gathers the weights for the step itself. The frozen LM head (the target's
rows that score the draft) stays whole on every rank: it is not trained, and the data and the held-out measurement
read its rows directly.

The training state on disk stays the plain one (rank 0 writes the whole head and an optimizer state indexed like a
one-process run's), so a run resumes on any number of ranks, sharded or not. Gathering it is a collective: every
rank calls ``gather``; only rank 0 gets the tensors.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdec_kit.train.schedule import save_state_dicts

if TYPE_CHECKING:
    from specdec_kit.train.parallel import Ranks

SHARDINGS = ("ddp", "fsdp")


class ShardedStep:
    """A training step module under FSDP2, its head's plain twin on rank 0 (what is measured and saved) and the
    conversion between the plain training state and the sharded one."""

    def __init__(self, step: nn.Module, head: nn.Module, frozen: nn.Module, main: bool, prefix: str = "draft."):
        from torch.distributed.fsdp import fully_shard

        self.prefix = prefix
        self.names = [n for n, p in head.named_parameters() if p.requires_grad]  # the plain optimizer's order
        self.plain = copy.deepcopy(head) if main else None  # before sharding: a whole copy to measure and save
        fully_shard(step, ignored_params=set(frozen.parameters()))
        self.step = step

    def describe(self) -> str:
        """How much of the head this rank holds (its shards of the trainable parameters)."""
        trainable = [p for p in self.step.parameters() if p.requires_grad]
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trainable)
        total = sum(p.numel() for p in trainable)
        return f"this rank holds {local:,} of the head's {total:,} trainable parameters"

    def gather(self, opt: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None] | None:
        """The whole head's state dict and (with ``opt``) the plain optimizer state, on rank 0 (None elsewhere); the
        plain twin holds the gathered weights afterwards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(self.step, options=options)
        optim = get_optimizer_state_dict(self.step, opt, options=options) if opt is not None else None
        if self.plain is None:
            return None
        head = {k[len(self.prefix) :]: v for k, v in model.items() if k.startswith(self.prefix)}
        self.plain.load_state_dict(head)
        return head, None if optim is None else self.to_plain(optim)

    def load(self, opt: torch.optim.Optimizer, head: dict, optim: dict) -> None:
        """Every rank loads the plain state (read from disk by each) into its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.step, {self.prefix + k: v for k, v in head.items()}, options=options)
        set_optimizer_state_dict(self.step, opt, self.from_plain(optim), options=options)
        if self.plain is not None:
            self.plain.load_state_dict(head)

    def to_plain(self, optim: dict) -> dict:
        """An optimizer state keyed by parameter names (the state-dict API's) as a one-process run's, by index."""
        index = {self.prefix + name: i for i, name in enumerate(self.names)}
        groups = [dict(g, params=[index[n] for n in g["params"]]) for g in optim["param_groups"]]
        return {"state": {index[n]: s for n, s in optim["state"].items()}, "param_groups": groups}

    def from_plain(self, optim: dict) -> dict:
        names = [self.prefix + name for name in self.names]
        groups = [dict(g, params=[names[i] for i in g["params"]]) for g in optim["param_groups"]]
        return {"state": {names[int(i)]: s for i, s in optim["state"].items()}, "param_groups": groups}


def distribute(
    step: nn.Module, head: nn.Module, frozen: nn.Module, sharding: str, ranks: Ranks, what: str, progress: bool
) -> tuple[nn.Module, ShardedStep | None]:
    """The training step as the ranks run it: sharded with FSDP2 (``sharding`` fsdp over several ranks; ``frozen``
    stays whole on every rank), else wrapped by ``ranks`` (DDP, or the step itself in one process)."""
    if sharding == "fsdp" and ranks.world > 1:
        sharded = ShardedStep(step, head, frozen, ranks.main)
        if progress:
            print(f"{what}: FSDP2 over {ranks.world} ranks, {sharded.describe()}", file=sys.stderr)
        return step, sharded
    return ranks.wrap(step), None


def save_training_state(
    sharded: ShardedStep | None,
    head: nn.Module,
    opt: torch.optim.Optimizer,
    ranks: Ranks,
    steps: int,
    history: list,
    path: Path,
    extra: dict | None = None,
) -> None:
    """The plain training state after ``steps`` steps, written by rank 0 (gathering a sharded one is a collective:
    every rank calls this; under DDP every rank holds the whole head and rank 0's is written)."""
    gathered = sharded.gather(opt) if sharded is not None else (head.state_dict(), opt.state_dict())
    if ranks.main:
        save_state_dicts(*gathered, steps, history, path, extra)
