"""Per-request sampling parameters, the target-distribution transform, and seeded draws.

Plain decoding and speculative verification both draw through ``sampled_tokens``, over
``processed_scores``: temperature, then top-k, then top-p (the order ``transformers`` applies its
warpers in), so speculative sampling reproduces exactly the distribution plain sampling draws from.

Draws are Gumbel-max samples keyed by the request's seed and the index of the token being chosen:
the k-th generated token is ``argmax(log r_k + G(seed, k))`` with ``G`` standard Gumbel noise that
depends on nothing else; ``log r_k`` is the processed scores less their log-sum-exp, a constant the
argmax does not see, so a draw never normalises (a softmax and a log over the vocabulary saved per
draw). So a request's text is a function of its prompt and seed alone: the same whatever tree
verified it, whether a cycle speculated at all, and whatever else shared the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from specdec_kit.runtime.core.argmax import argmax_last

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean "off"."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit signed integer), got {self.seed}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed target distribution (float32) over the last axis of ``logits``."""
    return processed_scores(logits, params).softmax(dim=-1)


def processed_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed distribution's log-probabilities up to a constant per row (float32): ``logits`` over the
    temperature, tokens top-k or top-p leave out at -inf."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - params.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def _mix64(x: int) -> int:
    """splitmix64's finaliser: neighbouring (seed, index) pairs get unrelated generator seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(params: SamplingParams) -> int | None:
    """The seed a request's draws are keyed by: its own, or a fresh random one; None for greedy requests."""
    if params.greedy:
        return None
    return params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())


@lru_cache(maxsize=256)  # 16 sampled rows' draft levels of one cycle and the next
def gumbel_noise(seed: int, index: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [vocab] (CPU, float32) for the token at generated ``index`` of a request. Read-only: the
    recent indices' noise is kept, since a cycle's drafting (``coupling.py``) and verification draw the same."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_mix64(_mix64(seed & _MASK64) ^ index))
    u = torch.rand(vocab, generator=gen).clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


def sampled_tokens(logits: torch.Tensor, params: SamplingParams, seed: int, indices: list[int]) -> torch.Tensor:
    """The target's draw at each of ``logits``' rows [N, V], row n choosing the token at generated index
    ``indices[n]``: Gumbel-max over the processed distribution (an exact sample from it)."""
    scores = processed_scores(logits, params).cpu()
    vocab = scores.shape[-1]
    if len(indices) == 1:  # verification's and plain decoding's one draw at a time
        noise = gumbel_noise(seed, indices[0], vocab)
    else:
        drawn = {k: gumbel_noise(seed, k, vocab) for k in set(indices)}
        noise = torch.stack([drawn[k] for k in indices])
    return argmax_last(scores + noise).to(logits.device)
