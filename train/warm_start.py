"""A head's training started from a saved head instead of a seeded new one (``Schedule.init_from``): a head continued
on more or other data, its learning rate decayed over data it has not seen, or fine-tuned on a serving team's own
traffic. The saved head brings its weights and its draft vocabulary; the run measures it on the held-out set before
its first step, so the head it keeps is never worse there than the one it started from."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from specdec_kit.runtime.models.target import TargetModel


def start_from(head: nn.Module, init_from: str | Path, method: str, target: TargetModel) -> None:
    """Load the head saved at ``init_from`` (official layout, checked against ``target``) into ``head``, a new head of
    the run's settings; a ValueError naming the saved head and each tensor whose shape differs when it does not fit
    (another draft vocabulary size, another number of Medusa heads)."""
    from specdec_kit.runtime.loader import load_draft_for
    from specdec_kit.train.methods import method_kind

    saved = load_draft_for(target, method_kind(method), init_from).state_dict()
    own = head.state_dict()
    differ = [
        f"{key}: saved {tuple(saved[key].shape)}, this run's {tuple(own[key].shape)}"
        for key in own
        if key in saved and saved[key].shape != own[key].shape
    ]
    missing = sorted(set(own) ^ set(saved))
    if differ or missing:
        raise ValueError(
            f"init_from {init_from}: its {method} head does not fit the head this run trains ("
            + "; ".join(differ + [f"{key}: in one of them only" for key in missing])
            + "); give the run the saved head's settings (draft_vocab, heads, layers)"
        )
    with torch.no_grad():
        for key, value in own.items():
            value.copy_(saved[key])
    print(f"{method}: starts from the head in {init_from}", file=sys.stderr)


def vocabulary_coverage(head: nn.Module, seen: torch.Tensor) -> float | None:
    """The share of the training tokens ``seen`` in ``head``'s draft vocabulary (None: it proposes from the target's
    whole vocabulary)."""
    t2d = getattr(head, "t2d", None)
    return None if t2d is None else float(t2d.cpu()[seen.cpu()].float().mean())
