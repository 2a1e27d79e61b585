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


def start_from(
    head: nn.Module, init_from: str | Path, method: str, target: TargetModel, seen: torch.Tensor | None = None
) -> float | None:
    """Load the head saved at ``init_from`` (official layout, checked against ``target``) into ``head``, a new head of
    the run's settings; a ValueError naming the saved head and each tensor whose shape differs when it does not fit
    (another draft vocabulary size, another number of Medusa heads). Returns the share of the training tokens
    ``seen`` in the saved head's draft vocabulary, which replaces the one the data chose (None: no reduced vocabulary
    or no tokens given)."""
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
    t2d = getattr(head, "t2d", None)
    coverage = None if t2d is None or seen is None else vocabulary_coverage(t2d, seen)
    covers = "" if coverage is None else f"; its draft vocabulary covers {coverage:.1%} of the training tokens"
    print(f"{method}: starts from the head in {init_from}{covers}", file=sys.stderr)
    return coverage


def vocabulary_coverage(t2d: torch.Tensor, seen: torch.Tensor) -> float:
    """The share of the training tokens ``seen`` in a draft vocabulary (``t2d``: a mask over the target's ids); a low
    share caps what the head can ever accept."""
    return float(t2d.cpu()[seen.cpu()].float().mean())
