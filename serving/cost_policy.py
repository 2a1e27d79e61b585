"""Tree size per batch from measured costs: the speculation policy that predicts each candidate's throughput.

A speculative cycle over a batch of B rows with a tree of N nodes costs one target call over B x N tokens plus the
draft's steps, and yields B x (1 + a_N) tokens, where a_N is the accepted draft tokens per row for that tree. Plain
decoding costs one target call over B tokens and yields B. The three quantities are measured from the server's own
cycles, each where it is shared: the target's cost as a curve over the total tokens of a call, the draft's per tree
and batch size (a smaller dynamic tree makes fewer draft calls, and a first call that reads the new context costs
more than an expansion step, so no one per-call cost fits them all), the acceptance per tree (it does not depend on
the batch).
A first guess treats every batch split alike (4 rows x 8 nodes as 32 rows x 1), so a cycle at batch 16 with a
4-node tree also tells what plain decoding at batch 64 would cost; but rows cost apart from tokens (each
row's cache is read), so once a batch size recurs (``settle`` cycles) plain decoding and each contender (a
candidate predicted within ``contender`` of the best) are measured at that size a few times, unless their whole
cycles at sizes beside it already predict it (``pool``, below). A cost is extrapolated
at most ``reach`` times beyond the largest size it was measured at; further out, the candidate is measured. Once a
candidate has run at a batch size, its own whole cycles there are its prediction (with its acceptance): the model
of parts only ranks what has not run there, since its parts miss what differs between candidates beside draft and
target (streaming more tokens per cycle, accepting a longer path). Per batch size the policy picks the candidate
with the most predicted tokens per second, measuring what it cannot yet predict and probing the others predicted
within ``probe_within`` of the leader, in turn, now and then; a challenger must be predicted ``hold`` faster than the
leader to replace it.

Batch sizes come and go: at many streams requests finish apart, so a batch passes through sizes just below its
largest for a few cycles each. A candidate's whole cycles at the nearest sizes it ran within ``pool`` of a batch size
(a fraction of it, at least one row) predict it there until it has cycles of its own (between two such sizes, the
line through them; beside one, that size's cycle scaled as the shared target curve rises or falls between them), so
a transient size is neither explored on its own nor ranked by the model of parts when its neighbours were measured.

Estimates go stale: the leader is measured every cycle, a candidate that does not lead only by its probes, so a
sample after a long gap weighs what the cycles in between would have (``Ema``): a cost measured while the machine
was busy (a batch filling, its clients' requests parsed on the same cores) or acceptance measured on other text does
not stay a candidate's estimate for good. A candidate predicted too far behind to be probed (below ``probe_within``
of the leader, e.g. every tree measured while other work shared the cores) is measured again once its estimate at
that batch size is ``stale_after`` cycles old: otherwise an estimate taken under load would keep it out for good.
Such a re-measurement runs the candidate until one of its cycles is not a catch-up (after plain decoding the first
one reads the skipped context, which is not what its cycles cost). A chain's cycle also tells what every shorter
chain would have accepted on the same text (a prefix of its path), so their acceptance follows the text now decoded.

A cycle whose target call also read the prompts of joining requests (see the scheduler) is a sample of the draft's
cost and of acceptance only: its call and its whole time hold the prompts' reading, which is no candidate's cost.

A cycle also costs what is neither draft nor target: accepting, streaming the tokens out, the scheduler's
bookkeeping. That overhead is measured per batch size (the cycle's whole time less its draft and target parts) and
is part of every candidate's prediction: left out, it favours candidates with more cycles per token (plain
decoding, small trees), which pay it more often.

Switching costs: the first speculative cycle after plain ones (or after a prefill) runs the draft over the context
it has not read, so its draft time is not a draft step's cost and is left out of the draft's measurements. While it
speculates all along, what the draft reads beyond a step is the prompts of requests that joined (with drafters
that do not read them as they join): that is a cost of speculating, averaged over its cycles (``reading``). Plain
decoding stays unless a tree is predicted ``margin`` faster: leaving it pays a catch-up, and the predictions err by
about that much. The probes of contenders that keep losing come half as often after each round of them (back to
``probe_every`` when the leader changes), since each probe of speculation pays that catch-up too.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from specdec_kit.runtime.core.trees import HEAD, HYBRID, LOOKUP, DynamicTreeConfig, SourcedTree, StaticTree, source_of
from specdec_kit.runtime.decoding.generate import CycleOutcome
from specdec_kit.serving.policy import Tree, shrink, tree_nodes


@dataclass
class Ema:
    """An exponential moving average that remembers how many samples it has seen; over its first ``1 / smoothing``
    samples it is their plain mean (so one early outlier does not linger as the estimate).

    With a clock (``now``: cycles counted where the estimate applies), a sample that comes ``k`` ticks after the one
    before weighs what ``k`` samples would have (``1 - (1 - smoothing) ** k``), at most ``most`` (a cost measured
    after a long gap all but replaces the estimate; one cycle's acceptance, noisier, is given less). A candidate that
    does not lead runs only as a probe, now and then: its estimate then follows what the probes measure now rather
    than its first cycles, which may have met other conditions (other text, a machine busy streaming to many
    clients as a batch filled) and would otherwise stay its estimate for hundreds of probes."""

    value: float = 0.0
    n: int = 0
    at: int = 0  # the clock at the last sample

    def add(self, x: float, smoothing: float, now: int | None = None, most: float = 1.0) -> None:
        self.n += 1
        weight = max(smoothing, 1.0 / self.n)
        if now is not None:
            if self.n > 1:
                weight = max(weight, min(most, 1.0 - (1.0 - smoothing) ** (now - self.at)))
            self.at = now
        self.value += (x - self.value) * weight


def interpolate(points: dict[int, Ema], x: int) -> float | None:
    """Piecewise-linear estimate at ``x`` from the measured points; beyond the last, along the last segment's slope
    (never below the last value; with one point, that value); before the first, the first value. None with no point."""
    xs = sorted(k for k, e in points.items() if e.n)
    if not xs:
        return None
    if x in points and points[x].n:
        return points[x].value
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[xs[0]].value
    if i == len(xs):
        if len(xs) == 1:
            return points[xs[0]].value
        x0, x1 = xs[-2], xs[-1]
        slope = max(0.0, (points[x1].value - points[x0].value) / (x1 - x0))
        return points[x1].value + slope * (x - x1)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0].value, points[x1].value
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def candidate_trees(tree: Tree, fractions: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125)) -> list[Tree]:
    """The engine's tree and smaller ones of the same kind, each size once, largest first."""
    out: list[Tree] = []
    for f in fractions:
        t = shrink(tree, f)
        if tree_nodes(t) >= 2 and tree_nodes(t) not in {tree_nodes(o) for o in out}:
            out.append(t)
    return out


def speculation_candidates(engine) -> list[Tree]:
    """What the cost policy weighs for an engine: its tree and smaller ones; a hybrid draft's three parts, each so."""
    from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter

    drafter = engine.drafter
    if isinstance(drafter, HybridDrafter):
        return hybrid_candidates(engine.tree, drafter.lookup.tree)
    return candidate_trees(engine.tree)


def hybrid_candidates(head_tree: DynamicTreeConfig, lookup_tree: DynamicTreeConfig) -> list[Tree]:
    """A hybrid draft's candidates: the merged trees, the head's alone and the model-free draft's alone, each at its
    sizes (plain decoding is the policy's own candidate)."""
    out: list[Tree] = []
    for source, tree in ((HYBRID, head_tree), (HEAD, head_tree), (LOOKUP, lookup_tree)):
        sourced = SourcedTree(tree.total_tokens, tree.depth, tree.top_k, source=source)
        out += candidate_trees(sourced)
    return out


def holds(big: Tree, small: Tree) -> bool:
    """Whether ``big`` drafts (about) every path ``small`` does: a static tree's choices contain the other's; a
    dynamic tree with as many beams, as deep, and as many nodes picks its nodes from a superset of the other's
    candidates by the same scores. (A chain is not held by a wider tree, which may spend its nodes on siblings.)"""
    if source_of(big) != source_of(small):  # a hybrid draft's parts draft different paths
        return False
    if isinstance(big, DynamicTreeConfig) and isinstance(small, DynamicTreeConfig):
        return big.top_k == small.top_k and big.depth >= small.depth and big.total_tokens >= small.total_tokens
    if isinstance(big, StaticTree) and isinstance(small, StaticTree):
        return {tuple(c) for c in small.choices} <= {tuple(c) for c in big.choices}
    return False


def chain_length(tree: Tree) -> int | None:
    """The draft tokens of a chain (a dynamic tree of one beam); None for a tree that branches."""
    if isinstance(tree, DynamicTreeConfig) and tree.top_k == 1:
        return tree.total_tokens - 1
    return None


@dataclass
class CostPolicy:
    """Per batch size, the candidate (a tree of ``trees``, or plain decoding) with the most predicted tokens/s."""

    trees: list[Tree]
    warmup: int = 3  # measurements of a quantity before it is trusted
    probe_every: int = 25  # then, per batch size, one cycle of another candidate this often (at first)
    max_probe_gap: int = 800  # the longest the probes of losing candidates back off to
    settle: int = 10  # cycles at a batch size before its contenders are measured at that size
    contender: float = 0.8  # predicted within this fraction of the best: worth measuring at the batch size itself
    probe_within: float = 0.5  # predicted within this fraction of the leader: probed now and then (further, never)
    smoothing: float = 0.1
    acceptance_smoothing: float = 0.1  # acceptance varies from cycle to cycle and with the text
    acceptance_warmup: int = 8  # cycles of a tree before its acceptance is trusted
    verify: dict[int, Ema] = field(default_factory=dict)  # target call seconds by total tokens (rows x nodes)
    verify_at: dict[int, dict[int, Ema]] = field(default_factory=dict)  # the same per batch size: rows -> tokens
    draft: dict[int, dict[int, Ema]] = field(default_factory=dict)  # [candidate] -> draft seconds by batch size
    overhead: dict[int, Ema] = field(default_factory=dict)  # seconds of a cycle outside draft and target, by batch size
    cycle_at: dict[int, dict[int, Ema]] = field(default_factory=dict)  # [candidate] -> a whole cycle's seconds by batch
    reading: dict[int, Ema] = field(default_factory=dict)  # per speculative cycle: the draft reading joined prompts
    reading_smoothing: float = 0.01  # prompts join now and then: an average over many cycles
    margin: float = 1.1  # a tree must be predicted this much faster than plain decoding to replace it
    hold: float = 1.05  # and any candidate this much faster than the leader: estimates from probes are noisy
    acceptance_most: float = 0.3  # the most one cycle's acceptance weighs after a long gap (see ``Ema``): it is noisy
    reach: float = 2.0  # a cost is extrapolated at most this far beyond the largest size measured; further, measured
    pool: float = 0.25  # whole cycles at sizes within this fraction of a batch size predict it (0: each on its own)
    stale_after: int = 400  # cycles at a batch size after which a candidate too far behind to probe is measured again
    remeasuring: dict[int, tuple[int, int]] = field(default_factory=dict)  # per batch size: (candidate, cycles left)
    accepted: dict[int, Ema] = field(default_factory=dict)  # [candidate] -> accepted draft tokens per row
    widths: dict[int, Ema] = field(default_factory=dict)  # [candidate] -> nodes per row its cycles verified
    cycles: dict[int, int] = field(default_factory=dict)  # per batch size, for the probes (and its estimates' clock)
    clock: int = 0  # cycles at every batch size: the acceptance estimates' clock
    leader: dict[int, int] = field(default_factory=dict)  # per batch size: the candidate it runs
    probe_gap: dict[int, int] = field(default_factory=dict)  # per batch size: cycles between probes
    next_probe: dict[int, int] = field(default_factory=dict)  # per batch size: the cycle of the next probe
    probe_turn: dict[int, int] = field(default_factory=dict)  # per batch size: which non-leader the next probe runs
    _last: int = 0  # the candidate of the cycle being run (0 = plain, k = trees[k - 1])
    _previous: int = 0  # the candidate of the cycle before it

    @property
    def never_speculates(self) -> bool:
        return not self.trees

    def nodes(self, k: int) -> float:
        """Nodes per row a cycle of candidate ``k`` verifies: its tree's, or as measured (a model-free draft proposes
        what the text offers, often less than its tree allows)."""
        if k == 0:
            return 1
        width = self.widths.get(k)
        return width.value if width is not None and width.n else tree_nodes(self.trees[k - 1])

    def trusted(self) -> tuple[dict[int, Ema], dict[int, dict[int, Ema]]]:
        """The verify and (per candidate) draft cost points measured ``warmup`` times or more (taken once per
        decision)."""
        return (
            {t: e for t, e in self.verify.items() if e.n >= self.warmup},
            {k: {b: e for b, e in by_batch.items() if e.n >= self.warmup} for k, by_batch in self.draft.items()},
        )

    def predicted_rate(
        self, k: int, batch: int, points: tuple[dict[int, Ema], dict[int, dict[int, Ema]]] | None = None
    ) -> float | None:
        """Tokens/s the candidate would give at this batch size; None where a quantity is not measured enough."""
        shared, draft_points = points or self.trusted()
        reading = interpolate(self.reading, batch) or 0.0
        cycle = self.cycle_estimate(k, batch, shared)
        if cycle is not None:  # its own whole cycles at this batch size or beside it: no model needed
            if k == 0:
                return batch / cycle
            acc = self.acceptance(k)
            return None if acc is None else batch * (1 + acc) / (cycle + reading)
        x = round(batch * self.nodes(k))
        verify = self.verify_cost(x, batch, shared)
        if verify is None:
            return None
        verify += interpolate(self.overhead, batch) or 0.0
        if k == 0:
            return batch / verify
        acc = self.acceptance(k)
        own = draft_points.get(k)
        if acc is None or not own or not min(own) <= batch <= self.reach * max(own):
            return None  # guessed from larger batches only, too high to ever get measured; from far smaller, anything
        return batch * (1 + acc) / (verify + interpolate(own, batch) + reading)

    def verify_cost(self, x: int, batch: int, shared: dict[int, Ema]) -> float | None:
        """Seconds of a target call over ``x`` tokens at this batch size. Measured at the batch size itself where
        it has been, within that range; outside it, its nearest own point moved by the shared curve's rise or fall
        from there (the rows' own cost stays; own points at a few tokens per row say nothing of where calls turn
        compute-bound, nor do a tree's calls of what a row's single token costs)."""
        own = {t: e for t, e in self.verify_at.get(batch, {}).items() if e.n >= self.warmup}
        if x in own or (len(own) >= 2 and min(own) <= x <= max(own)):
            return interpolate(own, x)
        shared_x = interpolate(shared, x)
        if (len(shared) < 2 and x not in shared) or x > self.reach * max(shared):
            return None
        if own and x > max(own):
            top = max(own)
            return own[top].value + max(0.0, shared_x - interpolate(shared, top))
        if own:
            bottom = min(own)
            return max(shared_x, own[bottom].value - max(0.0, interpolate(shared, bottom) - shared_x))
        return shared_x

    def cycle_estimate(self, k: int, batch: int, shared: dict[int, Ema]) -> float | None:
        """Seconds of a whole cycle of candidate ``k`` at this batch size from its own cycles: measured there, or at the
        nearest sizes measured within ``pool`` of it (see the module docstring); None where neither."""
        own = {b: e for b, e in self.cycle_at.get(k, {}).items() if e.n >= self.warmup}
        if batch in own:
            return own[batch].value
        radius = max(1, int(self.pool * batch)) if self.pool > 0 else 0
        near = {b: e for b, e in own.items() if abs(b - batch) <= radius}
        below, above = [b for b in near if b < batch], [b for b in near if b > batch]
        if below and above:
            return interpolate({max(below): near[max(below)], min(above): near[min(above)]}, batch)
        if not near:
            return None
        nearest = min(near, key=lambda b: abs(b - batch))
        width = self.nodes(k)
        here, there = interpolate(shared, round(batch * width)), interpolate(shared, round(nearest * width))
        scale = here / there if here and there else 1.0
        return near[nearest].value * scale

    def acceptance(self, k: int) -> float | None:
        """Accepted draft tokens per row for candidate ``k``, once measured enough. A larger tree that holds a
        smaller one's paths is taken to accept at least what that one measured."""
        own = self.accepted.get(k)
        if own is None or own.n < self.acceptance_warmup:
            return None
        held = [
            e.value
            for c, e in self.accepted.items()  # trees only: plain decoding accepts nothing
            if c != k and e.n >= self.acceptance_warmup and holds(self.trees[k - 1], self.trees[c - 1])
        ]
        return max([own.value, *held])

    def measured_at(self, k: int, batch: int) -> bool:
        """Whether candidate ``k``'s whole cycle has been measured ``warmup`` times at this batch size itself."""
        point = self.cycle_at.get(k, {}).get(batch)
        return point is not None and point.n >= self.warmup

    def age(self, k: int, batch: int) -> int | None:
        """Cycles at this batch size since candidate ``k``'s estimate there was last measured (its whole cycles, or
        for a tree predicted from parts, its draft); None where it never was."""
        point = self.cycle_at.get(k, {}).get(batch) or self.draft.get(k, {}).get(batch)
        return None if point is None or not point.n else self.cycles.get(batch, 0) - point.at

    def stale(self, candidates: list[int], batch: int) -> int | None:
        """The best of ``candidates`` (ranked) whose estimate at this batch size is ``stale_after`` cycles old."""
        return next((c for c in candidates if (self.age(c, batch) or 0) >= self.stale_after), None)

    def choose(self, batch_size: int) -> Tree | None:
        points = self.trusted()
        rates = [self.predicted_rate(c, batch_size, points) for c in range(len(self.trees) + 1)]
        n = self.cycles[batch_size] = self.cycles.get(batch_size, 0) + 1
        self.clock += 1
        if batch_size in self.remeasuring:  # a stale candidate whose last cycle only caught up: once more
            self._last, left = self.remeasuring.pop(batch_size)
            if left > 1:
                self.remeasuring[batch_size] = (self._last, left - 1)
            return None if self._last == 0 else self.trees[self._last - 1]
        # a candidate still lacking a measurement goes first: plain (its call is the cheapest point of the cost
        # curve), then the trees, largest first; at a batch size that recurs, its contenders at that size (or beside it)
        k = next((c for c, rate in enumerate(rates) if rate is None), None)
        if k is None and n > self.settle:  # those predicted close to the best, not the ones far behind
            best = max(rates)
            k = next(
                (
                    c
                    for c in range(len(rates))  # plain decoding always: speculation answers to it
                    if (c == 0 or rates[c] >= self.contender * best)
                    and self.cycle_estimate(c, batch_size, points[0]) is None
                ),
                None,
            )
        if k is None:
            leader = self.leader.get(batch_size)
            ranked = sorted(
                range(len(rates)),
                key=lambda c: -(rates[c] * (self.margin if c == 0 else 1.0) * (self.hold if c == leader else 1.0)),
            )
            k = ranked[0]
            if leader != k:  # a new leader: the others are worth probing often again
                self.leader[batch_size], self.probe_gap[batch_size] = k, self.probe_every
                self.next_probe[batch_size], self.probe_turn[batch_size] = n + self.probe_every, 0
            # the others in turn, best first: an unlucky early measurement does not bury a candidate for good,
            # and one predicted far behind is not worth a probe's cycle (and catch-up) at this batch size
            others = [c for c in ranked[1:] if rates[c] >= self.probe_within * rates[k]]
            if others and n >= self.next_probe[batch_size]:
                turn = self.probe_turn[batch_size]
                k = others[turn % len(others)]
                self.probe_turn[batch_size] = turn + 1
                self.next_probe[batch_size] = n + self.probe_gap[batch_size]
                if (turn + 1) % len(others) == 0:  # a round over: the next ones come half as often
                    self.probe_gap[batch_size] = min(2 * self.probe_gap[batch_size], self.max_probe_gap)
            else:
                stale = self.stale([c for c in ranked[1:] if c not in others], batch_size)
                if stale is not None:
                    k, self.remeasuring[batch_size] = stale, (stale, 2)  # a catch-up, then up to 2 more cycles
        self._last = k
        return None if k == 0 else self.trees[k - 1]

    def observe(self, outcome: CycleOutcome, seconds: float) -> None:
        """Fold one cycle's measured costs and acceptance into the model; ``seconds`` is the cycle's whole time."""
        if seconds <= 0 or outcome.rows == 0:
            return
        k = self._last if outcome.speculative else 0
        width = outcome.tree_width or (tree_nodes(self.trees[k - 1]) if k else 1)
        tokens = outcome.rows * width
        if k:
            self.widths.setdefault(k, Ema()).add(width, self.smoothing)
        now = self.cycles.get(outcome.rows, 0)  # this batch size's clock
        if not outcome.joined:  # a target call that also read joining prompts costs more than the candidate's
            self._observe_target_and_cycle(k, outcome, seconds, tokens, now)
        if k:
            if not outcome.caught_up:
                self.draft.setdefault(k, {}).setdefault(outcome.rows, Ema()).add(outcome.draft_s, self.smoothing, now)
            if self._previous:  # speculating all along: what the draft read beyond a step was prompts that joined
                step = interpolate(self.draft.get(k, {}), outcome.rows) if outcome.caught_up else outcome.draft_s
                if step is not None:
                    extra = max(0.0, outcome.draft_s - step)
                    self.reading.setdefault(outcome.rows, Ema()).add(extra, self.reading_smoothing)
            self.accepted.setdefault(k, Ema()).add(
                outcome.accepted_tokens / outcome.rows, self.acceptance_smoothing, self.clock, self.acceptance_most
            )
            self._credit_shorter_chains(k, outcome)
        self._previous = k

    def _observe_target_and_cycle(self, k: int, outcome: CycleOutcome, seconds: float, tokens: int, now: int) -> None:
        self.verify.setdefault(tokens, Ema()).add(outcome.verify_s, self.smoothing)
        self.verify_at.setdefault(outcome.rows, {}).setdefault(tokens, Ema()).add(outcome.verify_s, self.smoothing)
        self.overhead.setdefault(outcome.rows, Ema()).add(
            max(0.0, seconds - outcome.draft_s - outcome.verify_s), self.smoothing
        )
        if not (k and outcome.caught_up):  # a catch-up over unread context is not a step's cost
            self.cycle_at.setdefault(k, {}).setdefault(outcome.rows, Ema()).add(seconds, self.smoothing, now)
        pending = self.remeasuring.get(outcome.rows)
        if pending and pending[0] == self._last and not (k and outcome.caught_up):
            del self.remeasuring[outcome.rows]  # measured again: its estimate now is what it costs now

    def _credit_shorter_chains(self, k: int, outcome: CycleOutcome) -> None:
        """A chain drafts the first tokens of every longer chain (one beam: the draft's likeliest token at each
        step), and verification accepts a prefix of the drafted path, so a chain's cycle tells what each shorter
        chain would have accepted on the same text: its accepted depth capped at the shorter length (exactly when
        greedy, in expectation when sampled). The shorter chains' acceptance then follows the text being decoded
        now, not the text of their own last cycles, which may be long ago (a candidate that does not lead runs only
        as a probe)."""
        longest = chain_length(self.trees[k - 1])
        reached = outcome.accepted_per_depth  # [d-1]: rows whose accepted path reached depth d
        if longest is None or not reached:
            return
        for c, tree in enumerate(self.trees, start=1):
            length = chain_length(tree)
            same = source_of(tree) == source_of(self.trees[k - 1])  # the same draft's chain: a prefix of its path
            if c != k and same and length is not None and length < longest:
                self.accepted.setdefault(c, Ema()).add(
                    sum(reached[:length]) / outcome.rows, self.acceptance_smoothing, self.clock, self.acceptance_most
                )

    def describe(self) -> list[dict]:
        """Per candidate: its tree size and acceptance, and its predicted tokens/s at the batch sizes seen."""
        out = []
        for k in range(len(self.trees) + 1):
            acc = self.accepted.get(k)
            out.append(
                {
                    "tree_tokens": tree_nodes(self.trees[k - 1]) if k else 1,
                    **({"source": source_of(self.trees[k - 1])} if k and source_of(self.trees[k - 1]) else {}),
                    "accepted_per_row": acc.value if acc and acc.n else None,
                    "predicted_tokens_per_s": {b: self.predicted_rate(k, b) for b in sorted(self.cycles)},
                }
            )
        return out
