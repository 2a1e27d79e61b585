"""Training on several processes under ``torchrun``: each rank takes its share of every batch's rows, and the loss is
averaged over the positions counted on all ranks, so that with DistributedDataParallel's averaging the gradient is
the one a single process computes from the whole batch (2 ranks follow 1 rank's loss curve at the same global batch).

Without ``torchrun`` (``WORLD_SIZE`` unset or 1) every method here is the identity: one process, no process group.
The training state is the plain module's and optimizer's (replicated under DDP), written by rank 0, so a run resumes on
any number of ranks.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

# How long a rank waits, without the GIL, for gloo's worker threads to let go of its last collectives (``Ranks.close``).
GLOO_DRAIN_SECONDS = 1.0


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_environment(cls, device: torch.device) -> "Ranks":
        """The ranks ``torchrun`` started (gloo on a CPU, NCCL on GPUs), or one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:  # this rank's GPU is "cuda" from now on
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    @staticmethod
    def device(default: torch.device) -> torch.device:
        """A rank's own GPU (``LOCAL_RANK``) where the default is CUDA; the CPU is shared."""
        if default.type == "cuda" and "LOCAL_RANK" in os.environ:
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return default

    @property
    def main(self) -> bool:
        """Rank 0: it logs, measures held-out acceptance and writes the checkpoints."""
        return self.rank == 0

    def share(self, rows: int) -> slice:
        """This rank's contiguous rows of a batch of ``rows`` (the ranks' shares differ by one row at most)."""
        return slice(rows * self.rank // self.world, rows * (self.rank + 1) // self.world)

    def wrap(self, module: nn.Module) -> nn.Module:
        """DistributedDataParallel over ``module`` on several ranks (its gradients averaged across them)."""
        if self.world == 1:
            return module
        return nn.parallel.DistributedDataParallel(module)

    def mean(self, total: torch.Tensor, count: int) -> torch.Tensor:
        """``total`` (a sum over this rank's ``count`` positions) as this rank's part of the mean over every rank's
        positions, scaled so that DDP's averaging of the gradients gives the mean's gradient."""
        if self.world == 1:
            return total / max(count, 1)
        return total * self.world / max(float(self.reduced([float(count)])[0]), 1.0)

    def average(self, value: float) -> float:
        """A logged quantity (a rank's part of the loss) summed over the ranks and divided by their number."""
        if self.world == 1:
            return value
        return float(self.reduced([value])[0]) / self.world

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (every rank gets the same answer: a decision they must take together)."""
        if self.world == 1:
            return flag
        return bool(self.reduced([float(flag)], dist.ReduceOp.MAX)[0])

    @staticmethod
    def reduced(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """``values`` reduced over the ranks; on the rank's GPU where the process group is NCCL's (it reduces GPU
        tensors only), on the CPU under gloo."""
        out = torch.tensor(values, device=Ranks.collective_device())
        dist.all_reduce(out, op=op)
        return out.tolist()

    @staticmethod
    def collective_device() -> torch.device:
        """Where a tensor in a collective must sit: the rank's GPU under NCCL (it moves GPU tensors only), the CPU
        under gloo."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @staticmethod
    @contextlib.contextmanager
    def syncing(model: nn.Module, sync: bool) -> Iterator[None]:
        """A micro-batch's backward: its gradients reduced across the ranks only with ``sync`` (the last one of a step);
        the others accumulate locally (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``)."""
        if sync:
            yield
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            with model.no_sync():
                yield
        elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            yield

    def close(self) -> None:
        """Ends the process group once every rank is done. Under gloo a worker thread releases a finished collective's
        tensors only after the caller has seen it complete, and releasing a tensor Python knows takes the GIL; the group
        is destroyed on the thread that drops its last reference (the DDP reducer, FSDP2's mesh), which joins the
        workers while it holds the GIL. If a worker is still releasing then, both wait for ever (seen under CPU
        contention). So the rank first sleeps, which hands the GIL to the workers to finish."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            if dist.get_backend() == "gloo":
                time.sleep(GLOO_DRAIN_SECONDS)
            dist.destroy_process_group()
