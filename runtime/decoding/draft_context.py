"""The draft's pending context: per row, the target features of verified positions the draft has not read
yet, each paired with the token that follows it.

A speculative cycle replaces the context with the accepted path (a few pairs). A cycle that does not draft
(plain decoding under load) appends to it, and a long plain run makes it long: appending by concatenation
copied the whole context every cycle, quadratic in the run's length and, at 16 rows, a fifth of a plain
cycle. Here appends write the new pairs in place after each row's last one, into buffers that double when
full, so a cycle costs what it adds.

A ``DraftContext`` is a value: ``append`` returns a new one sharing the buffers and writes only past every
row's count, so an earlier context (a snapshot kept for rollback) still reads what it held. Appending to an
earlier context again overwrites what later ones wrote past it: only the newest branch stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftContext:
    feats_buffer: torch.Tensor  # [B, capacity, d] (d may be 0: drafts without per-position features)
    tokens_buffer: torch.Tensor  # [B, capacity]
    counts: torch.Tensor  # [B] pairs per row
    width: int  # the longest row's count: the part of the buffers a reader sees

    @classmethod
    def of(cls, feats: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> "DraftContext":
        """A context over these tensors (taken as they are, not copied)."""
        if feats.shape[:2] != tokens.shape or tokens.shape[0] != counts.shape[0]:
            raise ValueError(
                f"draft context: features {tuple(feats.shape)}, tokens {tuple(tokens.shape)} and "
                f"counts {tuple(counts.shape)} disagree on rows or width"
            )
        width = int(counts.max().item()) if counts.numel() else 0
        if width > tokens.shape[1]:
            raise ValueError(f"draft context: a row counts {width} pairs but the tensors hold {tokens.shape[1]}")
        return cls(feats, tokens, counts, width)

    @property
    def feats(self) -> torch.Tensor:
        return self.feats_buffer[:, : self.width]

    @property
    def tokens(self) -> torch.Tensor:
        return self.tokens_buffer[:, : self.width]

    @property
    def capacity(self) -> int:
        return self.tokens_buffer.shape[1]

    def append(self, feats: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> "DraftContext":
        """Per row, its pairs followed by the first ``counts`` of the new ones (``feats`` [B, A, d])."""
        added = tokens.shape[1]
        need = self.width + added
        feats_buf, tokens_buf = self.feats_buffer, self.tokens_buffer
        if need > self.capacity:
            grown = max(need, 2 * self.capacity)
            feats_buf = _widened(feats_buf[:, : self.width], grown)
            tokens_buf = _widened(tokens_buf[:, : self.width], grown)
        at = self.counts[:, None] + torch.arange(added, device=tokens.device)[None, :]  # [B, A]
        tokens_buf.scatter_(1, at, tokens)
        if feats_buf.shape[-1]:
            feats_buf.scatter_(1, at[..., None].expand(-1, -1, feats_buf.shape[-1]), feats.to(feats_buf.dtype))
        total = self.counts + counts
        return DraftContext(feats_buf, tokens_buf, total, int(total.max().item()))

    def select_rows(self, rows: torch.Tensor) -> "DraftContext":
        """Only ``rows`` (in that order); the buffers shrink to the rows' width."""
        counts = self.counts[rows]
        width = int(counts.max().item()) if counts.numel() else 0
        return DraftContext(self.feats_buffer[rows, :width], self.tokens_buffer[rows, :width], counts, width)

    def last_pairs(self) -> "DraftContext":
        """Each row's last pair alone (the rest was read ahead); every row has one."""
        if not bool((self.counts >= 1).all()):
            raise ValueError("draft context: a row without pairs has no last pair")
        feats, tokens = last_real(self.feats, self.counts), last_real(self.tokens, self.counts)
        return DraftContext.of(feats[:, None], tokens[:, None], torch.ones_like(self.counts))

    def extend_rows(self, other: "DraftContext") -> "DraftContext":
        """These rows followed by ``other``'s."""
        width = max(self.width, other.width)
        feats = torch.cat([_widened(self.feats, width), _widened(other.feats.to(self.feats_buffer.dtype), width)])
        tokens = torch.cat([_widened(self.tokens, width), _widened(other.tokens, width)])
        return DraftContext(feats, tokens, torch.cat([self.counts, other.counts]), width)


def last_real(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [B, Q, ...] -> x[b, counts[b] - 1]."""
    idx = (counts - 1).view(-1, *([1] * (x.ndim - 1))).expand(-1, 1, *x.shape[2:])
    return torch.gather(x, 1, idx).squeeze(1)


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` [B, W, ...] in a fresh buffer of ``width`` >= W positions (zeros after W)."""
    out = x.new_zeros(x.shape[0], width, *x.shape[2:])
    out[:, : x.shape[1]] = x
    return out
