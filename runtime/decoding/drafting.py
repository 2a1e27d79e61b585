"""Drafters: turn the newest verified context into a batch of token trees (one per sequence).

Every drafter receives, per cycle, the target features of the positions just committed paired with
the tokens that follow them (the last one is the tree root: the verified-but-uncached token) and
returns a ``DraftTree``. ``FeatureTreeDrafter`` drives EAGLE/HASS and GRIFFIN drafts over a static or
an EAGLE-2 dynamic tree; ``MedusaDrafter`` reads Medusa heads into a static tree; ``NoDrafter`` gives
the root alone, which makes the same loop plain autoregressive decoding.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
from torch import nn

from specdec_kit.runtime.core.contract import FeatureStep, MedusaStep, WholeTreeStep
from specdec_kit.runtime.core.coupling import DrawCoupling, ranked_children
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree, ancestor_masks
from specdec_kit.runtime.decoding.draft_context import last_real
from specdec_kit.runtime.decoding.joined_vocab import JoinedTokens
from specdec_kit.runtime.decoding.prefix_cache import PrefixBlock, joined
from specdec_kit.runtime.drafts.layers import FeatureDraft


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] long, column 0 is the root
    parents: torch.Tensor  # [B, N] long, -1 for the root and for padding
    valid: torch.Tensor  # [B, N] bool, False for padding nodes
    tree_mask: torch.Tensor  # [B, N, N] bool ancestor mask
    depth: torch.Tensor  # [B, N] long
    scores: torch.Tensor | None = None  # [B, N] each node's path log-probability under the draft, where it has one

    @classmethod
    def from_parents(
        cls,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        valid: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
    ) -> "DraftTree":
        """``valid`` None: every node is real (no padding)."""
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
        mask, depth = ancestor_masks(parents, valid)
        return cls(tokens=tokens, parents=parents, valid=valid, tree_mask=mask, depth=depth, scores=scores)

    @classmethod
    def from_static(cls, tokens: torch.Tensor, tree: StaticTree) -> "DraftTree":
        bsz = tokens.shape[0]
        buf = tree.buffers
        return cls(
            tokens=tokens,
            parents=buf.parents.to(tokens.device).expand(bsz, -1),
            valid=torch.ones_like(tokens, dtype=torch.bool),
            tree_mask=buf.tree_mask.to(tokens.device).expand(bsz, -1, -1),
            depth=buf.position_offsets.to(tokens.device).expand(bsz, -1),
        )


Tree = StaticTree | DynamicTreeConfig


@dataclass(frozen=True)
class DraftCheckpoint:
    """The committed lengths of a drafter's own caches at one moment (``Drafter.checkpoint``), and how many
    positions each row had skipped by then (``FeatureTreeDrafter``'s bounded catch-up)."""

    lengths: tuple[torch.Tensor, ...]
    skipped: torch.Tensor | None = None


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """A draft's log-probabilities, in float32 whatever the engine's dtype (tree scores add them up)."""
    return torch.log_softmax(logits.float(), dim=-1)


def recent_pairs(features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, window: int):
    """Per row, only its last ``window`` context pairs (left-aligned) -> (features, tokens, counts, dropped)."""
    keep = counts.clamp(max=window)
    dropped = counts - keep
    width = min(window, tokens.shape[1])
    idx = dropped[:, None] + torch.arange(width, device=tokens.device)[None, :]
    idx = idx.clamp(max=tokens.shape[1] - 1)
    feats = torch.gather(features, 1, idx[..., None].expand(-1, -1, features.shape[-1]))
    return feats, torch.gather(tokens, 1, idx), keep, dropped


class Drafter:
    """What the generation loop, the server and client-server drafting ask of a drafter.

    ``max_nodes`` bounds the tree size (for cache sizing) and ``max_depth`` its depth."""

    max_nodes: int = 1
    max_depth: int = 0
    tree: Tree | None = None
    feature_layers: tuple[int, ...] | None = None  # the target layers whose entering hidden states it reads
    couples_draws: bool = False  # whether it ranks a sampled row's children by the row's draws (``coupling.py``)

    def target_view(self, target):
        """The target as this drafter reads it: itself, or (EAGLE-3) a view returning the tapped layers. An ONNX
        Runtime target returns what its graph was exported to return, which must be what the drafter reads."""
        if self.feature_layers is None or getattr(target, "feature_layers", None) == self.feature_layers:
            return target
        if not hasattr(target, "tapped"):
            raise ValueError(
                f"this drafter reads the hidden states entering target layers {list(self.feature_layers)}; "
                f"the target returns {getattr(target, 'feature_layers', None) or 'its last layer'}"
            )
        return target.tapped(self.feature_layers)

    def reset(self, batch: int, capacity: int) -> None:
        """Start a fresh batch of ``batch`` sequences."""

    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        raise NotImplementedError

    def couple_draws(self, coupling: DrawCoupling | None) -> None:
        """The next draft's rows' draws (None: rank by the draft alone); a drafter that ``couples_draws`` uses them."""

    @property
    def coupled_depth(self) -> int:
        """How many levels of draws ``couple_draws`` needs: the tree's depth, or fewer where part of the tree does not
        follow the draws (each level is a row's Gumbel noise over the whole vocabulary)."""
        return self.max_depth

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of the batch (finished sequences leave)."""

    def add_rows(self, count: int, capacity: int) -> None:
        """Make room for ``count`` sequences joining the batch (their context arrives with the next draft)."""

    def join(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        capacity: int,
        prefix: Sequence[Sequence[PrefixBlock]] | None = None,
    ) -> bool:
        """Make room for rows joining the batch with this pending context ([n, W, d], [n, W], [n]). True: this
        drafter read all but each row's last pair now, on the joining rows alone, and the caller keeps only the
        last pairs pending; False (the default): it reads all of them with the next draft. ``prefix``: each row's
        prompt blocks in the prefix cache, where a drafter may find (and leave) its reading of them."""
        self.add_rows(counts.shape[0], capacity)
        return False

    def bind(self, target_cache: KVCache) -> None:
        """The target's cache of the batch being decoded (drafts that read the target's K/V keep it)."""

    def set_tree(self, tree: Tree) -> None:
        """Draft ``tree`` from the next cycle on (the server shrinks trees as its batch grows)."""
        raise ValueError(f"{type(self).__name__} drafts no tree")

    def owned_caches(self) -> list[KVCache]:
        """The caches this drafter owns (what ``checkpoint`` saves and ``restore`` rolls back)."""
        return []

    def checkpoint(self) -> DraftCheckpoint:
        return DraftCheckpoint(tuple(c.lengths.clone() for c in self.owned_caches()))

    def restore(self, checkpoint: DraftCheckpoint) -> None:
        """Roll the drafter's caches back to ``checkpoint`` (what was drafted since is forgotten)."""
        for cache, lengths in zip(self.owned_caches(), checkpoint.lengths, strict=True):
            cache.truncate(lengths)


class NoDrafter(Drafter):
    """Plain decoding: the tree is the root alone."""

    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        roots = torch.gather(tokens, 1, (counts - 1)[:, None])
        bsz = roots.shape[0]
        ones = torch.ones(bsz, 1, 1, dtype=torch.bool, device=roots.device)
        minus = torch.full((bsz, 1), -1, dtype=torch.long, device=roots.device)
        return DraftTree(roots, minus, ones[:, :, 0], ones, torch.zeros_like(minus))


class MedusaDrafter(Drafter):
    """Medusa heads over a static tree: a node at depth k takes head k-1's top-``rank`` token."""

    def __init__(self, heads: MedusaStep, tree: StaticTree):
        if tree.buffers.max_depth > heads.num_heads:
            raise ValueError(f"static tree depth {tree.buffers.max_depth} exceeds the {heads.num_heads} Medusa heads")
        self.heads, self.tree = heads, tree
        self.max_nodes, self.max_depth = tree.buffers.num_nodes, tree.buffers.max_depth

    def set_tree(self, tree: Tree) -> None:
        if not isinstance(tree, StaticTree) or tree.buffers.max_depth > self.heads.num_heads:
            raise ValueError(f"Medusa heads draft static trees of depth <= {self.heads.num_heads}, got {tree}")
        self.tree = tree
        self.max_nodes = max(self.max_nodes, tree.buffers.num_nodes)

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        last = last_real(features, counts)  # [B, d]
        roots = last_real(tokens, counts)
        logits = self.heads(last)  # [B, H, V]
        top = torch.topk(logits, self.tree.max_rank, dim=-1).indices  # [B, H, R]
        depth = self.tree.buffers.position_offsets[1:].to(top.device)
        ranks = self.tree.ranks[1:].to(top.device)
        node_tokens = top[:, depth - 1, ranks]  # [B, N-1]
        return DraftTree.from_static(torch.cat([roots[:, None], node_tokens], dim=1), self.tree)


class TorchFeatureStep:
    """``FeatureStep`` on PyTorch: a feature draft plus the target's LM head."""

    def __init__(self, draft: FeatureDraft, lm_head: nn.Module):
        self.draft, self.lm_head = draft, lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.draft.embed_tokens.weight.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return self.draft.new_cache(batch, capacity)

    @torch.inference_mode()
    def __call__(self, features, tokens, positions, pending_mask, cache, logits_at=None, vocab=None):
        pred, reg = self.draft.step(features, tokens, positions, pending_mask, cache)
        if logits_at is not None:
            pred = torch.gather(pred, 1, logits_at[..., None].expand(-1, -1, pred.shape[-1]))
        if vocab is not None:  # a reduced vocabulary's rows, then each row's joined tokens' (``TargetRowsHead``)
            return self.lm_head.place_with(self.lm_head.own_with(pred, vocab), vocab), reg
        return self.lm_head(pred), reg


class FeatureTreeDrafter(Drafter):
    """EAGLE/HASS/GRIFFIN draft steps (any ``FeatureStep``) over a static or a dynamic tree.

    Catching up is bounded: after plain cycles (a loaded server's choice) each row has a long context the draft has
    not read, and reading all of it for every row cost more than the cycle's verification. One catch-up reads at
    most ``catch_up_pairs`` pairs over the batch (but each row's last ``min_window`` at least); a row's older
    unread pairs are skipped, its later positions keep their place (``skipped`` offsets them), and the draft
    attends over what it read. Drafts stay lossless (verification decides); only the first tree after a skip may
    accept less. A batch of one reads prompts up to ``catch_up_pairs`` long whole."""

    catch_up_pairs: int = 512
    min_window: int = 16
    couples_draws = True

    def __init__(
        self,
        step: FeatureStep,
        tree: Tree,
        feature_layers: tuple[int, ...] | None = None,
        joined: JoinedTokens | None = None,
    ):
        self.step, self.feature_layers = step, feature_layers
        self.joined = joined  # the rows' own tokens joining a reduced draft vocabulary (``joined_vocab.py``)
        self.max_nodes = self.max_depth = 0
        self.set_tree(tree)
        self.cache: KVCache | None = None
        self.skipped: torch.Tensor | None = None  # [B] positions each row skipped unread
        self.coupling: DrawCoupling | None = None  # the next draft's (``couple_draws``), used once

    def set_tree(self, tree: Tree) -> None:
        self.tree = tree
        nodes, depth = (
            (tree.buffers.num_nodes, tree.buffers.max_depth)
            if isinstance(tree, StaticTree)
            else (tree.total_tokens, tree.depth + 1)
        )
        self.max_nodes, self.max_depth = max(self.max_nodes, nodes), max(self.max_depth, depth)

    def owned_caches(self) -> list[KVCache]:
        return [self.cache]

    def couple_draws(self, coupling: DrawCoupling | None) -> None:
        self.coupling = coupling

    def reset(self, batch: int, capacity: int) -> None:
        self.cache = self.step.new_cache(batch, capacity)
        self.skipped = torch.zeros(batch, dtype=torch.long, device=self.cache.lengths.device)
        if self.joined is not None:
            self.joined.reset(batch)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)
        self.skipped = self.skipped[rows]
        if self.joined is not None:
            self.joined.select_rows(rows)

    def add_rows(self, count: int, capacity: int) -> None:
        self.cache = KVCache.with_rows(self.cache, self.step.new_cache(count, capacity))
        self.skipped = torch.cat([self.skipped, self.skipped.new_zeros(count)])
        if self.joined is not None:
            self.joined.add_rows(count)

    def _vocab(self) -> dict:
        """The step's ``vocab`` argument where tokens join the draft vocabulary."""
        return {} if self.joined is None else {"vocab": self.joined.vocab()}

    def join(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        capacity: int,
        prefix: Sequence[Sequence[PrefixBlock]] | None = None,
    ) -> bool:
        """Read the joining rows' prompts now, on those rows alone, into a cache of their own that then joins the
        batch's. Read in the next draft instead, every row of the batch would be padded to the longest prompt (at
        16 rows, a draft call 16 times the width it needs), and the bounded catch-up would split its pairs over
        all rows, skipping most of each new prompt for good; read here, a batch of one reads its prompt whole.
        Pairs a prefix block already holds are loaded, not read; blocks read now keep this reading."""
        ahead = counts - 1  # the last pair is the root's: it stays pending for the next draft
        if not ahead.numel() or int(ahead.min()) < 1:
            return super().join(features, tokens, counts, capacity, prefix)
        running = self.cache, self.skipped
        running_joined = None if self.joined is None else self.joined.take(counts.shape[0])
        self.cache = self.step.new_cache(counts.shape[0], capacity)
        self.skipped = torch.zeros_like(counts)
        try:
            if self.joined is not None:  # the whole prompt, a cached prefix's pairs included (loaded, not read)
                self.joined.read(tokens, counts)
            loaded = self._load_prefix_pairs(prefix, ahead)
            rest = ahead - loaded
            width = int(rest.max())
            at = (loaded[:, None] + torch.arange(width, device=counts.device)[None, :]).clamp(max=tokens.shape[1] - 1)
            self.context_step(
                torch.gather(features, 1, at[..., None].expand(-1, -1, features.shape[-1])),
                torch.gather(tokens, 1, at),
                rest,
            )
            if prefix is not None:
                self._keep_prefix_pairs(prefix, ahead)
            joining = self.cache, self.skipped
        finally:
            self.cache, self.skipped = running
            if running_joined is not None:
                self.joined.give(running_joined)
        self.cache = KVCache.with_rows(self.cache, joining[0])
        self.skipped = torch.cat([self.skipped, joining[1]])
        return True

    def _load_prefix_pairs(self, prefix: Sequence[Sequence[PrefixBlock]] | None, ahead: torch.Tensor) -> torch.Tensor:
        """Load into the (fresh) cache each row's pairs its leading prefix blocks hold; returns how many per row
        (always fewer than ``ahead``: a cached prefix leaves at least the prompt's last token)."""
        loaded = torch.zeros_like(ahead)
        for b, chain in enumerate(prefix or []):
            read = list(itertools.takewhile(lambda block: block.draft_keys is not None, chain))
            if read:
                keys, values = joined(read, draft=True)
                n = min(keys.shape[2], int(ahead[b]) - 1)
                self.cache.load_prefix(b, keys[:, :, :n], values[:, :, :n])
                loaded[b] = n
        return loaded

    def _keep_prefix_pairs(self, prefix: Sequence[Sequence[PrefixBlock]], ahead: torch.Tensor) -> None:
        """Give each prefix block without them the pairs whose next token it holds, from rows read whole."""
        for b, chain in enumerate(prefix):
            if int(self.skipped[b]) or int(self.cache.lengths[b]) != int(ahead[b]):
                continue  # a catch-up skipped part of this prompt: its pairs are not at their positions
            for i, block in enumerate(chain):
                size = block.keys.shape[2]
                if block.draft_keys is None and (i + 1) * size - 1 <= int(ahead[b]):
                    span = slice(max(0, i * size - 1), (i + 1) * size - 1)
                    block.draft_keys = self.cache.keys[:, b, :, span].clone()
                    block.draft_values = self.cache.values[:, b, :, span].clone()

    def checkpoint(self) -> DraftCheckpoint:
        return replace(super().checkpoint(), skipped=self.skipped.clone())

    def restore(self, checkpoint: DraftCheckpoint) -> None:
        super().restore(checkpoint)
        self.skipped = checkpoint.skipped.clone()

    def positions_from(self) -> torch.Tensor:
        """[B] each row's next position: what its cache holds plus what it skipped."""
        return self.cache.lengths + self.skipped

    def _bounded(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor):
        """The context a catch-up reads (see the class docstring); rows' skipped positions are recorded."""
        window = max(self.min_window, self.catch_up_pairs // max(1, tokens.shape[0]))
        if tokens.shape[1] <= window:
            return features, tokens, counts
        features, tokens, counts, dropped = recent_pairs(features, tokens, counts, window)
        self.skipped = self.skipped + dropped
        return features, tokens, counts

    @staticmethod
    def _logp(logits: torch.Tensor) -> torch.Tensor:
        return log_probs(logits)

    def _context(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor):
        """What a context step reads (see ``_bounded``) -> (features, tokens, counts, positions, causal mask)."""
        if self.joined is not None:
            self.joined.read(tokens, counts)
        features, tokens, counts = self._bounded(features, tokens, counts)
        bsz, q_len = tokens.shape
        ar = torch.arange(q_len, device=tokens.device)
        causal = (ar[None, :] <= ar[:, None]).expand(bsz, q_len, q_len)
        positions = self.positions_from()[:, None] + ar[None, :]
        return features.to(self.step.dtype), tokens, counts, positions, causal

    def _commit_context(self, counts: torch.Tensor) -> None:
        """The context pairs join the draft's sequence in place."""
        self.cache.advance(counts)

    @torch.inference_mode()
    def context_step(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor):
        """Run the context pairs through the draft into its cache -> the root's next-token log-probs [B, V]
        and its predicted feature [B, d] (the tree grows from them; a client offline continues from them)."""
        features, tokens, counts, positions, causal = self._context(features, tokens, counts)
        logits, reg = self.step(
            features, tokens, positions, causal, self.cache, logits_at=(counts - 1)[:, None], **self._vocab()
        )
        self._commit_context(counts)
        return self._logp(logits[:, 0]), last_real(reg, counts)

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        """The cycle's tree, for a dynamic tree with each node's path log-score (``DraftTree.scores``: its
        log-probability, or a sampled row's coupled score; a hybrid ranks the head's nodes by them): in one call where
        the step has a whole-tree graph for the tree, otherwise step by step."""
        if isinstance(self.step, WholeTreeStep) and self.step.drafts_whole(self.tree):
            return self._whole_tree(features, tokens, counts)
        coupling, self.coupling = self.coupling, None
        roots = last_real(tokens, counts)
        root_logp, root_reg = self.context_step(features, tokens, counts)
        if isinstance(self.tree, StaticTree):
            return self._static(roots, root_logp, root_reg, coupling)
        return self._dynamic(roots, root_logp, root_reg, coupling)

    def _whole_tree(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        """The context step and the tree search in one call of the step (``WholeTreeStep``)."""
        coupling, self.coupling = self.coupling, None
        features, tokens, counts, positions, causal = self._context(features, tokens, counts)
        node_tokens, node_parents, scores = self.step.whole_tree(
            features, tokens, positions, causal, self.cache, counts - 1, coupling, **self._vocab()
        )
        self._commit_context(counts)
        return DraftTree.from_parents(node_tokens, node_parents, scores=scores)

    def _step(self, feats, toks, level_pos, pending):
        """One tree level: ``toks`` [B, n] at ``level_pos`` past each row's cache, seeing ``pending``."""
        positions = (self.positions_from() + level_pos)[:, None].expand_as(toks)
        logits, reg = self._run_step(feats, toks, positions, pending)
        return self._logp(logits), reg

    def _run_step(self, feats, tokens, positions, pending):
        return self.step(feats, tokens, positions, pending, self.cache, **self._vocab())

    def _static(
        self, roots: torch.Tensor, root_logp: torch.Tensor, root_reg: torch.Tensor, coupling: DrawCoupling | None
    ) -> DraftTree:
        tree = self.tree
        buf = tree.buffers
        n = buf.num_nodes
        bsz, dev = roots.shape[0], roots.device
        depth = buf.position_offsets.tolist()
        parents = buf.parents.tolist()
        ranks = tree.ranks.tolist()
        draft_mask = buf.tree_mask[1:, 1:].to(dev)  # among draft nodes (slot i-1 holds node i)
        node_tokens = torch.zeros(bsz, n, dtype=torch.long, device=dev)
        node_tokens[:, 0] = roots
        topk = {0: ranked_children(root_logp, tree.max_rank, coupling, 0)[1]}  # node -> [B, R]
        reg = {0: root_reg}
        for level in range(1, buf.max_depth + 1):
            nodes = [i for i in range(1, n) if depth[i] == level]
            for i in nodes:
                node_tokens[:, i] = topk[parents[i]][:, ranks[i]]
            if level == buf.max_depth:
                break
            start, end = nodes[0], nodes[-1] + 1
            feats = torch.stack([reg[parents[i]] for i in nodes], dim=1)
            pending = draft_mask[start - 1 : end - 1, : end - 1].expand(bsz, -1, -1)
            logp, out_reg = self._step(feats, node_tokens[:, start:end], level - 1, pending)
            top = ranked_children(logp, tree.max_rank, coupling, level)[1]
            for j, i in enumerate(nodes):
                topk[i], reg[i] = top[:, j], out_reg[:, j]
        return DraftTree.from_static(node_tokens, tree)

    def _dynamic(
        self, roots: torch.Tensor, root_logp: torch.Tensor, root_reg: torch.Tensor, coupling: DrawCoupling | None
    ) -> DraftTree:
        tokens, parents, scores = scored_tree_search(roots, root_logp, root_reg, self.tree, self._step, coupling)
        return DraftTree.from_parents(tokens, parents, scores=scores)


LevelStep = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def scored_tree_search(
    roots: torch.Tensor,
    root_logp: torch.Tensor,
    root_reg: torch.Tensor,
    cfg: DynamicTreeConfig,
    step: LevelStep,
    coupling: DrawCoupling | None = None,
    vocab_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's dynamic tree: ``cfg.top_k`` beams grown ``cfg.depth`` levels by cumulative log-probability, then the
    best ``cfg.total_tokens - 1`` candidates kept -> (node tokens [B, N], node parents [B, N], node path
    log-probabilities [B, N]; node 0 is the root, scored 0). With a ``coupling`` a sampled row's children are ranked
    and scored by their chances of being its draws (``ranked_children``).

    ``step(features [B, k, d], tokens [B, k], level - 1, visible [B, k, slots])`` drafts one level: the beams see
    the earlier levels' slots (and their own) through ``visible``. Pure tensor operations with ``cfg`` fixed, so an
    engine can export the whole search as one graph (``runtime/ort/graphs.py``, ``DraftTreeGraph``). ``vocab_ids``:
    the log-probabilities are over a draft vocabulary (``ranked_children``)."""
    k = cfg.top_k
    bsz, dev = roots.shape[0], roots.device
    rows = torch.arange(bsz, device=dev)[:, None]
    scores, beam_tokens = ranked_children(root_logp, k, coupling, 0, vocab_ids)  # level 1: the root's top-k
    cand_tokens, cand_scores = [beam_tokens], [scores]
    cand_parents = [torch.full((bsz, k), -1, dtype=torch.long, device=dev)]
    cand_depth = [torch.ones(bsz, k, dtype=torch.long, device=dev)]
    beam_ids = torch.arange(k, device=dev).expand(bsz, k)  # candidate id of each beam
    beam_feats = root_reg[:, None, :].expand(bsz, k, root_reg.shape[-1])
    beam_anc = torch.eye(k, dtype=torch.bool, device=dev).expand(bsz, k, k)  # over draft slots so far
    base = k
    for level in range(1, cfg.depth + 1):
        logp, reg = step(beam_feats, beam_tokens, level - 1, beam_anc)
        child_logp, child_tok = ranked_children(logp, k, coupling, level, vocab_ids)  # [B, K, K]
        cum = (child_logp + scores[:, :, None]).view(bsz, k * k)
        cand_tokens.append(child_tok.view(bsz, k * k))
        cand_scores.append(cum)
        cand_parents.append(beam_ids.repeat_interleave(k, dim=1))
        cand_depth.append(torch.full((bsz, k * k), level + 1, dtype=torch.long, device=dev))
        if level == cfg.depth:
            break
        scores, flat = torch.topk(cum, k, dim=-1)
        parent_beam = flat // k
        beam_tokens = child_tok.view(bsz, k * k)[rows, flat]
        beam_feats = reg[rows, parent_beam]
        new_slot = torch.eye(k, dtype=torch.bool, device=dev).expand(bsz, k, k)
        beam_anc = torch.cat([beam_anc[rows, parent_beam], new_slot], dim=2)
        beam_ids = base + flat
        base += k * k
    tokens = torch.cat(cand_tokens, dim=1)
    parents = torch.cat(cand_parents, dim=1)
    depth = torch.cat(cand_depth, dim=1)
    # Keep the best total_tokens-1 by cumulative log-prob; a child never outranks its parent
    # (log-probs <= 0, and ties go to the shallower node), so the kept nodes form a tree.
    key = torch.cat(cand_scores, dim=1).double() - depth.double() * 1e-9
    keep = min(cfg.total_tokens - 1, key.shape[1])
    chosen = torch.sort(torch.topk(key, keep, dim=-1).indices, dim=-1).values  # parents first
    node_of = torch.full_like(tokens, -1)
    node_of.scatter_(1, chosen, torch.arange(1, keep + 1, device=dev).expand(bsz, keep))
    par_cand = torch.gather(parents, 1, chosen)
    par_node = torch.where(par_cand < 0, torch.zeros_like(par_cand), torch.gather(node_of, 1, par_cand.clamp(min=0)))
    node_tokens = torch.cat([roots[:, None], torch.gather(tokens, 1, chosen)], dim=1)
    node_parents = torch.cat([torch.full((bsz, 1), -1, dtype=torch.long, device=dev), par_node], dim=1)
    node_scores = torch.cat(
        [torch.zeros(bsz, 1, device=dev), torch.gather(torch.cat(cand_scores, dim=1), 1, chosen)], 1
    )
    return node_tokens, node_parents, node_scores
