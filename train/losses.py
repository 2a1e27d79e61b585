"""Per-position training losses of the draft methods, and GRIFFIN's token-alignment mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def pass_loss(
    prediction: torch.Tensor,
    regression: torch.Tensor,
    target_features: torch.Tensor,
    target_logits: torch.Tensor,
    lm_head: torch.nn.Module,
    mask: torch.Tensor,
    weights: LossWeights,
) -> tuple[PassResult, torch.Tensor]:
    """Loss of one pass; also returns the draft's logits (for accuracy and GRIFFIN's masks).

    prediction/regression/target_features [B, T, d]; target_logits [B, T, V] (the target's next-token
    logits at the same positions); mask [B, T] which positions count.
    """
    draft_logits = lm_head(prediction)
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    target_p = torch.softmax(target_logits.float(), dim=-1)
    per_pos = weights.regression * F.smooth_l1_loss(regression.float(), target_features.float(), reduction="none").mean(
        -1
    )
    per_pos = per_pos + weights.prediction * -(target_p * logp).sum(-1)
    if weights.topk > 0:
        top_p, top_i = torch.topk(target_p, weights.topk_k, dim=-1)
        per_pos = per_pos + weights.topk * -(top_p * torch.gather(logp, -1, top_i)).sum(-1)
    loss = masked_mean(per_pos, mask)
    with torch.no_grad():
        best = target_logits.argmax(-1)
        top3 = torch.topk(draft_logits, 3, dim=-1).indices
        m = mask.bool()
        n = int(m.sum())
        top1_acc = float(((top3[..., 0] == best) & m).sum()) / max(n, 1)
        top3_acc = float(((top3 == best[..., None]).any(-1) & m).sum()) / max(n, 1)
    return PassResult(loss, top1_acc, top3_acc, n), draft_logits


def predictable(draft_logits: torch.Tensor, true_next: torch.Tensor, k: int = 3) -> torch.Tensor:
    """GRIFFIN: a position is predictable when the true next token is in the draft's top-k."""
    return (torch.topk(draft_logits, k, dim=-1).indices == true_next[..., None]).any(-1)


def shift_right(mask: torch.Tensor) -> torch.Tensor:
    """Position i takes position i-1's value; position 0 becomes False (it has no predecessor)."""
    return torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)


def next_alignment_mask(
    chain: torch.Tensor, draft_logits: torch.Tensor, true_next: torch.Tensor, k: int = 3
) -> torch.Tensor:
    """GRIFFIN's mask for the next pass: in pass n+1 position i consumes position i-1's output of
    pass n, so it stays only if that position was predictable and its own chain held; the result is
    the product of the predictable-masks of the preceding positions along the chain."""
    return shift_right(chain & predictable(draft_logits, true_next, k))


def medusa_loss(logits: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """logits [B, T, H, V] from the features at each position; head h predicts tokens[i + 2 + h]."""
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
        total = total + masked_mean(ce, m)
        with torch.no_grad():
            accs.append(float(((lg.argmax(-1) == lab) & m.bool()).sum()) / max(int(m.sum()), 1))
    return total, accs
