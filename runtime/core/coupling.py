"""Drafts coupled to the target's seeded draws: at T > 0 a tree's children are its guesses of the draw, not of
the argmax.

A sampled row's token at generated index k is ``argmax(log r_k + G(seed, k))`` (``sampling.py``): the noise is known
before the target runs. A draft that ranks a node's candidate children by ``log q / T + G(seed, k)`` instead of by
``log q`` puts first the token the target will draw wherever its own distribution q is close to the target's (where
q equals the target's, its first child is the draw). Verification is unchanged, so the emitted tokens are plain
sampling's whatever the draft proposes; only which tokens the tree holds changes.

The perturbed scores are taken over the node's ``POOL`` most likely draft tokens (the draw is almost never outside
them, and a graph's gathers stay small) and turned into the node's log-scores by a softmax at ``SHARPNESS``: the
tree search ranks paths by them as it ranks draft log-probabilities. On SmolLM2's GRIFFIN head at T=0.7 (6 prompts
of each of QA, multi-turn, math and translation, tau alone) a softmax of half the perturbed scores gained 4-6% of
acceptance length over ranking by q; the perturbed scores as they are 1-5%, twice them 0-3%, a quarter of them as
much as half on QA and a third as much on multi-turn. Greedy rows rank by q, bit for bit as without coupling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec_kit.runtime.core.sampling import SamplingParams, gumbel_noise

POOL = 32  # candidate children per node whose draws are compared
SHARPNESS = 0.5  # the tree's log-scores: log_softmax(SHARPNESS * (log q / T + G)) over the pool


@dataclass
class DrawCoupling:
    """What a draft needs to guess a batch's draws: ``noise`` [B, L, V], each row's Gumbel noise of the generated
    indices its tree's levels take (level l: the index of a depth-(l + 1) node; zeros for greedy rows), and
    ``inv_temperature`` [B] (0 for greedy rows, which rank by the draft's log-probabilities alone)."""

    noise: torch.Tensor
    inv_temperature: torch.Tensor


def draw_coupling(
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    first_indices: Sequence[int],
    levels: int,
    vocab: int,
    device: torch.device,
) -> DrawCoupling | None:
    """The coupling of a batch's rows (None when every row is greedy): row b's level l takes generated index
    ``first_indices[b] + l``. The noise is the draws' own (``gumbel_noise`` keeps recent indices, so verification
    reuses what drafting drew)."""
    if all(p.greedy for p in params):
        return None
    noise = torch.zeros(len(params), levels, vocab)
    inv_temperature = torch.zeros(len(params))
    for b, (p, seed, first) in enumerate(zip(params, seeds, first_indices)):
        if not p.greedy:
            if levels:  # none: the drafter needs only which rows sample (a lookup's)
                noise[b] = torch.stack([gumbel_noise(seed, first + level, vocab) for level in range(levels)])
            inv_temperature[b] = 1.0 / p.temperature
    return DrawCoupling(noise.to(device), inv_temperature.to(device))


def ranked_children(
    logp: torch.Tensor, k: int, coupling: DrawCoupling | None, level: int, vocab_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A node's ``k`` best children -> (log-scores, tokens), each [..., k], from the draft's log-probabilities
    ``logp`` [B, V] or [B, n, V] of nodes whose children take level ``level``'s index: by ``logp`` itself without
    coupling and for greedy rows, by the perturbed scores (module docstring) for sampled ones. ``vocab_ids`` [V']:
    ``logp`` is over a draft vocabulary, index i being target id ``vocab_ids[i]`` (the tokens come out as target
    ids; [B, V'] where each row's vocabulary differs). Pure tensor operations, so a draft graph runs it as the runtime
    does."""
    if coupling is None:
        top, at = torch.topk(logp, k, dim=-1)
        return top, (at if vocab_ids is None else vocab_tokens(vocab_ids, at))
    squeeze = logp.dim() == 2
    if squeeze:
        logp = logp[:, None]
    pool_logp, pool_tokens = torch.topk(logp, min(max(POOL, k), logp.shape[-1]), dim=-1)  # [B, n, P]
    if vocab_ids is not None:
        pool_tokens = vocab_tokens(vocab_ids, pool_tokens)
    # Each pooled token's noise read straight from the rows' [L, V] noise by flat index: a graph then copies none of
    # it (expanding a level's noise to every node copied [n, V] floats a level, most of a greedy draft call's gathers).
    bsz, vocab = pool_tokens.shape[0], coupling.noise.shape[-1]
    flat_index = (pool_tokens + level * vocab).reshape(bsz, -1)
    noise = torch.gather(coupling.noise.reshape(bsz, -1), 1, flat_index).view(pool_tokens.shape)
    inv_t = coupling.inv_temperature[:, None, None]
    coupled = torch.log_softmax(SHARPNESS * (pool_logp * inv_t + noise), dim=-1)
    scores = torch.where(inv_t > 0, coupled, pool_logp)
    top, at = torch.topk(scores, k, dim=-1)
    tokens = torch.gather(pool_tokens, -1, at)
    return (top[:, 0], tokens[:, 0]) if squeeze else (top, tokens)


def vocab_tokens(vocab_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Target ids of draft-vocabulary indices ``at`` [B, ...]: ``vocab_ids`` [V'] shared, or [B, V'] per row."""
    if vocab_ids.dim() == 1:
        return vocab_ids[at]
    flat = at.reshape(at.shape[0], -1)
    return torch.gather(vocab_ids, 1, flat).view(at.shape)
