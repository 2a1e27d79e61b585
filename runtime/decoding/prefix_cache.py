"""Automatic prefix caching: the target's keys, values and features of prompt blocks computed once, reused by later
prompts that start with the same tokens (a shared system prompt, a chat's earlier turns, a benchmark's repeated
prompts), so their prefill computes only what is new.

Prompts are cut into blocks of ``block_size`` tokens. A block is found by its own tokens and the block before it (a
trie with exact keys, no hashing), so a hit means the same tokens from the first on; its keys and values are what
the target computed for exactly that prefix. Only whole blocks are kept, and a prompt always leaves at least its last
token to compute (its logits choose the first new token). The cache holds at most ``max_tokens`` tokens; when full,
the least recently used block that no kept block extends goes first, so a kept chain never loses its start.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from specdec_kit.runtime.core.contract import TargetStep


@dataclass(eq=False)
class PrefixBlock:
    """One block of a cached prompt: ``keys``/``values`` [layers, kv_heads, block_size, head_dim] and the target's
    ``features`` [block_size, F] at its positions (what a feature draft reads). A feature draft also keeps its own
    keys/values of the context pairs whose next token lies in the block (pair j: the feature at j, the token at
    j + 1; so the first block holds one pair fewer): they too depend on this block's tokens and those before only."""

    ident: int
    parent: int  # the block before it (0: the prompt's first block)
    keys: torch.Tensor
    values: torch.Tensor
    features: torch.Tensor
    children: int = 0  # kept blocks that extend this one
    draft_keys: torch.Tensor | None = None  # [draft layers, heads, pairs, head_dim], filled when a draft read them
    draft_values: torch.Tensor | None = None


def joined(chain: Sequence[PrefixBlock], draft: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain's keys and values joined along positions (with ``draft``, the draft's pairs), to load into one row."""
    keys = [block.draft_keys if draft else block.keys for block in chain]
    values = [block.draft_values if draft else block.values for block in chain]
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


class PrefixCache:
    """See the module docstring; ``match`` before a prefill, ``store`` after it. One cache serves one generator:
    the blocks also keep its drafter's reading of them."""

    def __init__(self, block_size: int = 16, max_tokens: int = 16384):
        if block_size < 1 or max_tokens < block_size:
            raise ValueError(
                f"prefix cache: block_size {block_size} and max_tokens {max_tokens}: expected "
                "block_size >= 1 and max_tokens >= block_size"
            )
        self.block_size, self.max_tokens = block_size, max_tokens
        self._index: dict[tuple[int, tuple[int, ...]], PrefixBlock] = {}  # (parent ident, tokens) -> block
        self._by_ident: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # least recently used first
        self._idents = itertools.count(1)
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached

    @classmethod
    def within(cls, target: TargetStep, mib: float, block_size: int = 16) -> "PrefixCache":
        """A cache holding at most ``mib`` MiB of ``target``'s keys, values and features (a feature draft's reading
        of the blocks comes on top: its one or few layers against the target's many)."""
        per_token = 2 * target.num_layers * target.num_kv_heads * target.head_dim + target.feature_size
        per_token *= torch.empty((), dtype=target.dtype).element_size()
        tokens = int(mib * 2**20) // per_token
        if tokens < block_size:
            raise ValueError(
                f"prefix cache of {mib} MiB holds {tokens} tokens of this target ({per_token} bytes "
                f"each): expected at least one block of {block_size}"
            )
        return cls(block_size, tokens)

    @property
    def cached_tokens(self) -> int:
        return len(self._by_ident) * self.block_size

    def _blocks_of(self, prompt: Sequence[int], count: int) -> list[tuple[int, ...]]:
        size = self.block_size
        return [tuple(prompt[i * size : (i + 1) * size]) for i in range(count)]

    def _chain(self, prompt: Sequence[int], most: int) -> list[PrefixBlock]:
        """The cached blocks that start ``prompt``, at most ``most`` of them."""
        chain, parent = [], 0
        for tokens in self._blocks_of(prompt, most):
            block = self._index.get((parent, tokens))
            if block is None:
                break
            chain.append(block)
            parent = block.ident
        return chain

    def _touch(self, chain: list[PrefixBlock]) -> None:
        """Mark a chain used, its last block first, so a block always counts as more recent than those extending it."""
        for block in reversed(chain):
            self._by_ident.move_to_end(block.ident)

    def match(self, prompt: Sequence[int]) -> list[PrefixBlock]:
        """The cached blocks that start ``prompt``, leaving at least its last token uncached."""
        chain = self._chain(prompt, (len(prompt) - 1) // self.block_size)
        self._touch(chain)
        self.queried_tokens += len(prompt)
        self.hit_tokens += len(chain) * self.block_size
        return chain

    def cached_length(self, prompt: Sequence[int]) -> int:
        """The tokens of ``prompt`` that ``match`` would find, without counting a query or touching a block."""
        return len(self._chain(prompt, (len(prompt) - 1) // self.block_size)) * self.block_size

    def store(
        self, prompt: Sequence[int], keys: torch.Tensor, values: torch.Tensor, features: torch.Tensor
    ) -> list[PrefixBlock]:
        """Keep the whole blocks of ``prompt`` not kept yet; ``keys``/``values`` [layers, kv_heads, >= n, head_dim]
        and ``features`` [>= n, F] are the target's for its n tokens (slices of a batch's cache are copied).
        Returns the prompt's kept blocks, first to last (a draft adds its own keys and values to them)."""
        count = min(len(prompt), self.max_tokens) // self.block_size
        chain = self._chain(prompt, count)
        parent = chain[-1].ident if chain else 0
        size = self.block_size
        for i, tokens in enumerate(self._blocks_of(prompt, count)[len(chain) :], start=len(chain)):
            span = slice(i * size, (i + 1) * size)
            block = PrefixBlock(
                next(self._idents), parent, keys[:, :, span].clone(), values[:, :, span].clone(), features[span].clone()
            )
            key = (parent, tokens)
            self._index[key] = block
            self._by_ident[block.ident] = key
            if parent:
                self._index[self._by_ident[parent]].children += 1
            chain.append(block)
            parent = block.ident
        self._touch(chain)
        self._evict(keep=chain)
        return chain

    def _evict(self, keep: list[PrefixBlock]) -> None:
        """Drop least recently used leaf blocks until the cache fits (never one of ``keep``, the chain just stored)."""
        kept = {block.ident for block in keep}
        while self.cached_tokens > self.max_tokens:
            victim = next(
                (
                    ident
                    for ident, key in self._by_ident.items()
                    if ident not in kept and self._index[key].children == 0
                ),
                None,
            )
            if victim is None:
                return
            block = self._index.pop(self._by_ident.pop(victim))
            if block.parent:
                self._index[self._by_ident[block.parent]].children -= 1

    def clear(self) -> None:
        self._index.clear()
        self._by_ident.clear()
