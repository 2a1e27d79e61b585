"""Continuous batching: one engine thread runs the runtime's cycles over a batch that requests join and
leave between cycles.

HTTP handlers (asyncio) ``submit`` requests into a bounded queue and read ``Delta`` events from their
own asyncio queue; the engine thread admits waiting requests up to ``max_num_seqs`` (one prefill for
all of them), runs one speculative cycle over the whole batch with a tree per sequence (its size chosen
by the ``SpeculationPolicy`` for the current batch size), hands each request its new tokens, and
retires finished and cancelled rows, which frees their cache.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specdec_kit.runtime.engine import Engine
from specdec_kit.runtime.generate import RequestStats, SpeculativeGenerator
from specdec_kit.runtime.sampling import SamplingParams
from specdec_kit.serving.errors import APIError, overloaded
from specdec_kit.serving.metrics import ServerMetrics
from specdec_kit.serving.policy import SpeculationPolicy, tree_nodes


@dataclass
class Delta:
    """New tokens for one request; ``finish`` set on its last event (with the final text and stats)."""

    tokens: list[int]
    finish: str | None = None
    text: str | None = None
    stats: RequestStats | None = None
    error: APIError | None = None


@dataclass(eq=False)  # identity semantics: requests are handles
class ServerRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    sent: int = 0
    first_at: float | None = None
    last_at: float | None = None
    unsent: list[int] = field(default_factory=list)

    def deliver(self, delta: Delta) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, delta)


class Scheduler:
    def __init__(self, engine: Engine, metrics: ServerMetrics, policy: SpeculationPolicy, max_num_seqs: int = 16,
                 max_queue: int = 256):
        tok = engine.tokenizer
        self.engine = engine
        # a server that never speculates drafts nothing at all (no draft context is kept either)
        drafter = None if policy.never_speculates else engine.drafter
        self.gen = SpeculativeGenerator(engine.target, drafter, decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
        self.metrics, self.policy = metrics, policy
        self.max_num_seqs, self.max_queue = max_num_seqs, max_queue
        self.pending: deque[ServerRequest] = deque()
        self.batch = None
        self.cv = threading.Condition()
        self.accepting = True
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # -- called from the event loop -----------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: ServerRequest) -> None:
        with self.cv:
            if not self.accepting:
                raise overloaded(503, 5.0)
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

    def stop(self, timeout: float) -> None:
        """Stop admitting; let running and queued requests finish within ``timeout``; cancel the rest."""
        with self.cv:
            self.accepting = False
        deadline = time.monotonic() + timeout
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.cv:
            for req in list(self.pending):
                req.cancelled = True
            if self.batch is not None:
                for row in self.batch.rows:
                    row.tag.cancelled = True
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
            try:
                if new:
                    self._admit(new)
                if self.batch is not None and self.batch.size:
                    self._cycle()
            except Exception as exc:  # never leave requests hanging; the server keeps serving
                self._fail_all(new, exc)
            self.metrics.labels(self.metrics.running).set(self.batch.size if self.batch is not None else 0)

    def _fail_all(self, new: list[ServerRequest], exc: Exception) -> None:
        error = APIError(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")
        reqs = set(new) | ({row.tag for row in self.batch.rows} if self.batch is not None else set())
        for req in reqs:
            req.deliver(Delta([], finish="error", error=error))
        self.metrics.labels(self.metrics.errors, type="internal_error").inc(len(reqs))
        self.batch = None

    def _admit(self, reqs: list[ServerRequest]) -> None:
        now = time.perf_counter()
        for req in reqs:
            self.metrics.labels(self.metrics.queue_time).observe(now - req.arrival)
            self.metrics.labels(self.metrics.prompt_tokens).inc(len(req.prompt_ids))
        fresh = self.gen.prefill([r.prompt_ids for r in reqs], [r.max_tokens for r in reqs], [r.params for r in reqs],
                                 stops=[r.stop for r in reqs], tags=reqs, ignore_eos=[r.ignore_eos for r in reqs])
        self.batch = self.gen.admit(self.batch, fresh)
        self._report()

    def _cycle(self) -> None:
        batch = self.batch
        for row in batch.rows:
            if row.tag.cancelled and row.finish is None:
                row.finish = "cancelled"
        self._report()  # retire cancelled rows before spending a cycle on them
        if not batch.size:
            return
        tree = self.policy.choose(batch.size)
        if tree is not None:
            self.gen.drafter.set_tree(tree)
        self.metrics.labels(self.metrics.tree_tokens).set(tree_nodes(tree))
        t0 = time.perf_counter()
        outcome = self.gen.cycle(batch, speculate=tree is not None)
        self.policy.record(outcome.rows, outcome.speculative, outcome.emitted, time.perf_counter() - t0)
        self.metrics.record_speculation(outcome.rows if outcome.speculative else 0, outcome.draft_tokens,
                                        outcome.accepted_tokens, outcome.accepted_per_depth)
        self._report()

    def _report(self) -> None:
        """Hand every request its new tokens, update the metrics, retire finished rows."""
        now = time.perf_counter()
        m = self.metrics
        for row in self.batch.rows:
            req: ServerRequest = row.tag
            new = row.tokens[req.sent:]
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
            if row.finish != "cancelled":
                m.labels(m.e2e).observe(now - req.arrival)
                m.labels(m.success, finished_reason=row.finish).inc()
            text = row.text if row.text is not None else self.gen.decode(row.tokens)
            req.deliver(Delta(req.unsent, finish=row.finish, text=text, stats=row.stats))
