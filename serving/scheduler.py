"""Continuous batching: one engine thread runs the runtime's cycles over a batch that requests join and
leave between cycles.

HTTP handlers (asyncio) ``submit`` requests into a bounded queue and read ``Delta`` events from their
own asyncio queue; the engine thread admits waiting requests up to ``max_num_seqs`` (one prefill for
all of them), runs one speculative cycle over the whole batch with a tree per sequence (its size chosen
by the speculation policy for the current batch size), hands each request its new tokens, and
retires finished and cancelled rows, which frees their cache. A request that joins a running batch with at most
``fold_prompt_tokens`` prompt tokens left to compute (past its cached blocks) has no prefill of its own: the cycle's
target call reads them beside the batch's trees, and it joins after that call.

Failures stay with the request that caused them: a prefill that fails is retried one request at a
time, so only the request that fails alone is refused; a row whose sampling, stop strings or
decoding fails leaves the batch with an error while the others go on (``SpeculativeGenerator``
guards every per-row step); each failure is logged with the request id. A fault in a batched target
call belongs to no single request: it fails the rows of that batch, and the server keeps serving.

A streamed request's unread output is bounded: when more than ``max_unread_tokens`` generated tokens
wait for a client that does not read them, the request is stopped with a ``slow_reader`` error
(its row and memory go to others).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import HEAD, LOOKUP, source_of
from specdec_kit.runtime.decoding.generate import RequestStats, SpeculativeGenerator
from specdec_kit.runtime.engine import Engine
from specdec_kit.serving.errors import APIError, draining, internal, overloaded, slow_reader
from specdec_kit.serving.metrics import ServerMetrics
from specdec_kit.serving.policy import Policy, tree_nodes


@dataclass
class Delta:
    """New tokens for one request; ``finish`` set on its last event (with the final text and stats)."""

    tokens: list[int]
    finish: str | None = None
    text: str | None = None
    stats: RequestStats | None = None
    error: APIError | None = None


logger = logging.getLogger("specdec_kit.serving")


@dataclass(eq=False, repr=False)  # identity semantics: requests are handles
class ServerRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    request_id: str = "request"
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    sent: int = 0
    first_at: float | None = None
    last_at: float | None = None
    unsent: list[int] = field(default_factory=list)
    read: int = 0  # tokens the HTTP side has taken from ``events`` (``sent - read`` wait for the client)

    def __repr__(self) -> str:
        return self.request_id

    def deliver(self, delta: Delta) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, delta)

    def fail(self, error: APIError, tokens: list[int] | None = None) -> None:
        error.counted = True  # the scheduler counts the errors it hands out
        self.deliver(Delta(tokens or [], finish="error", error=error))


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        policy: Policy,
        max_num_seqs: int = 16,
        max_queue: int = 256,
        max_unread_tokens: int = 2048,
        prefix_cache_mib: float = 0.0,
        fold_prompt_tokens: int = 0,
    ):
        tok = engine.tokenizer
        self.engine = engine
        # a server that never speculates drafts nothing at all (no draft context is kept either)
        drafter = None if policy.never_speculates else engine.drafter
        self.gen = SpeculativeGenerator(
            engine.target, drafter, decode=lambda ids: tok.decode(ids, skip_special_tokens=True)
        )
        if prefix_cache_mib > 0:
            self.gen.cache_prefixes(prefix_cache_mib)
        self.metrics, self.policy = metrics, policy
        self.fold_prompt_tokens = fold_prompt_tokens
        self.max_num_seqs, self.max_queue, self.max_unread_tokens = max_num_seqs, max_queue, max_unread_tokens
        self.kv_budget = max_num_seqs * engine.target.max_context  # tokens the batch may hold at most
        self.pending: deque[ServerRequest] = deque()
        self.batch = None
        self.cv = threading.Condition()
        self.accepting = True
        self.draining = False  # refusals say "shutting down" rather than "overloaded"
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # -- called from the event loop -----------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: ServerRequest) -> None:
        with self.cv:
            if not self.accepting:
                raise draining(5.0) if self.draining else overloaded(503, 5.0)
            if len(self.pending) >= self.max_queue:
                raise overloaded(429, 1.0)
            self.pending.append(req)
            self.metrics.labels(self.metrics.waiting).set(len(self.pending))
            self.cv.notify()

    def cancel(self, req: ServerRequest) -> None:
        """The client went away: its row leaves the batch before the next cycle."""
        req.cancelled = True
        with self.cv:
            self.cv.notify()

    def busy(self) -> int:
        with self.cv:
            return len(self.pending) + (self.batch.size if self.batch is not None else 0)

    def begin_drain(self) -> None:
        """Take no new requests (they get 503 "shutting down"); running and queued ones go on."""
        with self.cv:
            self.accepting, self.draining = False, True

    def cancel_all(self) -> None:
        with self.cv:
            for req in list(self.pending):
                req.cancelled = True
            if self.batch is not None:
                for row in self.batch.rows:
                    row.tag.cancelled = True
            self.cv.notify()

    def stop(self, timeout: float) -> None:
        """Stop admitting; let running and queued requests finish within ``timeout``; cancel the rest."""
        with self.cv:
            self.accepting = False
        deadline = time.monotonic() + timeout
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.cancel_all()
        with self.cv:
            self.stopping = True
            self.cv.notify()
        self.thread.join(timeout=10)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and not self.pending and (self.batch is None or self.batch.size == 0):
                    self.cv.wait()
                if self.stopping and not self.pending and (self.batch is None or self.batch.size == 0):
                    return
                room = self.max_num_seqs - (self.batch.size if self.batch is not None else 0)
                new = []
                while self.pending and len(new) < room:
                    req = self.pending.popleft()
                    if req.cancelled:
                        req.deliver(Delta([], finish="cancelled"))
                        continue
                    new.append(req)
                self.metrics.labels(self.metrics.waiting).set(len(self.pending))
            self._arrived(new)
            try:
                folded = self._foldable(new)
                if len(folded) < len(new):
                    self._admit([req for req in new if req not in folded])
                if self.batch is not None and self.batch.size:
                    self._cycle(folded)
            except Exception as exc:  # never leave requests hanging; the server keeps serving
                self._fail_all(new, exc)
            self.metrics.labels(self.metrics.running).set(self.batch.size if self.batch is not None else 0)
            held = int(self.batch.cache.lengths.sum()) if self.batch is not None and self.batch.size else 0
            self.metrics.labels(self.metrics.kv_usage).set(held / self.kv_budget)

    def _fail_all(self, new: list[ServerRequest], exc: Exception) -> None:
        """A batched step failed (no single request to blame): fail its rows, keep serving."""
        reqs = list(dict.fromkeys(list(new) + ([row.tag for row in self.batch.rows] if self.batch is not None else [])))
        logger.error("a batched engine step failed; failing requests %s", ", ".join(map(repr, reqs)), exc_info=exc)
        for req in reqs:
            req.fail(internal(req.request_id, exc))
        self.metrics.labels(self.metrics.errors, type="internal_error").inc(len(reqs))
        self.batch = None

    def _foldable(self, new: list[ServerRequest]) -> list[ServerRequest]:
        """The new requests the next cycle's target call reads beside the batch's trees (so their prefill costs no
        call of its own): those whose uncached prompt tokens number at most ``fold_prompt_tokens``, when a batch is
        running. A prompt read that way pads every row of the call to its width, so long ones get a prefill."""
        if not new or not self.fold_prompt_tokens or self.batch is None or not self.batch.size:
            return []
        return [req for req in new if self.gen.uncached_tokens(req.prompt_ids) <= self.fold_prompt_tokens]

    def _arguments(self, reqs: list[ServerRequest]) -> tuple:
        """``SpeculativeGenerator.prefill``'s (and ``prepare``'s) arguments for these requests."""
        return (
            [r.prompt_ids for r in reqs],
            [r.max_tokens for r in reqs],
            [r.params for r in reqs],
            [r.stop for r in reqs],
            reqs,
            [r.ignore_eos for r in reqs],
        )

    def _prefill(self, reqs: list[ServerRequest]):
        return self.gen.prefill(*self._arguments(reqs))

    def _arrived(self, reqs: list[ServerRequest]) -> None:
        now = time.perf_counter()
        for req in reqs:
            self.metrics.labels(self.metrics.queue_time).observe(now - req.arrival)
            self.metrics.labels(self.metrics.prompt_tokens).inc(len(req.prompt_ids))

    def _count_prefix_hits(self, rows) -> None:
        for row in rows:
            self.metrics.labels(self.metrics.prefix_queries).inc(row.stats.prompt_tokens)
            self.metrics.labels(self.metrics.prefix_hits).inc(row.stats.cached_tokens)

    def _admit(self, reqs: list[ServerRequest]) -> None:
        """One prefill for all new requests; when it fails, one per request, so only a request that fails
        on its own is refused."""
        try:
            fresh = [self._prefill(reqs)]
        except Exception as exc:  # noqa: BLE001 - find the request that caused it
            if len(reqs) == 1:
                self._fail_request(reqs[0], exc)
                return
            fresh = []
            for req in reqs:
                try:
                    fresh.append(self._prefill([req]))
                except Exception as one:  # noqa: BLE001
                    self._fail_request(req, one)
        for part in fresh:
            self._count_prefix_hits(part.rows)
            self.batch = self.gen.admit(self.batch, part)
        if fresh:
            self._report()

    def _fail_request(self, req: ServerRequest, exc: Exception) -> None:
        logger.error("request %s failed: %s: %s", req.request_id, type(exc).__name__, exc, exc_info=exc)
        self.metrics.labels(self.metrics.errors, type="internal_error").inc()
        req.fail(internal(req.request_id, exc))

    def _cycle(self, joining: list[ServerRequest]) -> None:
        """One cycle over the running batch; ``joining`` requests are read by its target call and join after it
        (prefilled on their own if that cannot be done)."""
        batch = self.batch
        for row in batch.rows:
            if row.finish is not None:
                continue
            req: ServerRequest = row.tag
            if req.cancelled:
                row.finish = "cancelled"
            elif req.sent - req.read > self.max_unread_tokens:
                row.finish, row.error = "error", slow_reader(req.sent - req.read, self.max_unread_tokens)
                logger.warning("request %s stopped: %s", req.request_id, row.error.message)
        self._report()  # retire cancelled rows before spending a cycle on them
        if not batch.size:
            if joining:
                self._admit(joining)
            return
        ready = None
        if joining:
            try:
                ready = self.gen.prepare(*self._arguments(joining))
            except Exception:  # noqa: BLE001 - a prompt that cannot be prepared gets the prefill path's isolation
                self._admit(joining)
                joining = []
        tree = self.policy.choose(batch.size)
        if tree is not None:
            self.gen.set_tree(tree)
        self.metrics.labels(self.metrics.tree_tokens).set(tree_nodes(tree))
        t0 = time.perf_counter()
        outcome = self.gen.cycle(batch, speculate=tree is not None, joining=ready)
        if joining and outcome.joined:
            self._count_prefix_hits(batch.rows[-outcome.joined :])
            self.metrics.labels(self.metrics.folded_prompts).inc(outcome.joined)
        elif joining:
            self._admit(joining)
        self.metrics.record_speculation(
            outcome.rows if outcome.speculative else 0,
            outcome.draft_tokens,
            outcome.accepted_tokens,
            outcome.accepted_per_depth,
            self.method_of(tree),
        )
        self._report()
        # the policy weighs the whole cycle: handing the tokens out is paid once per cycle, whatever it drafted
        self.policy.observe(outcome, time.perf_counter() - t0)

    def method_of(self, tree) -> str:
        """The draft that fills ``tree``: the engine's (``griffin``, ``suffix``, ``griffin+suffix``), or the part of a
        hybrid a sourced tree names."""
        label = self.engine.draft_kind
        head, _, lookup = label.partition("+")
        return {HEAD: head, LOOKUP: lookup}.get(source_of(tree) or "", label)

    def _report(self) -> None:
        """Hand every request its new tokens, update the metrics, retire finished rows."""
        now = time.perf_counter()
        m = self.metrics
        for row in self.batch.rows:
            req: ServerRequest = row.tag
            new = row.tokens[req.sent :]
            if new:
                if req.first_at is None:
                    req.first_at = now
                    m.labels(m.ttft).observe(now - req.arrival)
                    rest = new[1:]
                else:
                    rest = new
                if rest and req.last_at is not None:
                    gap = (now - req.last_at) / len(rest)
                    for _ in rest:
                        m.labels(m.itl).observe(gap)
                req.last_at = now
                req.sent = len(row.tokens)
                m.labels(m.generation_tokens).inc(len(new))
            if row.finish is None:
                if new:
                    req.deliver(Delta(new))
            else:
                req.unsent = new  # goes out with the final event
        for row in self.gen.retire(self.batch):
            req = row.tag
            if row.finish == "error":
                error = row.error if isinstance(row.error, APIError) else internal(req.request_id, row.error)
                m.labels(m.errors, type=error.code or error.type).inc()
                req.fail(error, req.unsent)
                continue
            try:
                text = row.text if row.text is not None else self.gen.decode(row.tokens)
            except Exception as exc:  # noqa: BLE001 - this request's detokenisation fails it alone
                self._fail_request(req, exc)
                continue
            if row.finish != "cancelled":
                m.labels(m.e2e).observe(now - req.arrival)
                m.labels(m.success, finished_reason=row.finish).inc()
            req.deliver(Delta(req.unsent, finish=row.finish, text=text, stats=row.stats))
