"""Parallel drafting: the whole cycle's proposals from one draft forward (P-EAGLE, DFlash).

A sequential feature draft runs one forward per tree level; on a CPU each call's fixed cost, not its arithmetic,
is most of the draft's time. A parallel draft proposes every position of the cycle in the same forward:

* P-EAGLE (``ParallelDrafter``, ``runtime/drafts/peagle.py``) reads the new context pairs and K - 1 masked slots
  after each row's last pair: the root pair's output is the distribution of the first token, slot k's of the
  (k + 1)-th. Only the context pairs are committed to the draft's cache.
* DFlash (``BlockDrafter``, ``runtime/drafts/dflash.py``) writes the new context's keys and values into its cache
  (projections of the target's states, no attention), then runs one block: the root token and K masked slots,
  each slot seeing the whole context and the whole block; slot k's output is the distribution of the k-th token.
  Only the context is committed.

The per-position distributions are marginals (slot k does not see which tokens the earlier positions chose), so a
tree is grown from them as EAGLE-2 grows one (``scored_tree_search``): ``top_k`` beams per level by the sum of
their tokens' log-probabilities, each beam's children from the next position's distribution, the best
``total_tokens - 1`` kept. ``top_k`` 1 gives the chain vLLM drafts with parallel drafting. Verification keeps the
output the target's whatever the draft proposes.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec_kit.runtime.core.contract import BlockStep, FeatureStep
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.draft_context import last_real
from specdec_kit.runtime.decoding.drafting import DraftTree, FeatureTreeDrafter, Tree, scored_tree_search
from specdec_kit.runtime.drafts.dflash import DFlashDraft


def parallel_tree(cfg: DynamicTreeConfig, positions: int) -> DynamicTreeConfig:
    """``cfg`` bounded by what ``positions`` proposals a forward can fill (depth + 1 of them at most)."""
    depth = min(cfg.depth, positions - 1)
    total = min(cfg.total_tokens, 1 + cfg.top_k + depth * cfg.top_k * cfg.top_k)
    return DynamicTreeConfig(total, depth, cfg.top_k)


class OneForwardDrafter(FeatureTreeDrafter):
    """What the parallel drafts share: a dynamic tree grown from the per-position distributions of one forward
    (``proposals``); ``parallel_tokens`` is K, the proposals one forward makes."""

    parallel_tokens: int

    def __init__(self, step, tree: Tree, feature_layers: tuple[int, ...] | None, parallel_tokens: int):
        check_parallel_tree(tree)
        super().__init__(step, tree, feature_layers)
        self.parallel_tokens = int(parallel_tokens)

    def set_tree(self, tree: Tree) -> None:
        check_parallel_tree(tree)
        super().set_tree(tree)

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        coupling, self.coupling = self.coupling, None
        roots = last_real(tokens, counts)
        cfg = parallel_tree(self.tree, self.parallel_tokens)
        logp = self.proposals(features, tokens, counts, cfg.depth + 1)  # [B, depth + 1, V]
        no_features = logp.new_zeros(logp.shape[0], 1)  # the levels read no features: their distributions are given

        def level(beam_feats, beam_tokens, depth, visible):
            beams = beam_tokens.shape[1]
            return logp[:, depth + 1, None, :].expand(-1, beams, -1), beam_feats

        node_tokens, parents, scores = scored_tree_search(roots, logp[:, 0], no_features, cfg, level, coupling)
        return DraftTree.from_parents(node_tokens, parents, scores=scores)

    def proposals(
        self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, wanted: int | None = None
    ) -> torch.Tensor:
        """Read the context, then one forward -> log-probabilities of the first ``wanted`` proposals (default all
        K) [B, wanted, V]."""
        raise NotImplementedError


class ParallelDrafter(OneForwardDrafter):
    """A P-EAGLE draft over a dynamic tree (see the module docstring). ``mask_features`` [1, D] and
    ``mask_token_id`` fill the masked slots."""

    def __init__(
        self,
        step: FeatureStep,
        tree: Tree,
        feature_layers: tuple[int, ...] | None,
        mask_features: torch.Tensor,
        mask_token_id: int,
        parallel_tokens: int,
    ):
        super().__init__(step, tree, feature_layers, parallel_tokens)
        self.mask_features = mask_features.reshape(1, 1, -1)
        self.mask_token_id = int(mask_token_id)

    def proposals(
        self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, wanted: int | None = None
    ) -> torch.Tensor:
        """One forward over the context pairs and each row's masked slots; the context pairs are committed."""
        features, tokens, counts, _, _ = self._context(features, tokens, counts)
        bsz, width = tokens.shape
        proposed = self.parallel_tokens if wanted is None else min(wanted, self.parallel_tokens)
        masked = proposed - 1
        slots = counts[:, None] + torch.arange(masked, device=counts.device)[None, :]  # right after each row's pairs
        feats = torch.cat([features, features.new_zeros(bsz, masked, features.shape[-1])], dim=1)
        feats.scatter_(
            1,
            slots[..., None].expand(-1, -1, feats.shape[-1]),
            self.mask_features.to(feats).expand(bsz, masked, -1),
        )
        toks = torch.cat([tokens, tokens.new_zeros(bsz, masked)], dim=1).scatter(1, slots, self.mask_token_id)
        q_len = width + masked
        ar = torch.arange(q_len, device=tokens.device)
        causal = (ar[None, :] <= ar[:, None]).expand(bsz, q_len, q_len)
        positions = self.positions_from()[:, None] + ar[None, :]
        logits_at = (counts - 1)[:, None] + torch.arange(proposed, device=counts.device)[None, :]
        logits, _ = self.step(feats, toks, positions, causal, self.cache, logits_at=logits_at)
        self._commit_context(counts)
        return self._logp(logits)


class BlockDrafter(OneForwardDrafter):
    """A DFlash draft over a dynamic tree (see the module docstring): ``step`` is a ``BlockStep``; a block is the
    root and up to ``block_size - 1`` masked slots of ``mask_token_id``."""

    def __init__(
        self, step: BlockStep, tree: Tree, feature_layers: tuple[int, ...], mask_token_id: int, block_size: int
    ):
        super().__init__(step, tree, feature_layers, block_size - 1)
        self.mask_token_id = int(mask_token_id)

    @torch.inference_mode()
    def context_step(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor):
        """The context's keys and values into the draft's cache, committed (nothing is proposed from them)."""
        features, tokens, counts, positions, _ = self._context(features, tokens, counts)
        self.step.context(features, positions, self.cache)
        self._commit_context(counts)

    def proposals(
        self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, wanted: int | None = None
    ) -> torch.Tensor:
        """The context committed, then one block: the root and ``wanted`` masked slots at the next positions, all
        seeing each other; the slots' outputs are the proposals (the block's keys are left uncommitted)."""
        roots = last_real(tokens, counts)
        self.context_step(features, tokens, counts)
        masked = self.parallel_tokens if wanted is None else min(wanted, self.parallel_tokens)
        bsz = roots.shape[0]
        block = torch.cat([roots[:, None], roots.new_full((bsz, masked), self.mask_token_id)], dim=1)
        ar = torch.arange(masked + 1, device=roots.device)
        positions = self.positions_from()[:, None] + ar[None, :]
        everything = torch.ones(bsz, masked + 1, masked + 1, dtype=torch.bool, device=roots.device)
        logits = self.step(block, positions, everything, self.cache, logits_at=ar[None, 1:].expand(bsz, -1))
        return self._logp(logits)


class TorchBlockStep:
    """``BlockStep`` on PyTorch: a DFlash draft with the target's token embedding and LM head."""

    def __init__(self, draft: DFlashDraft, embed_tokens: nn.Module, lm_head: nn.Module):
        self.draft, self.embed_tokens, self.lm_head = draft, embed_tokens, lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.draft.fc.weight.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return self.draft.new_cache(batch, capacity)

    @torch.inference_mode()
    def context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        keys, values = self.draft.context_keys_values(features, positions)
        cache.ensure_capacity(cache.key_length(keys.shape[3]))
        cache.write_all(keys, values, cache.slots(keys.shape[3]))

    @torch.inference_mode()
    def __call__(self, tokens, positions, pending_mask, cache, logits_at=None):
        out = self.draft.block(self.embed_tokens(tokens).to(self.dtype), positions, cache.window(pending_mask))
        if logits_at is not None:
            out = torch.gather(out, 1, logits_at[..., None].expand(-1, -1, out.shape[-1]))
        return self.lm_head(out)


def check_parallel_tree(tree: Tree) -> None:
    """A parallel draft grows dynamic trees only: a static tree's shape assumes each level sees its parent."""
    if isinstance(tree, StaticTree) or not isinstance(tree, DynamicTreeConfig):
        raise ValueError(
            "a parallel (P-EAGLE, DFlash) draft drafts dynamic trees only (e.g. dynamic:8:3:1, a chain of 4)"
        )
