"""Per-position training losses of the draft methods, and GRIFFIN's token-alignment mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec_kit.train.parallel import Ranks


@dataclass(frozen=True)
class LossWeights:
    regression: float = 1.0  # SmoothL1 on the (regression) feature
    prediction: float = 0.1  # soft cross-entropy of the LM head on the prediction feature
    topk: float = 0.0  # HASS top-K distillation
    topk_k: int = 10


@dataclass
class PassResult:
    loss: torch.Tensor  # scalar, averaged over the positions in the mask
    top1: float
    top3: float
    positions: int


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass
class TargetSide:
    """The target's half of every pass's loss at the positions that can count (``where``), computed once a batch: the
    passes differ only in which of those count and in the draft's half."""

    where: torch.Tensor  # [B, T] bool
    features: torch.Tensor  # [N, d] the target's features the regression aims at
    probs: torch.Tensor  # [N, V] its next-token distribution
    best: torch.Tensor  # [N] its most likely next token
    top_p: torch.Tensor | None  # [N, K] its K most likely tokens' probabilities (HASS's top-K loss), their ids below
    top_i: torch.Tensor | None

    @classmethod
    @torch.no_grad()
    def at(
        cls, where: torch.Tensor, features: torch.Tensor, logits: torch.Tensor, weights: LossWeights
    ) -> "TargetSide":
        """``features`` [B, T, d] and ``logits`` [B, T, V]: the target's at the same positions as the draft's."""
        logits = logits[where].float()
        probs = torch.softmax(logits, dim=-1)
        top_p, top_i = torch.topk(probs, weights.topk_k, dim=-1) if weights.topk > 0 else (None, None)
        return cls(where, features[where].float(), probs, logits.argmax(-1), top_p, top_i)


# a top-k entry the pass did not compute: neither a token nor -1 (a token outside the head's vocabulary)
NOT_DRAFTED = -2


def pass_loss(
    prediction: torch.Tensor,
    regression: torch.Tensor,
    target: TargetSide,
    lm_head: torch.nn.Module,
    mask: torch.Tensor,
    weights: LossWeights,
    top_at: torch.Tensor | None = None,
    k: int = 3,
    ranks: Ranks = Ranks(),
) -> tuple[PassResult, torch.Tensor]:
    """Loss of one pass over the positions in ``mask`` (within ``target.where``); the LM head runs only there and at
    ``top_at`` (GRIFFIN's next chain needs the draft's top tokens one or two positions before a counted one), the
    vocabulary-wide work being most of a step. Returns the result and the draft's top-``k`` tokens [B, T, k]
    (``NOT_DRAFTED`` where not computed).

    prediction/regression [B, T, d]; mask [B, T] which positions count."""
    at = mask if top_at is None else mask | top_at
    draft_logits = lm_head(prediction[at])  # [M, V]
    counted, aims = mask[at], mask[target.where]  # the counted rows among those computed, and among the target's
    logp = torch.log_softmax(draft_logits[counted].float(), dim=-1)
    per_pos = weights.regression * F.smooth_l1_loss(
        regression[mask].float(), target.features[aims], reduction="none"
    ).mean(-1)
    per_pos = per_pos + weights.prediction * -(target.probs[aims] * logp).sum(-1)
    if weights.topk > 0:
        per_pos = per_pos + weights.topk * -(target.top_p[aims] * torch.gather(logp, -1, target.top_i[aims])).sum(-1)
    n = int(counted.sum())
    loss = ranks.mean(per_pos.sum(), n)  # the mean over the positions counted on every rank
    with torch.no_grad():
        top = torch.topk(draft_logits, max(k, 3), dim=-1).indices
        best, top3 = target.best[aims], top[counted][:, :3]
        top1_acc = float((top3[:, 0] == best).sum()) / max(n, 1)
        top3_acc = float((top3 == best[:, None]).any(-1).sum()) / max(n, 1)
        drafted = torch.full((*mask.shape, top.shape[-1]), NOT_DRAFTED, dtype=top.dtype, device=top.device)
        drafted[at] = top
    return PassResult(loss, top1_acc, top3_acc, n), drafted


def predictable(draft_top: torch.Tensor, true_next: torch.Tensor, k: int = 3) -> torch.Tensor:
    """GRIFFIN: a position is predictable when the true next token is among the draft's top-k (``draft_top`` [B, T,
    >= k], the draft's tokens best first)."""
    return (draft_top[..., :k] == true_next[..., None]).any(-1)


def shift_right(mask: torch.Tensor) -> torch.Tensor:
    """Position i takes position i-1's value; position 0 becomes False (it has no predecessor)."""
    return torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)


def next_alignment_mask(
    chain: torch.Tensor, draft_top: torch.Tensor, true_next: torch.Tensor, k: int = 3
) -> torch.Tensor:
    """GRIFFIN's mask for the next pass: in pass n+1 position i consumes position i-1's output of
    pass n, so it stays only if that position was predictable and its own chain held; the result is
    the product of the predictable-masks of the preceding positions along the chain."""
    return shift_right(chain & predictable(draft_top, true_next, k))


def shift_left(mask: torch.Tensor) -> torch.Tensor:
    """Position i takes position i+1's value; the last position becomes False."""
    return torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)


def chain_top_positions(token_mask: torch.Tensor, chain: torch.Tensor, passes_left: int) -> torch.Tensor:
    """Where a GRIFFIN pass needs the draft's top tokens beyond the positions it counts: a chain position up to
    ``passes_left`` before a position that can count (its predictability decides that position's later passes)."""
    ahead, reach = token_mask, torch.zeros_like(token_mask)
    for _ in range(passes_left):
        ahead = shift_left(ahead)
        reach = reach | ahead
    return chain & reach


def medusa_loss(
    logits: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, ranks=None
) -> tuple[torch.Tensor, list[float]]:
    """logits [B, T, H, V] from the features at each position; head h predicts tokens[i + 2 + h]. Under several
    ``ranks`` (a ``train.parallel.Ranks``) each head's loss is this rank's part of the mean over every rank's
    positions."""
    total, accs = logits.new_zeros(()), []
    seq = tokens.shape[1]
    for h in range(logits.shape[2]):
        shift = 2 + h
        if seq <= shift:
            break
        lg = logits[:, : seq - shift, h]
        lab = tokens[:, shift:]
        m = valid[:, shift:]
        ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), lab.reshape(-1), reduction="none").view_as(lab)
        total = total + (masked_mean(ce, m) if ranks is None else ranks.mean((ce * m).sum(), int(m.sum())))
        with torch.no_grad():
            accs.append(float(((lg.argmax(-1) == lab) & m.bool()).sum()) / max(int(m.sum()), 1))
    return total, accs
