"""How much of a model-free proposal is worth verifying: each node's chance of acceptance (its score, calibrated by
what verification has accepted) against what each width of tree costs (measured cycle times).

A lookup's trie is cheap to draft and free to cut, but not free to verify: on a CPU a tree of 24 tokens costs the
target two to three times what one token does, so on text that copies little (a summary, an answer over a long document) a
full proposal loses to plain decoding. The sizing keeps, per cycle, the number of best-first nodes that maximizes the
expected tokens per second over the batch: (1 + the kept nodes' calibrated acceptance) per row over the predicted
seconds of a cycle that wide. Zero nodes (plain decoding) is one of the choices, so sizing never does much worse than
plain decoding once it has measured; where copying pays it keeps the whole proposal.

Both estimates are learned online from the cycles themselves: no model and no setting to tune per machine.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from specdec_kit.runtime.core.lookup import Proposal


class CycleCost:
    """Seconds per cycle as a function of the tree's width (tokens verified per row, root included), per batch size:
    a straight line ``a + b * width`` fit to the last ``window`` cycles. Where the widths seen so far hardly vary, the
    slope leans on ``prior_slope`` (the share of a one-token cycle that each more token adds)."""

    def __init__(self, window: int = 64, prior_slope: float = 0.02, prior_weight: float = 16.0, least: int = 4):
        self.window, self.prior_slope, self.prior_weight, self.least = window, prior_slope, prior_weight, least
        self.seen: dict[int, deque[tuple[int, float]]] = {}
        self._fits: dict[int, tuple[float, float] | None] = {}  # per batch size, until its next observation

    def observe(self, batch: int, width: int, seconds: float) -> None:
        """One cycle's time; a time far above the prediction (a prefill or a pause between cycles) is not a cycle's."""
        predicted = self.predict(batch, width)
        if seconds <= 0 or (predicted is not None and seconds > 3 * predicted):
            return
        self.seen.setdefault(batch, deque(maxlen=self.window)).append((width, seconds))
        self._fits.pop(batch, None)

    def line(self, batch: int) -> tuple[float, float] | None:
        """The fit ``(a, b)``, or None before ``least`` cycles of this batch size."""
        if batch not in self._fits:
            self._fits[batch] = self._fit(batch)
        return self._fits[batch]

    def _fit(self, batch: int) -> tuple[float, float] | None:
        seen = self.seen.get(batch)
        if not seen or len(seen) < self.least:
            return None
        n = len(seen)
        mean_w = sum(w for w, _ in seen) / n
        mean_s = sum(s for _, s in seen) / n
        var_w = sum((w - mean_w) ** 2 for w, _ in seen)
        cov = sum((w - mean_w) * (s - mean_s) for w, s in seen)
        prior = self.prior_slope * mean_s / (1 + self.prior_slope * (mean_w - 1))  # seconds per token at this level
        slope = max(0.0, (cov + self.prior_weight * prior) / (var_w + self.prior_weight))
        return max(mean_s - slope * mean_w, 1e-9), slope

    def predict(self, batch: int, width: int) -> float | None:
        fit = self.line(batch)
        return None if fit is None else fit[0] + fit[1] * width


class RunningMean:
    """A plain mean of the first ``1 / smoothing`` values, then an exponential average: the first measurement, often
    the slowest or the luckiest, weighs no more than any other, and later ones follow the text as it changes."""

    def __init__(self, smoothing: float = 0.1):
        self.smoothing, self.count = smoothing, 0
        self.value: float | None = None

    def add(self, value: float) -> None:
        self.count += 1
        old = self.value
        self.value = value if old is None else old + max(self.smoothing, 1 / self.count) * (value - old)


def length_bin(length: int) -> int:
    """1, 2, 3-4, 5-8, 9 and beyond (a node's depth, a proposal's match length)."""
    return 0 if length <= 1 else min(4, (length - 1).bit_length())


def score_bin(score: float, bins: int = 5) -> int:
    return min(bins - 1, max(0, int(score * bins)))


class NodeCalibration:
    """What share of proposed nodes verification accepted, by node depth and score (a lookup's scores are shares of
    earlier occurrences: a single earlier occurrence scores 1.0 whatever it is worth), within those by the
    proposal's match length (a long match is a copy in progress), and within those by what the row's last cycle
    accepted (a copy goes on); a sampled row's nodes apart from a greedy row's (its draw must pick the node's token, so
    it accepts fewer). Each estimate leans on the coarser one, worth ``prior`` nodes (the coarsest on the score
    itself), and keeps its last ``horizon`` or so nodes' evidence, so it follows the text's changes."""

    def __init__(self, prior: float = 4.0, horizon: float = 400.0):
        self.prior, self.horizon = prior, horizon
        self.proposed: dict[tuple, float] = {}
        self.accepted: dict[tuple, float] = {}

    @staticmethod
    def cells(depth: int, score: float, proposal: Proposal) -> list[tuple]:
        """The node's cells, coarsest first; a sampled row's apart from a greedy row's throughout."""
        key = (
            proposal.sampled,
            length_bin(depth),
            score_bin(score),
            length_bin(proposal.match),
            length_bin(proposal.last_accepted + 1),
        )
        return [key[:3], key[:4], key]

    def probability(self, depth: int, score: float, proposal: Proposal) -> float:
        p = score
        for cell in self.cells(depth, score, proposal):
            p = (self.accepted.get(cell, 0.0) + self.prior * p) / (self.proposed.get(cell, 0.0) + self.prior)
        return p

    def expected(self, proposal: Proposal) -> list[float]:
        """Each node's calibrated chance of acceptance, in the proposal's order."""
        return [self.probability(d, s, proposal) for d, s in zip(depths(proposal), proposal.scores)]

    def observe(self, proposal: Proposal, accepted: set[int]) -> None:
        """Verification accepted the nodes ``accepted`` of ``proposal`` (a path from the root)."""
        for i, (depth, score) in enumerate(zip(depths(proposal), proposal.scores)):
            for cell in self.cells(depth, score, proposal):
                self.proposed[cell] = self.proposed.get(cell, 0.0) + 1
                self.accepted[cell] = self.accepted.get(cell, 0.0) + (i in accepted)
                if self.proposed[cell] > self.horizon:
                    self.proposed[cell] /= 2
                    self.accepted[cell] /= 2


def best_width(sums: Sequence[Sequence[float]], intercept: float, slope: float) -> tuple[int, float]:
    """Of trees whose first k nodes promise ``sums[row][k]`` accepted tokens (k = 0 .. their nodes, best first), the
    width (root included) with the most expected tokens per second per row, a cycle costing ``intercept + slope *
    width`` seconds, and that rate; the narrowest of equal rates."""
    best = (1, 0.0)
    for width in range(1, max(len(s) for s in sums) + 1):
        tokens = sum(1 + s[min(width, len(s)) - 1] for s in sums)
        rate = tokens / len(sums) / (intercept + slope * width)
        if rate > best[1]:
            best = (width, rate)
    return best


def depths(proposal: Proposal) -> list[int]:
    out: list[int] = []
    for parent in proposal.parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def walk(proposal: Proposal, tokens: Sequence[int]) -> tuple[set[int], bool]:
    """The proposal's nodes along ``tokens`` from the root, and whether all of ``tokens`` lie on them."""
    children = {(p, t): i for i, (p, t) in enumerate(zip(proposal.parents, proposal.tokens))}
    node, path = -1, set()
    for tok in tokens:
        node = children.get((node, tok), -1)
        if node < 0:
            return path, False
        path.add(node)
    return path, True


def accepted_nodes(proposal: Proposal, read: Sequence[int]) -> set[int] | None:
    """The proposal's nodes on the path a cycle accepted, from what the row read after it (the accepted draft tokens,
    then the target's next token); None when those tokens do not follow a path of the proposal: more than one cycle
    passed (a plain one between), so they are not this proposal's verdict."""
    path, whole = walk(proposal, read[:-1])
    return path if whole else None


def prefix(proposal: Proposal, nodes: int) -> Proposal:
    """The first ``nodes`` nodes (parents come first, so any prefix is a trie)."""
    if nodes >= len(proposal):
        return proposal
    return dataclasses.replace(
        proposal, tokens=proposal.tokens[:nodes], parents=proposal.parents[:nodes], scores=proposal.scores[:nodes]
    )


@dataclass
class _Pending:
    proposals: list[Proposal]  # the lookup's nodes the cycle verified, per row
    verified: list[Proposal]  # the whole tree each row verified (the lookup's alone, or merged with a head's)
    started: float | None  # None: the cycle's time is not a lookup cycle's (a head drafted too)
    expected: float  # its rows' accepted lookup nodes as the calibration expected them (unscaled)


class ProposalSizing:
    """Learns, from each cycle, what a lookup's nodes are worth and what each width of tree costs; with ``cuts``, cuts
    each cycle's proposals (best first, so any prefix is what a smaller budget would have given) to the width that
    promises the most tokens per second. Every ``probe_every``-th cycle verifies twice as many nodes and two more, so
    that nodes the cut leaves out go on being measured at a bounded cost.

    The calibration's chances are each measured, but the nodes a cut keeps are those whose chances came out high, and
    a copy's cells move with the text: over lookup-only cycles the chances summed to more than verification accepted
    (on SmolLM2's chat prompts, in a hybrid, 1.6 expected accepted nodes a cycle against 1.2 accepted; on Spec-Bench's
    2.1 against 1.4). ``trust`` is that measured ratio, and every estimate of what a proposal will give is scaled by
    it. A hybrid's merged cycles count too (the lookup's nodes in the merged tree): measured over lookup-only cycles
    alone, a few long proposals that failed set it at 0.3, after which the lookup never led again and nothing
    corrected it."""

    least_trusted = 16  # cycles with a proposal before ``trust`` leaves 1
    trust_smoothing = 1 / 64  # a cycle's accepted nodes vary from none to the whole copy: a long average

    def __init__(self, cuts: bool = True, probe_every: int = 16):
        self.cost, self.calibration = CycleCost(), NodeCalibration()
        self.cuts, self.probe_every = cuts, probe_every
        # per cycle with a proposal, per row: the calibration's expected accepted nodes, and the accepted
        self.predicted, self.achieved = RunningMean(self.trust_smoothing), RunningMean(self.trust_smoothing)
        self._cycles = 0
        self._pending: _Pending | None = None

    def cut(self, proposals: list[Proposal]) -> list[Proposal]:
        self._cycles += 1
        if not self.cuts or not any(len(p) for p in proposals):
            return proposals
        best = self.best(proposals)
        if best is None:
            return proposals
        nodes = best[0] - 1
        if self._cycles % self.probe_every == 0:
            nodes = 2 * nodes + 2
        return [prefix(p, nodes) for p in proposals]

    def best(self, proposals: Sequence[Proposal]) -> tuple[int, float] | None:
        """The tree width (root included) with the most expected tokens per second, and that rate per row; None before
        costs are known."""
        line = self.cost.line(len(proposals))
        if line is None:
            return None
        return best_width([self.cumulative(p) for p in proposals], *line)

    def chances(self, proposal: Proposal) -> list[float]:
        """Each node's chance of acceptance: the calibration's, scaled by ``trust``."""
        trust = self.trust
        return [trust * c for c in self.calibration.expected(proposal)]

    def cumulative(self, proposal: Proposal) -> list[float]:
        """[k]: the expected accepted tokens of the first k nodes (k = 0 .. len)."""
        out = [0.0]
        for p in self.chances(proposal):
            out.append(out[-1] + p)
        return out

    def promised(self, proposal: Proposal, nodes: int) -> float:
        """The accepted nodes the first ``nodes`` of ``proposal`` promise."""
        return self.cumulative(proposal)[min(nodes, len(proposal))]

    def rate(self, proposals: Sequence[Proposal]) -> float | None:
        """Expected tokens per second per row of what ``cut`` makes of ``proposals`` (None before costs are known)."""
        if self.cuts:
            best = self.best(proposals)
            return None if best is None else best[1]
        seconds = self.cost.predict(len(proposals), 1 + max((len(p) for p in proposals), default=0))
        if seconds is None:
            return None
        return sum(1 + self.cumulative(p)[-1] for p in proposals) / len(proposals) / seconds

    @property
    def trust(self) -> float:
        """Accepted nodes over the calibration's expected ones, per cycle with a proposal (1 until ``least_trusted``
        such cycles)."""
        if self.predicted.count < self.least_trusted or not self.predicted.value:
            return 1.0
        return self.achieved.value / self.predicted.value

    def begin(self, proposals: list[Proposal], started: float | None, verified: list[Proposal] | None = None) -> None:
        """The cycle that verifies ``proposals`` started drafting at ``started``; ``verified``: the trees it verifies
        when the proposals are part of them (merged with a head's, whose draft time is not the lookup's: no
        ``started``)."""
        expected = sum(sum(self.calibration.expected(p)) for p in proposals)
        self._pending = _Pending(proposals, verified or proposals, started, expected)

    def settle(self, read: Sequence[Sequence[int]], now: float) -> None:
        """The last begun cycle is over: per row, the tokens it read after it (accepted draft tokens, then the next)."""
        pending, self._pending = self._pending, None
        if pending is None or len(read) != len(pending.proposals):
            return
        if any(accepted_nodes(tree, r) is None for tree, r in zip(pending.verified, read)):
            return
        if pending.started is not None:
            width = 1 + max((len(p) for p in pending.verified), default=0)
            self.cost.observe(len(read), width, now - pending.started)
        achieved = 0
        for proposal, r in zip(pending.proposals, read):
            if len(proposal):
                path = walk(proposal, r[:-1])[0]
                self.calibration.observe(proposal, path)
                achieved += len(path)
        if pending.expected > 0:
            self.predicted.add(pending.expected / len(read))
            self.achieved.add(achieved / len(read))

    def forget_cycle(self) -> None:
        """Rows joined or left: the last cycle's rows and time are not this batch's."""
        self._pending = None
