"""The generation loop: prefill, draft, verify, accept, compact, repeat; one code path for all drafts.

Plain autoregressive decoding is the same loop with ``NoDrafter`` (a tree of one node), so baseline
and speculative numbers measure the same machinery. Sequences of different lengths share a batch
from the start; finished ones leave it between cycles.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdec_kit.runtime.core.argmax import argmax_last
from specdec_kit.runtime.core.contract import TargetOutput, TargetStep
from specdec_kit.runtime.core.coupling import DrawCoupling, draw_coupling
from specdec_kit.runtime.core.device import now, torch_threads
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.core.sampling import SamplingParams, request_seed, sampled_tokens
from specdec_kit.runtime.core.verify import Verdict, verify_batch
from specdec_kit.runtime.decoding.draft_context import DraftContext
from specdec_kit.runtime.decoding.drafting import Drafter, DraftTree, NoDrafter, Tree
from specdec_kit.runtime.decoding.prefix_cache import PrefixBlock, PrefixCache, joined
from specdec_kit.runtime.decoding.width_cut import WidthCut

logger = logging.getLogger(__name__)

STOP_EDGE_CHARS = 8  # characters a decoding window's first tokens may render differently from the whole text


def stop_may_end_in_tail(
    decode: Callable[[list[int]], str], tokens: list[int], appended: int, stops: Sequence[str]
) -> bool:
    """Whether a stop string may have appeared with the last ``appended`` tokens, decoding only the tail: the text
    before held none, so a new one ends in those tokens and starts at most the longest stop string's length
    earlier. The window reaches back until its earlier tokens give that many characters plus a margin for what a
    window's edge renders differently (a split multi-byte character, a stripped leading space), so the check
    costs the same at every output length; a hit is to be confirmed on the whole text."""
    need = max(len(s) for s in stops) + STOP_EDGE_CHARS
    earlier = need  # tokens before the new ones inside the window: about a character each
    while True:
        start = max(0, len(tokens) - appended - earlier)
        if start == 0 or len(decode(tokens[start : len(tokens) - appended])) >= need:
            tail = decode(tokens[start:])
            return any(s and s in tail for s in stops)
        earlier *= 2


def places_after_leaving(staying: Sequence[bool]) -> list[int]:
    """The rows that stay, in their new order: each keeps its place unless it sits past the end of the smaller
    batch, whence it fills a leaver's place (first places first)."""
    count = sum(staying)
    holes = [j for j in range(count) if not staying[j]]
    movers = [j for j in range(count, len(staying)) if staying[j]]
    order = list(range(count))
    for hole, mover in zip(holes, movers):
        order[hole] = mover
    return order


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cycles: int = 0
    spec_cycles: int = 0  # cycles that drafted (the rest verified the root alone: speculation was off)
    draft_tokens: int = 0  # draft nodes sent to verification (tree size - 1, summed over cycles)
    accepted_tokens: int = 0  # accepted draft tokens, summed over cycles
    accepted_per_depth: list[int] = field(default_factory=list)  # [d-1]: cycles accepting depth d
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: mean over cycles of accepted draft tokens + 1."""
        return (self.accepted_tokens + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_s_per_token(self) -> float:
        """Seconds per generated token in the decoding phase alone (the prompt's prefill left out)."""
        return (self.total_s - self.prefill_s) / max(self.generated_tokens, 1)

    @classmethod
    def combined(cls, stats: Sequence["RequestStats"]) -> "RequestStats":
        """Counts and times summed over requests (so ``acceptance_length`` is their pooled tau)."""
        out = cls()
        for st in stats:
            for name in (
                "prompt_tokens",
                "cached_tokens",
                "generated_tokens",
                "cycles",
                "spec_cycles",
                "draft_tokens",
                "accepted_tokens",
                "prefill_s",
                "draft_s",
                "verify_s",
                "total_s",
            ):
                setattr(out, name, getattr(out, name) + getattr(st, name))
            width = max(len(out.accepted_per_depth), len(st.accepted_per_depth))
            mine = out.accepted_per_depth + [0] * (width - len(out.accepted_per_depth))
            theirs = st.accepted_per_depth + [0] * (width - len(st.accepted_per_depth))
            out.accepted_per_depth = [a + b for a, b in zip(mine, theirs)]
        return out


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: RequestStats
    text: str | None = None


@dataclass
class CycleOutcome:
    """What one cycle did over the whole batch (the server's metrics and speculation policy read it)."""

    speculative: bool  # whether it drafted (else it verified each row's root alone)
    rows: int
    emitted: int  # tokens appended to the rows (accepted draft tokens + one from the target per row, cut at stops)
    draft_tokens: int  # draft nodes sent to verification, summed over rows
    accepted_tokens: int  # accepted draft tokens, summed over rows
    accepted_per_depth: list[int]  # [d-1]: rows whose accepted path reached depth d
    draft_s: float
    verify_s: float
    caught_up: bool = False  # the draft also read context that plain cycles or a prefill left: not one step's time
    joined: int = 0  # rows whose prompts the cycle's target call also read (they joined after it): not a step's time
    tree_width: int | None = None  # nodes per row verified (a model-free draft's trees vary from cycle to cycle)


@dataclass
class TreeResult:
    """A verified tree per row: the accepted path (node indices, root first; ``counts`` of them are real), the
    target's next token after it, and the path's tokens and target features."""

    path: torch.Tensor  # [B, A]
    counts: torch.Tensor  # [B]
    next_tokens: torch.Tensor  # [B]
    path_tokens: torch.Tensor  # [B, A]
    features: torch.Tensor  # [B, A, d]


@dataclass
class _Row:
    params: SamplingParams
    seed: int | None  # what the row's draws are keyed by (None: greedy)
    max_new: int
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    start: float = 0.0
    tag: object = None  # the caller's handle (the server's request)
    error: Exception | None = None  # why the row failed (finish "error"); the other rows go on


@dataclass
class DecodeBatch:
    """A running batch between cycles: its rows (in cache order), the target cache, and each row's draft
    context (target features of the newly verified positions paired with the tokens that follow them;
    the last real pair's token is the root of the next tree). Rows join through ``admit`` and leave
    through ``retire`` between cycles: continuous batching."""

    rows: list[_Row]
    cache: KVCache
    context: DraftContext
    prefix: list[list[PrefixBlock]] | None = None  # fresh from ``prefill``: each row's prompt blocks in the cache

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def ctx_feats(self) -> torch.Tensor:  # [B, W, d]
        return self.context.feats

    @property
    def ctx_tokens(self) -> torch.Tensor:  # [B, W]
        return self.context.tokens

    @property
    def ctx_counts(self) -> torch.Tensor:  # [B]
        return self.context.counts


@dataclass
class Prompts:
    """Prompts on their way into a batch, prepared before the target call that reads them: their rows, the prompts
    padded to one width (``whole`` [n, W]) with their lengths, and each one's prompt blocks found in the prefix cache
    (``chains``, ``cached`` tokens) that need no computing."""

    rows: list[_Row]
    prompts: Sequence[Sequence[int]]
    whole: torch.Tensor
    counts: torch.Tensor
    chains: list[list[PrefixBlock]]
    cached: list[int]
    capacity: int  # cache slots a row needs: the longest prompt and budget, and a tree's pending slots
    first_tokens: Sequence[int | None] | None = None

    @property
    def fresh(self) -> torch.Tensor:
        """[n] prompt tokens each row computes (past its cached blocks)."""
        return self.counts - torch.tensor(self.cached, dtype=torch.long, device=self.counts.device)


def _with_glue_threads(method: Callable) -> Callable:
    """``method`` run with torch's threads at the target's ``glue_threads`` (restored after)."""

    @functools.wraps(method)
    def wrapped(self: "SpeculativeGenerator", *args, **kwargs):
        with torch_threads(self.glue_threads):
            return method(self, *args, **kwargs)

    return wrapped


class SpeculativeGenerator:
    """Batched speculative (or plain) generation over a ``TargetStep`` (PyTorch or ONNX Runtime) and a
    ``Drafter``; continuous batching drives its stages (``prefill``, ``admit``, ``cycle``, ``retire``)."""

    def __init__(
        self,
        target: TargetStep,
        drafter: Drafter | None = None,
        eos_token_ids: Sequence[int] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        prefix_cache: PrefixCache | None = None,
        width_cut: WidthCut | None = None,
    ):
        self.drafter = drafter or NoDrafter()
        self.width_cut = width_cut  # each cycle's tree cut to the width its chances pay for (``width_cut.py``)
        self.prefix_cache = prefix_cache  # prompts' cached blocks skip the prefill
        self.target = self.drafter.target_view(target)  # EAGLE-3 drafters read tapped layers
        self.glue_threads = target.glue_threads
        self.eos = set(target.eos_token_ids() if eos_token_ids is None else eos_token_ids)
        self.decode = decode
        self.target_forward_s = 0.0  # cumulative time inside target forwards (overhead accounting)
        self._plain = NoDrafter()

    def cache_prefixes(self, mib: float) -> None:
        """Keep prompts' KV blocks (up to ``mib``) so a later prompt with the same start skips their prefill; sized
        for the target view this generator runs (EAGLE-3's reads tapped layers)."""
        self.prefix_cache = PrefixCache.within(self.target, mib)

    def set_tree(self, tree: Tree) -> None:
        """The tree the next cycles draft (the drafter checks it is one it can draft)."""
        self.drafter.set_tree(tree)

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def fail_row(row: _Row, exc: Exception) -> None:
        """Finish one row with an error; it leaves at the next ``retire`` and the batch goes on without it."""
        logger.error("row %r failed: %s: %s", row.tag, type(exc).__name__, exc, exc_info=exc)
        row.finish, row.error = "error", exc

    def _emit_guarded(self, row: _Row, new_tokens: list[int]) -> None:
        """``_emit`` for one row; what goes wrong in one row's stop strings or decoding fails that row alone."""
        if row.finish is not None:
            return
        try:
            self._emit(row, new_tokens)
        except Exception as exc:  # noqa: BLE001 - isolate the row, whatever it was
            self.fail_row(row, exc)

    def _emit(self, row: _Row, new_tokens: list[int]) -> None:
        """Append a cycle's tokens, cutting at EOS, the token budget or a stop string."""
        before = len(row.tokens)
        for tok in new_tokens:
            row.tokens.append(tok)
            if tok in self.eos and not row.ignore_eos:
                row.finish = "stop"
                break
            if len(row.tokens) >= row.max_new:
                row.finish = "length"
                break
        appended = len(row.tokens) - before
        if row.stop and self.decode is not None and stop_may_end_in_tail(self.decode, row.tokens, appended, row.stop):
            text = self.decode(row.tokens)
            hits = [(text.find(s), s) for s in row.stop if s and s in text]
            if hits:
                cut, stop = min(hits)
                # the shortest token prefix whose text contains the stop string (the text before this cycle held none)
                for n in range(before + 1, len(row.tokens) + 1):
                    if stop in self.decode(row.tokens[:n]):
                        row.tokens = row.tokens[:n]
                        break
                row.text, row.finish = text[:cut], "stop"

    def uncached_tokens(self, prompt: Sequence[int]) -> int:
        """The prompt tokens a prefill of ``prompt`` would compute: those past its blocks in the prefix cache."""
        return len(prompt) - (self.prefix_cache.cached_length(prompt) if self.prefix_cache is not None else 0)

    def validate(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int]) -> None:
        for i, (p, m) in enumerate(zip(prompts, budgets)):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if m < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {m} for prompt {i}")
            if len(p) + m > self.target.max_context:
                raise ValueError(
                    f"prompt {i}: {len(p)} prompt tokens + {m} new tokens exceed the target's context of {self.target.max_context}"
                )

    # -- the stages of continuous batching ----------------------------------------------------
    def prepare(
        self,
        prompts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        params: Sequence[SamplingParams],
        stops: Sequence[Sequence[str]] | None = None,
        tags: Sequence[object] | None = None,
        ignore_eos: Sequence[bool] | None = None,
        first_tokens: Sequence[int | None] | None = None,
    ) -> Prompts:
        """Check new prompts and make their rows, and find their cached prompt blocks: what ``prefill`` or a cycle
        that takes them in (``cycle(..., joining=)``) computes from. ``stops`` and ``tags`` (the caller's handles)
        are per prompt; a row's ``first_tokens`` entry, when given, is its first token instead of the target's choice
        (a session resumed after its first token was chosen)."""
        bsz = len(prompts)
        stops = stops or [()] * bsz
        if any(stops) and self.decode is None:
            raise ValueError("stop strings need a decode function (a tokenizer)")
        self.validate(prompts, budgets)
        dev = self.target.device
        rows = [
            _Row(
                p,
                request_seed(p),
                m,
                tuple(st),
                ignore_eos=bool(ignore_eos and ignore_eos[i]),
                tag=(tags[i] if tags else None),
            )
            for i, (p, m, st) in enumerate(zip(params, budgets, stops))
        ]
        lens = [len(p) for p in prompts]
        chains = [self.prefix_cache.match(p) for p in prompts] if self.prefix_cache else [[] for _ in prompts]
        cached = [sum(block.keys.shape[2] for block in chain) for chain in chains]
        for row, n, hit in zip(rows, lens, cached):
            row.stats.prompt_tokens, row.stats.cached_tokens = n, hit
        whole = torch.zeros(bsz, max(lens), dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            whole[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        counts = torch.tensor(lens, dtype=torch.long, device=dev)
        capacity = max(lens) + max(budgets) + self.drafter.max_nodes + 2
        return Prompts(rows, prompts, whole, counts, chains, cached, capacity, first_tokens)

    @_with_glue_threads
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], *args, **kwargs) -> DecodeBatch:
        """Run new prompts through the target on a cache of their own and pick each first token; the result is a
        batch of its own, ready to run or to ``admit`` into a running one. Takes ``prepare``'s arguments."""
        ready = self.prepare(prompts, *args, **kwargs)
        start = now(self.target.device)
        cache = self.target.new_cache(len(ready.rows), ready.capacity)
        out, feats = self._prompt_forward(ready, cache)
        return self._started(ready, cache, 0, out.logits[:, 0], feats, start)

    def _started(
        self, ready: Prompts, cache: KVCache, first_row: int, logits: torch.Tensor, feats: torch.Tensor, start: float
    ) -> DecodeBatch:
        """Prompts the target has read (their rows from ``first_row`` on in ``cache``; ``logits`` [n, V] at each
        one's last token, ``feats`` [n, W, F] at every prompt position): their blocks kept in the prefix cache, each
        row's first token chosen and emitted; a batch of these rows over ``cache``."""
        rows, whole, counts, dev = ready.rows, ready.whole, ready.counts, self.target.device
        chains = ready.chains
        if self.prefix_cache is not None:
            chains = [
                self.prefix_cache.store(p, cache.keys[:, first_row + b], cache.values[:, first_row + b], feats[b])
                for b, p in enumerate(ready.prompts)
            ]
        first = argmax_last(logits)
        for b, row in enumerate(rows):
            if ready.first_tokens is not None and ready.first_tokens[b] is not None:
                first[b] = ready.first_tokens[b]
            elif not row.params.greedy:
                try:
                    first[b] = sampled_tokens(logits[b : b + 1], row.params, row.seed, [0])[0]
                except Exception as exc:  # noqa: BLE001 - one row's sampling fails that row alone
                    self.fail_row(row, exc)
        ctx_tokens = torch.cat([whole[:, 1:], torch.zeros_like(whole[:, :1])], dim=1)
        ctx_tokens.scatter_(1, (counts - 1)[:, None], first[:, None])
        prefill_s = now(dev) - start
        first_list = first.tolist()
        for b, row in enumerate(rows):
            row.start = start
            row.stats.prefill_s = prefill_s
            self._emit_guarded(row, [first_list[b]])
        return DecodeBatch(
            rows, cache, DraftContext.of(feats, ctx_tokens, counts), chains if self.prefix_cache is not None else None
        )

    @staticmethod
    def _uncached_inputs(ready: Prompts, cache: KVCache, first_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prompt's cached blocks loaded into its row of ``cache`` (rows ``first_row`` on); returns the places
        and the tokens [n, W'] of what is left to compute (a prompt's padding repeats places inside it)."""
        for b, chain in enumerate(ready.chains):
            if chain:
                cache.load_prefix(first_row + b, *joined(chain))
        done = torch.tensor(ready.cached, dtype=torch.long, device=ready.whole.device)
        ar = torch.arange(int(ready.fresh.max()), device=done.device)
        ahead = (done[:, None] + ar[None, :]).clamp(max=ready.whole.shape[1] - 1)
        return ahead, torch.gather(ready.whole, 1, ahead)

    def _prompt_forward(self, ready: Prompts, cache: KVCache) -> tuple[TargetOutput, torch.Tensor]:
        """The target over each prompt after its cached blocks, on ``cache`` (a row per prompt); returns the
        forward's output (logits at each prompt's last token) and every prompt position's features."""
        ahead, tokens = self._uncached_inputs(ready, cache, 0)
        bsz, width = tokens.shape
        fresh, dev = ready.fresh, tokens.device
        ar = torch.arange(width, device=dev)
        t0 = now(dev)
        out = self.target(
            tokens, ahead, (ar[None, :] <= ar[:, None]).expand(bsz, width, width), cache, logits_at=(fresh - 1)[:, None]
        )
        self.target_forward_s += now(dev) - t0
        cache.commit(ar.expand(bsz, width), fresh)
        return out, self._prompt_features(out.features, ready)

    @staticmethod
    def _prompt_features(computed: torch.Tensor, ready: Prompts) -> torch.Tensor:
        """Every prompt position's features [n, W, F]: those of its cached blocks, then ``computed`` [n, W', F] (the
        target's at its uncached positions)."""
        if not any(ready.cached):
            return computed
        whole, counts = ready.whole, ready.counts.tolist()
        feats = computed.new_zeros(whole.shape[0], whole.shape[1], computed.shape[-1])
        for b, chain in enumerate(ready.chains):
            n, hit = counts[b], ready.cached[b]
            if chain:
                feats[b, :hit] = torch.cat([block.features for block in chain])
            feats[b, hit:n] = computed[b, : n - hit]
        return feats

    @_with_glue_threads
    @torch.inference_mode()
    def admit(self, running: DecodeBatch | None, new: DecodeBatch) -> DecodeBatch:
        """Join ``new`` rows (fresh from ``prefill``) to the running batch between cycles (or start one)."""
        starting = running is None or running.size == 0
        if starting:
            self.drafter.reset(0, new.cache.capacity)
        pending = self._draft_joins(new, new.cache.capacity)
        if starting:
            self.drafter.bind(new.cache)
            new.context = pending
            return new
        running.cache.extend_rows(new.cache)
        self._append_rows(running, new, pending)
        return running

    def _draft_joins(self, new: DecodeBatch, capacity: int) -> DraftContext:
        """The drafter takes in joining rows; returns the context they still owe it (see ``Drafter.join``)."""
        pending = new.context
        if self.drafter.join(pending.feats, pending.tokens, pending.counts, capacity, new.prefix):
            pending = pending.last_pairs()
        new.prefix = None  # read: the blocks are the prefix cache's again
        return pending

    @staticmethod
    def _append_rows(running: DecodeBatch, new: DecodeBatch, pending: DraftContext) -> None:
        running.context = running.context.extend_rows(pending)
        running.rows.extend(new.rows)

    @torch.inference_mode()
    def retire(self, batch: DecodeBatch) -> list[_Row]:
        """Drop finished (or cancelled) rows from the batch and its caches; returns them. Rows from the end of the
        batch take the places of those that left (the caches move as many rows as left, not all after them)."""
        keep = places_after_leaving([row.finish is None for row in batch.rows])
        if len(keep) == batch.size:
            return []
        done = [row for row in batch.rows if row.finish is not None]
        end = now(self.target.device)
        for row in done:
            row.stats.generated_tokens = len(row.tokens)
            row.stats.total_s = row.stats.total_s or (end - row.start)
        if keep:
            sel = torch.tensor(keep, dtype=torch.long, device=self.target.device)
            batch.cache.select_rows(sel)
            self.drafter.select_rows(sel)
            batch.context = batch.context.select_rows(sel)
        batch.rows = [batch.rows[j] for j in keep]
        return done

    @torch.inference_mode()
    def verify_tree(self, batch: DecodeBatch, tree: DraftTree) -> TreeResult:
        """Run one tree per row through the target over the batch's cache, verify it (greedy, or lossless
        sampling keyed by each row's seed) and commit each accepted path into the cache."""
        cache, dev = batch.cache, self.target.device
        t0 = now(dev)
        out = self.target(tree.tokens, cache.lengths[:, None] + tree.depth, tree.tree_mask, cache)
        self.target_forward_s += now(dev) - t0
        verdict = self._verdict(batch, tree, out.logits)
        cache.commit(verdict.path, verdict.counts)
        return self._tree_result(tree, verdict, out.features)

    def _verdict(self, batch: DecodeBatch, tree: DraftTree, logits: torch.Tensor) -> Verdict:
        """Each row's accepted path through its tree, from the target's ``logits`` [B, N, V] at the nodes."""
        return verify_batch(
            tree.tokens,
            tree.parents,
            tree.valid,
            tree.depth,
            tree.tree_mask,
            logits,
            [row.params for row in batch.rows],
            [row.seed for row in batch.rows],
            self._next_indices(batch),
        )

    @staticmethod
    def _tree_result(tree: DraftTree, verdict: Verdict, features: torch.Tensor) -> TreeResult:
        feat_idx = verdict.path[..., None].expand(-1, -1, features.shape[-1])
        return TreeResult(
            verdict.path,
            verdict.counts,
            verdict.next_tokens,
            torch.gather(tree.tokens, 1, verdict.path),
            torch.gather(features, 1, feat_idx),
        )

    @staticmethod
    def _next_indices(batch: DecodeBatch) -> list[int]:
        """Per row, the generated index of the token that follows the root: the committed tokens past the
        prompt, plus the root (what a caller keeps in ``row.tokens`` does not matter)."""
        if all(row.params.greedy for row in batch.rows):
            return [0] * batch.size
        lengths = batch.cache.lengths.tolist()
        return [n - row.stats.prompt_tokens + 1 for n, row in zip(lengths, batch.rows)]

    def _draw_coupling(self, batch: DecodeBatch) -> DrawCoupling | None:
        """The draws this cycle's tree guesses, level by level (None when every row is greedy)."""
        rows = batch.rows
        return draw_coupling(
            [row.params for row in rows],
            [row.seed for row in rows],
            self._next_indices(batch),
            self.drafter.coupled_depth,
            self.target.vocab_size,
            self.target.device,
        )

    @_with_glue_threads
    @torch.inference_mode()
    def cycle(self, batch: DecodeBatch, speculate: bool = True, joining: Prompts | None = None) -> CycleOutcome:
        """One draft-verify-accept cycle over every row. ``speculate=False`` verifies the root alone
        (plain decoding) and keeps the draft context for the next speculative cycle. ``joining`` (from ``prepare``):
        prompts the same target call reads beside the batch's trees; their rows join the batch after it, each with
        its first token (``outcome.joined``). Should that call fail, the trees are verified alone and the prompts are
        handed back unread (``outcome.joined`` 0), for the caller to prefill on their own."""
        dev = self.target.device
        drafted = speculate and not isinstance(self.drafter, NoDrafter)
        # after a speculative cycle each row's context is its accepted path, at most the tree's depth plus the root
        caught_up = drafted and batch.context.width > self.drafter.max_depth + 1
        t0 = now(dev)
        if drafted and self.drafter.couples_draws:
            self.drafter.couple_draws(self._draw_coupling(batch))
        tree = (self.drafter if drafted else self._plain).draft(batch.ctx_feats, batch.ctx_tokens, batch.ctx_counts)
        cut = drafted and self.width_cut is not None
        if cut:
            tree = self.width_cut.cut(tree, sampled=not all(row.params.greedy for row in batch.rows))
        t1 = now(dev)
        out = started = None
        if joining is not None:
            try:
                out = self._forward_with_prompts(batch, tree, joining)
            except Exception as exc:  # noqa: BLE001 - the prompts go their own way; the trees are verified alone
                logger.warning(
                    "a cycle's target call could not read %d joining prompts (%s: %s); verifying without them",
                    len(joining.rows),
                    type(exc).__name__,
                    exc,
                )
                batch.cache.select_rows(torch.arange(batch.size, device=dev))
        if out is None:
            result = self.verify_tree(batch, tree)
        else:
            result, started = self._verify_with_prompts(batch, tree, joining, out, t1)
        t2 = now(dev)
        self._next_context(batch, result, replace=drafted or isinstance(self.drafter, NoDrafter))
        outcome = self._account(batch.rows, tree, result, drafted, t1 - t0, t2 - t1, t2)
        outcome.caught_up, outcome.tree_width = caught_up, tree.tokens.shape[1]
        if cut and started is None:  # a call that also read prompts is not a cycle's time
            self.width_cut.observe(
                batch.size, tree.tokens.shape[1], now(dev) - t0, outcome.accepted_tokens / batch.size
            )
        if started is not None:
            self._append_rows(batch, started, self._draft_joins(started, batch.cache.capacity))
            outcome.joined = started.size
        return outcome

    def _forward_with_prompts(self, batch: DecodeBatch, tree: DraftTree, joining: Prompts) -> TargetOutput:
        """One target call over the batch's trees and the joining prompts: their rows are added to the batch's cache
        (cached blocks loaded) and every row padded to the wider of the tree and the prompts' uncached tokens (a
        tree's padding sees the tree and itself, a prompt's padding what comes before it); logits at the trees'
        nodes and at each prompt's last token. Nothing is committed yet."""
        cache, dev = batch.cache, self.target.device
        rows, nodes = tree.tokens.shape
        joins = len(joining.rows)
        cache.extend_rows(self.target.new_cache(joins, max(cache.capacity, joining.capacity)))
        ahead, prompt_tokens = self._uncached_inputs(joining, cache, rows)
        fresh, width = joining.fresh, ahead.shape[1]
        span = max(nodes, width)
        ar = torch.arange(span, device=dev)
        tokens = torch.zeros(rows + joins, span, dtype=torch.long, device=dev)
        tokens[:rows, :nodes] = tree.tokens
        tokens[rows:, :width] = prompt_tokens
        positions = (cache.lengths[:, None] + ar[None, :]).clamp(max=self.target.max_context - 1)
        positions[:rows, :nodes] = cache.lengths[:rows, None] + tree.depth
        positions[rows:, :width] = ahead
        mask = (ar[None, :] <= ar[:, None]).expand(rows + joins, span, span).clone()
        mask[:rows, :nodes, :nodes] = tree.tree_mask
        logits_at = torch.cat([ar[:nodes].expand(rows, nodes), (fresh - 1)[:, None].expand(joins, nodes)])
        t0 = now(dev)
        out = self.target(tokens, positions, mask, cache, logits_at=logits_at)
        self.target_forward_s += now(dev) - t0
        return out

    def _verify_with_prompts(
        self, batch: DecodeBatch, tree: DraftTree, joining: Prompts, out: TargetOutput, start: float
    ) -> tuple[TreeResult, DecodeBatch]:
        """``verify_tree`` for a call that also read joining prompts (``_forward_with_prompts``): the trees' accepted
        paths and the prompts are committed at once. Returns the trees' result and the joining rows as a batch over
        the batch's cache, first tokens chosen (not yet joined to the batch's rows)."""
        cache, dev = batch.cache, self.target.device
        rows = tree.tokens.shape[0]
        fresh = joining.fresh
        width = int(fresh.max())
        verdict = self._verdict(batch, tree, out.logits[:rows])
        accepted = verdict.path.shape[1]
        index = torch.arange(max(accepted, width), device=dev).repeat(rows + len(joining.rows), 1)
        index[:rows, :accepted] = verdict.path
        cache.commit(index, torch.cat([verdict.counts, fresh]))
        result = self._tree_result(tree, verdict, out.features[:rows])
        feats = self._prompt_features(out.features[rows:, :width], joining)
        return result, self._started(joining, cache, rows, out.logits[rows:, 0], feats, start)

    @staticmethod
    def _next_context(batch: DecodeBatch, result: TreeResult, replace: bool) -> None:
        """The next draft context: features of each accepted path, each paired with the token after it. A cycle
        that did not draft appends to the context the draft has not seen yet."""
        new_tokens = torch.cat([result.path_tokens[:, 1:], torch.zeros_like(result.path_tokens[:, :1])], dim=1)
        new_tokens.scatter_(1, (result.counts - 1)[:, None], result.next_tokens[:, None])
        if replace:
            batch.context = DraftContext.of(result.features, new_tokens, result.counts)
        else:
            batch.context = batch.context.append(result.features, new_tokens, result.counts)

    def _account(
        self,
        rows: list[_Row],
        tree: DraftTree,
        result: TreeResult,
        drafted: bool,
        draft_s: float,
        verify_s: float,
        end: float,
    ) -> CycleOutcome:
        """Hand each row its accepted tokens and the target's next one; keep its statistics and the cycle's."""
        n_valid = tree.valid.sum(dim=1).tolist()
        path_list, count_list = result.path_tokens.tolist(), result.counts.tolist()
        next_list = result.next_tokens.tolist()
        max_depth = self.drafter.max_depth
        outcome = CycleOutcome(drafted, len(rows), 0, 0, 0, [0] * max_depth, draft_s, verify_s)
        for j, row in enumerate(rows):
            acc = count_list[j] - 1
            st = row.stats
            st.cycles += 1
            st.spec_cycles += int(drafted)
            st.draft_tokens += n_valid[j] - 1
            st.accepted_tokens += acc
            if len(st.accepted_per_depth) < max_depth:
                st.accepted_per_depth.extend([0] * (max_depth - len(st.accepted_per_depth)))
            for d in range(acc):
                st.accepted_per_depth[d] += 1
                outcome.accepted_per_depth[d] += 1
            st.draft_s += draft_s
            st.verify_s += verify_s
            before = len(row.tokens)
            self._emit_guarded(row, path_list[j][1 : acc + 1] + [next_list[j]])
            outcome.emitted += len(row.tokens) - before
            outcome.draft_tokens += n_valid[j] - 1
            outcome.accepted_tokens += acc
            if row.finish is not None:
                st.total_s = end - row.start
        return outcome

    # -- the whole loop for a fixed set of prompts --------------------------------------------
    @_with_glue_threads
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int] = 64,
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        stop_strings: Sequence[str] = (),
    ) -> list[GenerationResult]:
        if not prompts:
            return []
        bsz = len(prompts)
        params = list(sampling) if isinstance(sampling, Sequence) else [sampling] * bsz
        budgets = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * bsz
        if len(params) != bsz or len(budgets) != bsz:
            raise ValueError(f"got {bsz} prompts but {len(params)} sampling settings and {len(budgets)} budgets")
        batch = self.admit(None, self.prefill(prompts, budgets, params, [stop_strings] * bsz))
        rows = list(batch.rows)
        self.retire(batch)
        while batch.size:
            self.cycle(batch)
            self.retire(batch)
        results = []
        for row in rows:
            text = row.text if row.text is not None else (self.decode(row.tokens) if self.decode else None)
            results.append(
                GenerationResult(tokens=row.tokens, finish_reason=row.finish or "length", stats=row.stats, text=text)
            )
        return results
