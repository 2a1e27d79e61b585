"""The frozen target for online hidden states under ``torchrun``: replicated on every rank, or sharded across them with
FSDP2 (``target_sharding: fsdp``), and each rank running only its share of a batch's rows through it.

Sharded, every decoder layer is its own ``fully_shard`` unit: a rank keeps 1/world of each layer's weights and gathers
one layer at a time for the forward (resharding after it), so a target too large for one GPU beside the head still
runs in the training loop (a 70B target in bfloat16, 141 GB: 8 GiB of layer shards a GPU over 16, beside its whole
embedding and LM head, 4 GiB). The embedding, the final norm and the LM head stay whole: the head copies the
embedding, and the LM head scores every draft position. Every rank
runs the same number of target forwards (its share of each batch), as FSDP's collectives need.

Replicated or sharded, splitting the rows divides the target's compute by the ranks; the features of the other ranks'
rows are gathered afterwards where a trainer's step reads the whole batch (it takes its share itself).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist

from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.parallel import Ranks

TARGET_SHARDINGS = ("replicated", "fsdp")


def shard_target(target: TargetModel) -> tuple[int, int]:
    """Shard ``target``'s decoder layers across the process group's ranks (FSDP2, frozen); (decoder-layer parameters
    this rank holds, all of them)."""
    from torch.distributed.fsdp import fully_shard

    layers = target.hf_model.model.layers
    target.hf_model.requires_grad_(False)
    total = sum(p.numel() for p in layers.parameters())
    for layer in layers:
        fully_shard(layer)
    return sum(p.to_local().numel() for p in layers.parameters()), total


def check_target_sharding(target_sharding: str, online: bool, world: int) -> None:
    """A ValueError naming the problem where ``target_sharding`` cannot apply."""
    if target_sharding not in TARGET_SHARDINGS:
        raise ValueError(f"target_sharding {target_sharding!r}: expected one of {list(TARGET_SHARDINGS)}")
    if target_sharding == "fsdp" and not online:
        raise ValueError(
            "target_sharding fsdp shards the target that runs in every training step (online hidden states); with a "
            "feature cache or distilled data the target does not run in training"
        )
    if target_sharding == "fsdp" and world < 2:
        raise ValueError("target_sharding fsdp needs several ranks (torchrun --nproc-per-node N, N >= 2)")


def prepare_target(target: TargetModel, target_sharding: str, online: bool, ranks: Ranks, progress: bool) -> None:
    """Put the target on this rank's GPU (torchrun's ranks all load it on the first one) and shard it where asked
    (checked first)."""
    if ranks.world == 1 and target_sharding == "replicated":
        return
    check_target_sharding(target_sharding, online, ranks.world)
    if target.device.type == "cuda":
        target.to(ranks.device(target.device))
    if target_sharding == "fsdp":
        held, total = shard_target(target)
        if progress:
            print(
                f"target: FSDP2 over {ranks.world} ranks, this rank holds {held:,} of the target's {total:,} "
                "decoder-layer parameters",
                file=sys.stderr,
            )


@torch.no_grad()
def rows_through_target(
    forward: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], tokens: torch.Tensor, ranks: Ranks
) -> tuple[torch.Tensor, ...]:
    """``forward`` (the target's outputs for token rows, each [rows, ...]) over the whole batch ``tokens``: each rank
    runs its share of the rows and the outputs are gathered, so every rank holds the batch's (in row order)."""
    if ranks.world == 1:
        return forward(tokens)
    rows = tokens.shape[0]
    mine = forward(tokens[ranks.share(rows)])
    counts = [len(range(rows)[Ranks(r, ranks.world).share(rows)]) for r in range(ranks.world)]
    device = Ranks.collective_device()
    gathered = []
    for out in mine:  # the shares differ by one row at most: each padded to the widest for the collective
        padded = out.new_zeros((max(counts), *out.shape[1:]), device=device)
        padded[: out.shape[0]] = out
        parts = [torch.empty_like(padded) for _ in range(ranks.world)]
        dist.all_gather(parts, padded)
        gathered.append(torch.cat([part[:n] for part, n in zip(parts, counts)]).to(out.device))
    return tuple(gathered)
