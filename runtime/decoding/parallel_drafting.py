"""Parallel drafting (P-EAGLE): the whole cycle's proposals from one draft forward.

A sequential feature draft runs one forward per tree level; on a CPU each call's fixed cost, not its arithmetic,
is most of the draft's time. A parallel draft reads the new context pairs and K - 1 masked slots after each row's
last pair in the same forward (``runtime/drafts/peagle.py``): the root pair's output is the distribution of the
first token, slot k's of the (k + 1)-th. Only the context pairs are committed to the draft's cache.

The per-position distributions are marginals (slot k does not see which tokens the earlier positions chose), so a
tree is grown from them as EAGLE-2 grows one (``scored_tree_search``): ``top_k`` beams per level by the sum of
their tokens' log-probabilities, each beam's children from the next position's distribution, the best
``total_tokens - 1`` kept. ``top_k`` 1 gives the chain vLLM drafts with parallel drafting. Verification keeps the
output the target's whatever the draft proposes.
"""

from __future__ import annotations

import torch

from specdec_kit.runtime.core.contract import FeatureStep
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.draft_context import last_real
from specdec_kit.runtime.decoding.drafting import DraftTree, FeatureTreeDrafter, Tree, scored_tree_search


def parallel_tree(cfg: DynamicTreeConfig, positions: int) -> DynamicTreeConfig:
    """``cfg`` bounded by what ``positions`` proposals a forward can fill (depth + 1 of them at most)."""
    depth = min(cfg.depth, positions - 1)
    total = min(cfg.total_tokens, 1 + cfg.top_k + depth * cfg.top_k * cfg.top_k)
    return DynamicTreeConfig(total, depth, cfg.top_k)


class ParallelDrafter(FeatureTreeDrafter):
    """A P-EAGLE draft over a dynamic tree (see the module docstring). ``mask_features`` [1, D] and
    ``mask_token_id`` fill the masked slots; ``parallel_tokens`` is K, the proposals one forward makes."""

    def __init__(
        self,
        step: FeatureStep,
        tree: Tree,
        feature_layers: tuple[int, ...] | None,
        mask_features: torch.Tensor,
        mask_token_id: int,
        parallel_tokens: int,
    ):
        check_parallel_tree(tree)
        super().__init__(step, tree, feature_layers)
        self.mask_features = mask_features.reshape(1, 1, -1)
        self.mask_token_id, self.parallel_tokens = int(mask_token_id), int(parallel_tokens)

    def set_tree(self, tree: Tree) -> None:
        check_parallel_tree(tree)
        super().set_tree(tree)

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        return self.scored_draft(features, tokens, counts)

    @torch.inference_mode()
    def scored_draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        roots = last_real(tokens, counts)
        cfg = parallel_tree(self.tree, self.parallel_tokens)
        logp = self.proposals(features, tokens, counts, cfg.depth + 1)  # [B, depth + 1, V]
        no_features = logp.new_zeros(logp.shape[0], 1)  # the levels read no features: their distributions are given

        def level(beam_feats, beam_tokens, depth, visible):
            beams = beam_tokens.shape[1]
            return logp[:, depth + 1, None, :].expand(-1, beams, -1), beam_feats

        node_tokens, parents, scores = scored_tree_search(roots, logp[:, 0], no_features, cfg, level)
        return DraftTree.from_parents(node_tokens, parents, scores=scores)

    def proposals(
        self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, wanted: int | None = None
    ) -> torch.Tensor:
        """One forward over the context pairs and each row's masked slots -> log-probabilities of the first
        ``wanted`` proposals (default all K) [B, wanted, V]; the context pairs are committed."""
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
        self._commit_context(counts, width)
        return self._logp(logits)


def check_parallel_tree(tree: Tree) -> None:
    """A parallel draft grows dynamic trees only: a static tree's shape assumes each level sees its parent."""
    if isinstance(tree, StaticTree) or not isinstance(tree, DynamicTreeConfig):
        raise ValueError("a parallel (P-EAGLE) draft drafts dynamic trees only (e.g. dynamic:8:3:1, a chain of 4)")
