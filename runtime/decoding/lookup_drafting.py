"""Drafting without a trained head (prompt lookup, suffix trees), and a head's tree merged with a lookup's.

``LookupDrafter`` keeps each row's tokens (its prompt as it joins, then what each cycle verified) in a model-free
source (``core/lookup.py``) and turns the source's proposal into the row's tree: no draft forward at all, so on a
CPU it costs next to nothing to draft and pays wherever the output repeats the prompt or earlier outputs. Verifying
is not free, so each cycle keeps only as much of the proposal as its measured acceptance and cost pay for
(``proposal_sizing.py``; the kinds' ``size_by_cost``). Rows' trees differ in size; shorter ones are padded with
invalid nodes (verification never accepts them).

``HybridDrafter`` drafts a head's dynamic tree and a lookup's proposal for every row and keeps, under the head's
token budget, the nodes with the highest estimated chance that the target emits their path, from either: the head's
own path probability (the product of its draft probabilities along the path) or, for the lookup's nodes, the share
of nodes like them that verification accepted (its sizing's calibration; a raw share of earlier occurrences rates a
continuation seen once at 1.0). A path both propose keeps the higher estimate, and the merged tree keeps as many of
its best nodes as their estimates pay for. Where the lookup alone promises more tokens per second than merged trees
have been giving, the cycle drafts its tree alone and saves the head's draft.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from specdec_kit.runtime.core.coupling import DrawCoupling
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.core.lookup import Budget, NgramIndex, NgramSettings, Proposal, SuffixCache, SuffixSettings
from specdec_kit.runtime.core.trees import HEAD, HYBRID, LOOKUP, DynamicTreeConfig, source_of
from specdec_kit.runtime.decoding.draft_context import DraftContext
from specdec_kit.runtime.decoding.drafting import (
    DraftCheckpoint,
    Drafter,
    DraftTree,
    FeatureTreeDrafter,
    Tree,
    recent_pairs,
)
from specdec_kit.runtime.decoding.prefix_cache import PrefixBlock
from specdec_kit.runtime.decoding.proposal_sizing import ProposalSizing, RunningMean, best_width

Kind = tuple[bool, bool]  # a hybrid's kind of cycle: the lookup found a proposal; the rows sample


def lookup_budget(tree: Tree) -> Budget:
    """The proposal a dynamic tree's numbers allow: ``total_tokens - 1`` nodes, paths of ``depth + 1`` tokens,
    ``top_k`` children per node (the same bounds a head's dynamic tree has)."""
    if not isinstance(tree, DynamicTreeConfig):
        raise ValueError(
            "model-free drafts grow their own trees: give a dynamic tree (its total_tokens, depth and top_k bound "
            f"each proposal), not {tree}"
        )
    return Budget(nodes=tree.total_tokens - 1, depth=tree.depth + 1, branches=tree.top_k)


class LookupSource(ABC):
    """Where a ``LookupDrafter``'s proposals come from: one state per running row."""

    @abstractmethod
    def open(self) -> object:
        """A fresh row's state."""

    @abstractmethod
    def extend(self, row: object, tokens: list[int]) -> None:
        """Tokens the row's sequence now holds after what it held."""

    @abstractmethod
    def propose(self, row: object, budget: Budget) -> Proposal: ...

    def prompt_read(self, row: object) -> None:
        """The row's tokens so far are its prompt (what it holds after that is its response)."""

    def finish(self, row: object) -> None:
        """The row left the batch (finished or cancelled)."""


class NgramSource(LookupSource):
    """Prompt lookup: each row's own n-gram index."""

    def __init__(self, settings: NgramSettings = NgramSettings()):
        self.settings = settings

    def open(self) -> NgramIndex:
        s = self.settings
        return NgramIndex(s.prompt_lookup_min, s.prompt_lookup_max, s.occurrences, s.use_oldest)

    def extend(self, row: NgramIndex, tokens: list[int]) -> None:
        row.extend(tokens)

    def propose(self, row: NgramIndex, budget: Budget) -> Proposal:
        return row.propose(budget)


class _SuffixRow:
    __slots__ = ("sequence", "prompt")

    def __init__(self, sequence: int):
        self.sequence, self.prompt = sequence, -1  # prompt: its length, once known


class SuffixSource(LookupSource):
    """SuffixDecoding: each row's suffix trie, and one shared by the responses of rows that finished."""

    def __init__(self, settings: SuffixSettings = SuffixSettings()):
        self.cache = SuffixCache(settings)

    def open(self) -> _SuffixRow:
        return _SuffixRow(self.cache.open())

    def extend(self, row: _SuffixRow, tokens: list[int]) -> None:
        self.cache.extend(row.sequence, tokens)

    def prompt_read(self, row: _SuffixRow) -> None:
        row.prompt = len(self.cache.sequences[row.sequence])

    def propose(self, row: _SuffixRow, budget: Budget) -> Proposal:
        return self.cache.propose(row.sequence, budget)

    def finish(self, row: _SuffixRow) -> None:
        self.cache.finish(row.sequence, max(row.prompt, 0))


def source_for(settings: NgramSettings | SuffixSettings) -> LookupSource:
    """The source a kind's settings describe."""
    return NgramSource(settings) if isinstance(settings, NgramSettings) else SuffixSource(settings)


def padded_tree(roots: list[int], proposals: Sequence[Proposal], device: torch.device) -> DraftTree:
    """One tree per row (root first, then its proposal's nodes), padded to the largest with invalid nodes."""
    width = 1 + max((len(p) for p in proposals), default=0)
    bsz = len(roots)
    tokens = torch.zeros(bsz, width, dtype=torch.long)
    parents = torch.full((bsz, width), -1, dtype=torch.long)
    valid = torch.zeros(bsz, width, dtype=torch.bool)
    for b, (root, prop) in enumerate(zip(roots, proposals)):
        n = len(prop)
        tokens[b, 0], valid[b, : n + 1] = root, True
        if n:
            tokens[b, 1 : n + 1] = torch.tensor(prop.tokens)
            parents[b, 1 : n + 1] = torch.tensor(prop.parents) + 1  # the proposal's -1 (its root) is node 0
    return DraftTree.from_parents(tokens.to(device), parents.to(device), valid.to(device))


@dataclasses.dataclass
class ChoiceRecord:
    """One cycle's choice (a hybrid's, or a model-free draft's, whose every cycle is its lookup's tree alone): whether
    the lookup found a proposal, whether the lookup's tree went alone, the tokens per second each way promised (None:
    not yet measured), and, settled at the next draft, the seconds from the choice to it and the tokens the cycle
    committed (its accepted drafts and one more)."""

    matched: bool
    lookup_only: bool
    lookup_rate: float | None
    merged_rate: float | None
    started: float = dataclasses.field(default_factory=time.perf_counter)
    seconds: float | None = None
    tokens: float = 0.0

    def settle(self, now: float, tokens: float) -> None:
        self.seconds, self.tokens = now - self.started, tokens


def settle_last(choices: list[ChoiceRecord] | None, now: float, counts: torch.Tensor) -> None:
    """A drafter's next draft (or read) settles the last choice: its seconds until ``now``, the tokens ``counts``
    says its cycle committed."""
    if choices and choices[-1].seconds is None:
        choices[-1].settle(now, float(counts.float().mean()))


def drop_open(choices: list[ChoiceRecord] | None) -> None:
    """The batch ended before a next draft: its last choice has no outcome and goes."""
    if choices and choices[-1].seconds is None:
        choices.pop()


class LookupDrafter(Drafter):
    """Model-free drafting over any ``LookupSource``; ``tree`` (dynamic) bounds each row's proposal. Its sizing learns
    what each cycle's proposals got and cost; with ``size_by_cost`` it cuts them to what that promises to pay for.

    It takes no draws (``coupled_depth`` 0), only which rows sample: a sampled row accepts a node where its draw picks
    the node's token, a greedy row where the target's likeliest token is it, and the sizing learns the two apart
    (``Proposal.sampled``)."""

    couples_draws = True
    coupled_depth = 0
    # a benchmark's list (None: nothing kept): each cycle's estimated tokens a second, then what the cycle gave
    # (``ChoiceRecord``, every one a lookup-only cycle)
    choices: list[ChoiceRecord] | None = None

    def __init__(self, source: LookupSource, tree: Tree, size_by_cost: bool = False):
        self.source, self.sizing = source, ProposalSizing(cuts=size_by_cost)
        self.sampled_rows: list[bool] | None = None  # the next draft's rows that sample (None: every row greedy)
        self.rows: list[object] = []
        self.max_nodes = self.max_depth = 0
        self.read_at = 0.0  # when this cycle's tokens were read: the end of the last cycle, the start of this one
        self.set_tree(tree)

    @classmethod
    def of(cls, settings: NgramSettings | SuffixSettings, tree: Tree) -> "LookupDrafter":
        """The drafter a kind's settings describe."""
        return cls(source_for(settings), tree, settings.size_by_cost)

    def set_tree(self, tree: Tree) -> None:
        budget = lookup_budget(tree)
        self.tree, self.budget = tree, budget
        self.max_nodes, self.max_depth = max(self.max_nodes, budget.nodes + 1), max(self.max_depth, budget.depth)

    def couple_draws(self, coupling: DrawCoupling | None) -> None:
        self.sampled_rows = None if coupling is None else (coupling.inv_temperature > 0).tolist()

    def reset(self, batch: int, capacity: int) -> None:
        for row in self.rows:
            self.source.finish(row)
        self.rows = [self.source.open() for _ in range(batch)]
        self.sizing.forget_cycle()
        drop_open(self.choices)

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for i in sorted(set(range(len(self.rows))) - set(keep)):
            self.source.finish(self.rows[i])
        self.rows = [self.rows[i] for i in keep]
        self.sizing.forget_cycle()

    def add_rows(self, count: int, capacity: int) -> None:
        self.rows += [self.source.open() for _ in range(count)]
        self.sizing.forget_cycle()

    def join(self, features, tokens, counts, capacity, prefix: Sequence[Sequence[PrefixBlock]] | None = None) -> bool:
        """Read the joining rows' prompts now (all but each row's last pair, the first generated token)."""
        self.add_rows(counts.shape[0], capacity)
        fresh = self.rows[len(self.rows) - counts.shape[0] :]
        for row, toks, n in zip(fresh, tokens.tolist(), counts.tolist()):
            self.source.extend(row, toks[: n - 1])
            self.source.prompt_read(row)
        return True

    def read(self, tokens: torch.Tensor, counts: torch.Tensor) -> list[int]:
        """Append each row's new tokens to its sequence (the last sized cycle learns what it got); returns the roots
        (each row's last token)."""
        self.read_at = time.perf_counter()
        settle_last(self.choices, self.read_at, counts)
        rows = [toks[:n] for toks, n in zip(tokens.tolist(), counts.tolist())]
        self.sizing.settle(rows, self.read_at)
        for row, toks in zip(self.rows, rows):
            self.source.extend(row, toks)
        return [toks[-1] for toks in rows]

    def proposals(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[list[int], list[Proposal]]:
        """Each row's root and whole proposal (not sized)."""
        roots = self.read(tokens, counts)
        found = [self.source.propose(row, self.budget) for row in self.rows]
        sampled, self.sampled_rows = self.sampled_rows, None
        if sampled is None or len(sampled) != len(found):  # no coupling given for these rows: greedy ones
            sampled = [False] * len(found)
        for proposal, n, samples in zip(found, counts.tolist(), sampled):
            proposal.last_accepted, proposal.sampled = n - 1, samples
        return roots, found

    def sized(self, proposals: list[Proposal]) -> list[Proposal]:
        """``proposals`` as the sizing cuts them, remembered: what the cycle verifying them accepts and costs is learned
        at the next ``read``."""
        if self.choices is not None:
            matched = any(len(p) for p in proposals)
            self.choices.append(ChoiceRecord(matched, True, self.sizing.rate(proposals), None))
        proposals = self.sizing.cut(proposals)
        self.sizing.begin(proposals, self.read_at)
        return proposals

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        roots, proposals = self.proposals(tokens, counts)
        return padded_tree(roots, self.sized(proposals), tokens.device)


# How a hybrid ranks the two kinds of node under one budget: ``calibrated`` takes the head's path probability against
# the lookup node's chance of acceptance as verification has found it for nodes like it (its depth, its share of
# earlier occurrences, the match length, what the row's last cycle accepted: ``NodeCalibration``), both estimates of
# the chance the target emits the path; ``probability`` takes the lookup's raw share of earlier occurrences instead
# (a continuation seen once scores 1.0, above every head node, whatever such continuations are worth);
# ``lookup-first`` places every lookup node above every head node (its score + 1), the head's filling what is left.
MERGE_RULES = ("calibrated", "probability", "lookup-first")


def merged(head: Proposal, lookup: Proposal, nodes: int, rule: str = "probability") -> Proposal:
    """The union of two tries (a path both hold keeps the higher score), cut to the ``nodes`` best-scored nodes.
    Scores fall along every path in both, and so in their union, so the best nodes form a trie. (``calibrated``
    ranks as ``probability`` does, the lookup's scores calibrated first: ``HybridDrafter``.)"""
    if rule == "lookup-first":
        lookup = Proposal(lookup.tokens, lookup.parents, [1.0 + s for s in lookup.scores])
    elif rule not in ("probability", "calibrated"):
        raise ValueError(f"hybrid merge rule {rule!r}: expected one of {MERGE_RULES}")
    index: dict[tuple[int, int], int] = {}
    out = Proposal()
    for prop in (head, lookup):
        mine: list[int] = []
        for tok, parent, score in zip(prop.tokens, prop.parents, prop.scores):
            key = (-1 if parent < 0 else mine[parent], tok)
            if key in index:
                node = index[key]
                out.scores[node] = max(out.scores[node], score)
            else:
                node = index[key] = len(out)
                out.tokens.append(tok)
                out.parents.append(key[0])
                out.scores.append(score)
            mine.append(node)
    for i, parent in enumerate(out.parents):  # never above its parent (a draft's log-probability of ~1 rounds above 0)
        if parent >= 0 and out.scores[i] > out.scores[parent]:
            out.scores[i] = out.scores[parent]
    if len(out) <= nodes:
        return out
    # best first; a tie goes to the node added first (a parent before its child)
    return out.subset(sorted(sorted(range(len(out)), key=lambda i: (-out.scores[i], i))[:nodes]))


def verified_part(proposal: Proposal, tree: Proposal) -> Proposal:
    """The nodes of ``proposal`` whose paths ``tree`` holds (a merge keeps a prefix-closed part of each input)."""
    index: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    keep, at = [], {-1: -1}  # at: a proposal node -> the tree's node with its path
    for i, (parent, tok) in enumerate(zip(proposal.parents, proposal.tokens)):
        node = index.get((at[parent], tok)) if parent in at else None
        if node is not None:
            at[i] = node
            keep.append(i)
    return proposal.subset(keep)


def head_proposals(tree: DraftTree) -> list[Proposal]:
    """A head's scored tree per row (node 0, the root, left out; log-probabilities turned into probabilities)."""
    out = []
    for tokens, parents, valid, scores in zip(
        tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist(), tree.scores.exp().tolist()
    ):
        keep = [i for i in range(1, len(tokens)) if valid[i]]
        out.append(Proposal([tokens[i] for i in keep], [parents[i] - 1 for i in keep], [scores[i] for i in keep]))
    return out


class HybridDrafter(Drafter):
    """A head's dynamic tree and a lookup's proposal merged into one tree under the head's node budget, cut to the
    width that pays (``sized``); where the lookup alone promises more tokens per second (``lookup_suffices``), its
    tree alone, without the head's draft.

    A ``SourcedTree`` may ask for one part alone (a server's cost policy weighs the three): ``head`` drafts the head's
    tree as the head alone would (its whole-tree graph included), ``lookup`` the lookup's proposal without a draft
    forward. The lookup reads every cycle's tokens whichever part drafts; the pairs a lookup-only cycle verified wait
    for the head's next draft (as a plain cycle's do), so the head reads its context whole."""

    probe_gap = 16  # lookup-only cycles of a kind before a merged one of it (the gap doubles while the lookup leads)
    max_probe_gap = 64
    trial_window = 64  # pairs a merged cycle's head reads, on trial, of those lookup-only cycles left
    smoothing = 1 / 32  # the weight of each new measurement once 1 / its count is below it (``RunningMean``)
    prior_cycles = 8  # a kind's average of merged trees leans on its sampling's as much as on that many of its own
    couples_draws = True  # the head's part of a merged tree; the lookup proposes what the text holds
    # a benchmark's list (None: nothing kept): each choice with its two estimates, then what its cycle gave
    # (``ChoiceRecord``); the estimates are what the choice rests on, so set against the outcome they say where it errs
    choices: list[ChoiceRecord] | None = None

    def __init__(
        self, head: FeatureTreeDrafter, lookup: LookupDrafter, rule: str = "calibrated", lookup_alone: bool = True
    ):
        if rule not in MERGE_RULES:
            raise ValueError(f"hybrid merge rule {rule!r}: expected one of {MERGE_RULES}")
        self.head, self.lookup, self.rule = head, lookup, rule
        # whether a cycle may draft the lookup's tree alone (``lookup_suffices``); False merges in every cycle, which
        # measures what that choice is worth
        self.lookup_alone = lookup_alone
        self.feature_layers = head.feature_layers
        # merged trees' accepted tokens per cycle, per kind of cycle (``_kind``: whether the lookup found a proposal,
        # whether the rows sample): each is set against the lookup's estimate for its own kind of cycle; and their
        # seconds per cycle, one average over all kinds (the same head draft, the same node budget to verify)
        self.gains: dict[Kind, RunningMean] = {}
        self.sampled_gains: dict[bool, RunningMean] = {}  # greedy cycles', sampled cycles', found a match or not
        self.seconds = RunningMean(self.smoothing)
        self.widths = RunningMean(self.smoothing)  # the timed merged cycles' tree widths (root included), as timed
        self.sampled = False  # whether this cycle's rows sample (the draw coupling the loop hands over says so)
        self._since_merged = 0  # lookup-only cycles since the last merged one
        self._lookup_runs: dict[Kind, int] = {}  # per kind of cycle, lookup-only ones since its last merged one
        self.probe_gaps: dict[Kind, int] = {}  # per kind of cycle, its probe gap (``probe_gap`` until it grows)
        self._trial: tuple[DraftCheckpoint, DraftContext] | None = None  # a short reading to forget (``_end_trial``)
        self._tried = False  # the last cycle read on trial: a merged one now reads every pair
        # the last merged cycle's start, whether the head caught up, its kind, its tree's width (root included)
        self._last: tuple = (None, None, None, 0)
        self.max_nodes = self.max_depth = 0
        self.source = HYBRID
        self.unread: DraftContext | None = None  # per row, pairs the head has not read (after lookup-only cycles)
        self.set_tree(head.tree)

    @property
    def tree(self) -> Tree:
        return self.lookup.tree if self.source == LOOKUP else self.head.tree

    def set_tree(self, tree: Tree) -> None:
        """The tree of the next cycles, for the part its source names (a plain dynamic tree: both, merged)."""
        if not isinstance(tree, DynamicTreeConfig):
            raise ValueError(
                f"a hybrid draft merges dynamic trees (it ranks the head's nodes by their scores), not {tree}"
            )
        self.source = source_of(tree) or HYBRID
        plain = DynamicTreeConfig(tree.total_tokens, tree.depth, tree.top_k)  # what the part itself drafts
        (self.lookup if self.source == LOOKUP else self.head).set_tree(plain)
        self.max_nodes = max(self.max_nodes, self.head.max_nodes, self.lookup.max_nodes)
        self.max_depth = max(self.max_depth, self.head.max_depth, self.lookup.max_depth)

    def target_view(self, target):
        return self.head.target_view(target)

    def couple_draws(self, coupling: DrawCoupling | None) -> None:
        self.sampled = coupling is not None
        self.head.couple_draws(coupling)
        self.lookup.couple_draws(coupling)

    @property
    def coupled_depth(self) -> int:
        """The head's depth: the lookup's deeper nodes propose what the text holds, whatever the draws (on SmolLM2 the
        draws of 17 levels cost 4 ms a cycle, of the head's 3 levels 1 ms)."""
        return self.head.max_depth

    def reset(self, batch: int, capacity: int) -> None:
        self.head.reset(batch, capacity)
        self.lookup.reset(batch, capacity)
        self.unread, self._last, self._trial, self._tried = None, (None, None, None, 0), None, False
        drop_open(self.choices)

    def select_rows(self, rows: torch.Tensor) -> None:
        self._end_trial()
        self.head.select_rows(rows)
        self.lookup.select_rows(rows)
        if self.unread is not None:
            self.unread = self.unread.select_rows(rows)

    def add_rows(self, count: int, capacity: int) -> None:
        self._end_trial()
        self.head.add_rows(count, capacity)
        self.lookup.add_rows(count, capacity)
        self._add_unread_rows(count)

    def _add_unread_rows(self, count: int) -> None:
        if self.unread is not None:
            feats = self.unread.feats_buffer
            empty = DraftContext.of(
                feats.new_zeros(count, 0, feats.shape[-1]),
                self.unread.tokens_buffer.new_zeros(count, 0),
                self.unread.counts.new_zeros(count),
            )
            self.unread = self.unread.extend_rows(empty)

    def join(self, features, tokens, counts, capacity, prefix=None) -> bool:
        """Both read the joining prompts now when the head does; otherwise the lookup's prompt reading waits with
        the head's for the next draft (both then read every pending pair). While the lookup alone leads (the last
        cycles were its trees), the head does not read them now: they wait, like the pairs lookup-only cycles leave,
        for the head's next draft (a probe of merged trees, or the lookup losing the lead), which reads them under
        its bounded catch-up; a request the lookup serves to its end never pays for the head's reading."""
        self._end_trial()
        if self._lookup_leads():
            self.head.add_rows(counts.shape[0], capacity)
        elif self.head.join(features, tokens, counts, capacity, prefix):
            self._add_unread_rows(counts.shape[0])
            return self.lookup.join(features, tokens, counts, capacity)
        self.lookup.add_rows(counts.shape[0], capacity)
        self._add_unread_rows(counts.shape[0])
        return False

    def _lookup_leads(self) -> bool:
        return self.source == LOOKUP or (self.source == HYBRID and self._since_merged > 0)

    def bind(self, target_cache: KVCache) -> None:
        self.head.bind(target_cache)

    def owned_caches(self) -> list[KVCache]:
        return self.head.owned_caches()

    def checkpoint(self) -> DraftCheckpoint:
        return self.head.checkpoint()

    def restore(self, checkpoint: DraftCheckpoint) -> None:
        self.head.restore(checkpoint)

    def _head_context(self, features, tokens, counts):
        """The pairs the head reads now: those lookup-only cycles left, then this cycle's. The first merged cycle
        after lookup-only ones reads only the last ``trial_window`` of them, on trial: the next draft forgets that
        reading and finds them all unread again (``_end_trial``); a second merged cycle in a row reads them all. A
        merged cycle between lookup-only ones (a probe, or one proposal the lookup rated low) then costs a short
        reading, not a catch-up over the request so far (on SmolLM2's RAG prompts 27 catch-ups read 3,188 pairs in
        6 answers of 128 tokens, up to 512 each, 40-100 ms against a cycle of about 45); where merged trees go on
        leading, the head reads it all one cycle later. The short reading is not kept: read from the last 64 pairs
        alone, GRIFFIN accepted 1.99 tokens a cycle on code editing against 2.18."""
        if self.unread is None:
            self._tried = False
            return features, tokens, counts
        pending = self.unread.append(features, tokens, counts)
        self.unread = None
        if self._tried or pending.width <= self.trial_window:
            self._tried = False
            return pending.feats, pending.tokens, pending.counts
        self._trial = (self.head.checkpoint(), pending)
        feats, tokens, counts, dropped = recent_pairs(pending.feats, pending.tokens, pending.counts, self.trial_window)
        self.head.skipped = self.head.skipped + dropped
        return feats, tokens, counts

    def _end_trial(self) -> None:
        """Forget a short reading: the head back where it stood, every pair it skipped unread again."""
        if self._trial is not None:
            mark, self.unread = self._trial
            self._trial = None
            self.head.restore(mark)
            self._tried = True

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        started = time.perf_counter()
        self._credit(counts)
        settle_last(self.choices, started, counts)
        self._end_trial()
        if self.source == LOOKUP:
            return self._lookup_only(features, tokens, counts, *self.lookup.proposals(tokens, counts))
        if self.source == HEAD:
            self.lookup.read(tokens, counts)
            return self.head.draft(*self._head_context(features, tokens, counts))
        roots, found = self.lookup.proposals(tokens, counts)
        if self._lookup_alone(found):
            return self._lookup_only(features, tokens, counts, roots, found)
        catching_up = self.unread is not None
        heads = head_proposals(self.head.draft(*self._head_context(features, tokens, counts)))
        budget = self.head.tree.total_tokens - 1
        trees = self.sized(self.merge(heads, [self._ranked(f) for f in found], budget))
        self._last = (started, catching_up, self._kind(found), 1 + max((len(t) for t in trees), default=0))
        self.lookup.sizing.begin([verified_part(f, t) for f, t in zip(found, trees)], None, trees)
        return padded_tree(roots, trees, tokens.device)

    def merge(self, heads: list[Proposal], ranked: list[Proposal], nodes: int) -> list[Proposal]:
        """Each row's merged tree of ``nodes`` nodes under the drafter's rule (``ranked``: the lookup's proposals as
        ``_ranked`` scores them)."""
        return [merged(h, r, nodes, self.rule) for h, r in zip(heads, ranked)]

    def sized(self, trees: list[Proposal]) -> list[Proposal]:
        """The merged trees cut, best nodes first, to the width that promises the most tokens per second: under
        ``calibrated`` every node's score is its chance of acceptance (the head's path probability, the lookup node's
        calibrated chance), so the first k nodes promise the sum of theirs, against a merged cycle's time at that
        width (the merged cycles' measured time, moved along the lookup's measured cost of a node). One tree for all
        sets of prompts is too wide for some: on SmolLM2's chat prompts, under the tree (10, 4, 2), merged cycles
        cost 53 ms against 28.5 for lookup-only ones (plain decoding's step about as long) and accepted 1.0-1.2
        draft tokens; GRIFFIN alone paid there only with a chain of two. Nothing is cut before both costs are
        measured, nor under the other rules (their scores are not chances)."""
        if self.rule != "calibrated" or self.seconds.value is None or self.widths.value is None or not trees:
            return trees
        line = self.lookup.sizing.cost.line(len(trees))
        if line is None:
            return trees
        slope = line[1]
        base = self.seconds.value - slope * self.widths.value
        if base <= 0:
            return trees
        orders = [sorted(range(len(t)), key=lambda i: (-t.scores[i], i)) for t in trees]
        sums = [
            list(itertools.accumulate((tree.scores[i] for i in order), initial=0.0))
            for tree, order in zip(trees, orders)
        ]
        nodes = best_width(sums, base, slope)[0] - 1
        if nodes >= max(len(order) for order in orders):
            return trees
        return [tree.subset(sorted(order[:nodes])) for tree, order in zip(trees, orders)]

    def _ranked(self, found: Proposal) -> Proposal:
        """The lookup's proposal as the merge ranks it: under ``calibrated``, each node scored by its chance of
        acceptance as the lookup's sizing has measured it, scaled by its ``trust`` (before any measurement, its own
        score)."""
        if self.rule != "calibrated" or not len(found):
            return found
        chances = self.lookup.sizing.chances(found)
        return dataclasses.replace(found, scores=chances)

    def _lookup_only(self, features, tokens, counts, roots, found) -> DraftTree:
        """The lookup's trees alone (as its sizing cuts them); this cycle's pairs wait for the head's next draft."""
        if self.unread is None:
            self.unread = DraftContext.of(features[:, :0], tokens[:, :0], torch.zeros_like(counts))
        self.unread = self.unread.append(features, tokens, counts)
        self._tried = False  # the next merged cycle reads on trial again
        return padded_tree(roots, self.lookup.sized(found), tokens.device)

    def _lookup_alone(self, found: list[Proposal]) -> bool:
        """This cycle's choice (``lookup_suffices``), counted per kind of cycle for its probes."""
        kind = self._kind(found)
        alone = self.lookup_suffices(found)
        if self.choices is not None:
            merged = None
            if kind in self.gains and self.seconds.value:
                merged = (1 + self.merged_gain(kind, found)) / self.seconds.value
            self.choices.append(ChoiceRecord(kind[0], alone, self.lookup.sizing.rate(found), merged))
        if alone:
            self._since_merged += 1
            self._lookup_runs[kind] = self._lookup_runs.get(kind, 0) + 1
        else:
            self._since_merged = self._lookup_runs[kind] = 0
        return alone

    def _kind(self, found: list[Proposal]) -> Kind:
        """A cycle's kind: whether the lookup found a proposal, and whether the rows sample. A sampled cycle accepts a
        lookup's node only where the draw picks its token, while the head's guesses follow the draws (``couple_draws``):
        on SmolLM2 at T=0.7 merged trees without a match accepted 0.7 tokens a cycle against 1.0-1.2 greedy, and one
        average over both took the one for the other."""
        return self._matched(found), self.sampled

    @staticmethod
    def _matched(found: list[Proposal]) -> bool:
        """Whether this cycle's lookup found a proposal (for most of the rows)."""
        return 2 * sum(1 for f in found if len(f)) >= max(len(found), 1)

    def lookup_suffices(self, found: list[Proposal]) -> bool:
        """Whether the lookup's trees alone promise more tokens per second than merged trees have been giving in
        cycles like this one: the lookup's sizing's estimate (its nodes' acceptance as verification has found it,
        scaled by its measured ``trust``, over the measured time of a lookup-only cycle that wide) against the merged
        trees' accepted tokens per cycle in cycles of its kind (``_kind``: with a proposal or none, greedy or
        sampled), over a merged cycle's time. (One average over cycles with and without a proposal would set one
        without, where a merged tree is the head's alone, against what merged trees gave while the lookup was
        copying.) A cycle's time runs from one draft to the next (the draft, its verification, what the loop does
        beside); a lookup-only cycle without a proposal is plain decoding, so a head slower than plain decoding loses
        to it. What is not measured yet is tried first: merged trees, then
        lookup-only trees; and after ``probe_gap`` lookup-only cycles of a kind a merged one of that kind, whose
        estimate would otherwise never change again once it lost (a head's acceptance follows the text). Each probe
        that the lookup goes on winning doubles that kind's gap (up to ``max_probe_gap``): a probe pays the head's
        reading of the pairs it skipped (its last ``trial_window``, on trial: ``_head_context``), and its time is
        not a cycle's. A merged cycle's time is one average over
        all kinds: timed per kind, the kind the lookup led in kept its first, slow measurements (a probe is never
        timed), and on SmolLM2's chat prompts merged trees in cycles with a match stayed half as slow again as in the
        others, so the lookup won nearly every such cycle on that alone."""
        kind = self._kind(found)
        if not self.lookup_alone or kind not in self.gains or self.seconds.value is None:
            return False
        gap = self.probe_gaps.get(kind, self.probe_gap)
        if self._lookup_runs.get(kind, 0) >= gap:
            self.probe_gaps[kind] = min(2 * gap, self.max_probe_gap)
            return False
        lookup_rate = self.lookup.sizing.rate(found)
        if lookup_rate is None or lookup_rate >= (1 + self.merged_gain(kind, found)) / self.seconds.value:
            return True
        self.probe_gaps[kind] = self.probe_gap  # merged trees lead: probe the lookup's lead soon again if it returns
        return False

    def merged_gain(self, kind: Kind, found: list[Proposal]) -> float:
        """The accepted tokens a merged tree promises this cycle: what merged trees gave in cycles of its kind, leaning
        on what they gave in all cycles greedy or sampled as this one while its own are few (``prior_cycles``), and at
        least what the lookup's best nodes that fit its budget promise (the merge ranks them by the same chances, and
        keeps a head's node before one only where the head's probability, which is calibrated, is the higher). A
        kind's average holds few cycles where the lookup leads (one probe in ``probe_gap``), and an estimate that
        loses is measured again only at the next probe: on SmolLM2's chat prompts four probes that accepted nothing
        had set merged trees in cycles with a match at 0.0, where merged every cycle they accepted 1.78 (and 0.98
        without a match)."""
        own = self.gains[kind]
        weight = min(own.count, 1 / self.smoothing)
        pooled = self.sampled_gains[kind[1]].value
        average = (weight * own.value + self.prior_cycles * pooled) / (weight + self.prior_cycles)
        nodes = self.head.tree.total_tokens - 1
        promised = sum(self.lookup.sizing.promised(f, nodes) for f in found) / max(len(found), 1)
        return max(average, promised)

    def _credit(self, counts: torch.Tensor) -> None:
        """What the last merged cycle accepted per row (each row's pending pairs less its root) and how long it took
        (a lookup-only cycle's go to the lookup's sizing). A merged cycle whose head also read the pairs lookup-only
        cycles left counts its acceptance, not its time; a gap far longer than the cycles so far (a new batch's
        prefill between them) is not a cycle's time."""
        started, catching_up, kind, width = self._last
        self._last = (None, None, None, 0)
        if started is None:
            return
        seconds = time.perf_counter() - started
        known = self.seconds.value
        if not catching_up and (known is None or seconds < 3 * known):
            self.seconds.add(seconds)
            self.widths.add(width)
        accepted = float((counts - 1).float().mean())
        self.gains.setdefault(kind, RunningMean(self.smoothing)).add(accepted)
        self.sampled_gains.setdefault(kind[1], RunningMean(self.smoothing)).add(accepted)
