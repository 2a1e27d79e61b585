"""How much to speculate at a given batch size: tree size by load, and an online guard.

Speculation trades extra target work (verifying a tree) for fewer sequential steps. At batch 1 the
target is memory-bound and the trade pays; as the batch grows the verification of every row's tree
becomes compute-bound and the trade stops paying, which is why speculative serving often loses to
plain decoding under load. The policy therefore (1) shrinks the tree as the batch grows
(``schedule``, like TensorRT-LLM's ``draft_len_schedule``) and (2) measures, per batch-size bucket,
the tokens/s of speculative and plain cycles (exponential moving averages, with a periodic probe of
the mode not in use) and runs the faster one, so throughput does not fall below plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.generate import CycleOutcome

Tree = StaticTree | DynamicTreeConfig


def fewest_steps(tree: DynamicTreeConfig) -> DynamicTreeConfig:
    """The same dynamic tree drafted with only the steps its nodes can use: N nodes hold paths of at most N - 1
    draft tokens (a first level and N - 2 expansions), and each deeper step would cost a draft call for nothing."""
    return replace(
        tree,
        total_tokens=tree.total_tokens,
        depth=min(tree.depth, tree.total_tokens - 2),
        top_k=min(tree.top_k, tree.total_tokens - 1),
    )


def shrink(tree: Tree, fraction: float) -> Tree:
    """A tree with about ``fraction`` of ``tree``'s nodes (at least a root and one child); ``tree`` itself at 1. (A
    hybrid draft's tree keeps its source.)

    A static tree keeps its first choices (the likeliest). A dynamic tree whose nodes fit on one path of its depth
    becomes a chain: spread over ``top_k`` beams, few nodes buy second choices near the root instead of depth, and
    every draft call runs ``top_k`` rows. Measured on the demo zoo's GRIFFIN engine with rows in lockstep, a 6-node
    chain gave 1.9x plain decoding at batch 1 where the 6-node two-beam tree gave 1.6x, and a 3-node chain 1.2x at
    batch 16 where the 3-node two-beam tree lost to plain. Larger dynamic trees keep their beams."""
    if fraction >= 1:
        return tree
    if isinstance(tree, DynamicTreeConfig):
        total = max(2, round(tree.total_tokens * fraction))
        if total - 1 <= tree.depth + 1:
            return replace(tree, total_tokens=total, depth=total - 2, top_k=1)
        return fewest_steps(replace(tree, total_tokens=total))
    keep = max(1, round(len(tree.choices) * fraction))
    return StaticTree.from_choices([list(c) for c in tree.choices[:keep]])  # sorted by depth: prefix-closed


def tree_nodes(tree: Tree | None) -> int:
    if tree is None:
        return 1
    return tree.total_tokens if isinstance(tree, DynamicTreeConfig) else tree.buffers.num_nodes


def default_schedule(tree: Tree) -> list[tuple[int, Tree | None]]:
    """(largest batch size, tree) steps: the full tree up to batch 2, a quarter of it up to 16, an eighth up to 32,
    off beyond. (On the demo zoo's GRIFFIN engine a quarter, a 3-node chain, was the fastest tree at 4 and at 16
    rows; the tree's half lost to it at 4.)"""
    return [(2, tree), (16, shrink(tree, 0.25)), (32, shrink(tree, 0.125)), (1 << 30, None)]


def parse_schedule(spec: str, tree: Tree) -> list[tuple[int, Tree | None]]:
    """``"2:1.0,4:0.5,16:0.25,inf:0"``: up to batch B use this fraction of the engine's tree (0 = off)."""
    steps = []
    for part in spec.split(","):
        try:
            size, frac = part.split(":")
            limit = 1 << 30 if size.strip() in ("inf", "*") else int(size)
            fraction = float(frac)
        except ValueError:
            raise ValueError(f"speculation schedule {spec!r}: expected BATCH:FRACTION pairs like 4:0.5,inf:0") from None
        if limit < 1 or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"speculation schedule {spec!r}: batch sizes >= 1 and fractions in [0, 1]")
        steps.append((limit, None if fraction == 0 else shrink(tree, fraction)))
    steps.sort(key=lambda s: s[0])
    if steps[-1][0] < 1 << 30:
        steps.append((1 << 30, steps[-1][1]))
    return steps


class Policy(Protocol):
    """What the scheduler asks of a speculation policy, once per cycle."""

    never_speculates: bool

    def choose(self, batch_size: int) -> Tree | None: ...

    def observe(self, outcome: CycleOutcome, seconds: float) -> None: ...

    def describe(self) -> list[dict]: ...


@dataclass
class _Bucket:
    spec: float | None = None  # tokens/s EMA of speculative cycles
    plain: float | None = None
    spec_n: int = 0
    plain_n: int = 0
    cycles: int = 0
    interval: int = 0  # cycles between probes of the losing mode; doubles while the winner holds
    winner: bool | None = None


@dataclass
class SpeculationPolicy:
    schedule: list[tuple[int, Tree | None]]
    adaptive: bool = True
    warmup: tuple[int, int] = (6, 3)  # speculative, plain cycles measured in a bucket before deciding
    probe_every: int = 10  # then a probe of the losing mode every n cycles, backing off to max_probe_every while
    max_probe_every: int = 320  # the same mode keeps winning (a probe of speculation pays the draft's catch-up)
    smoothing: float = 0.15
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def _index(self, batch_size: int) -> int:
        return next(i for i, (limit, _) in enumerate(self.schedule) if batch_size <= limit)

    def choose(self, batch_size: int) -> Tree | None:
        """The tree for the next cycle, or None for a plain cycle."""
        i = self._index(batch_size)
        tree = self.schedule[i][1]
        if tree is None or not self.adaptive:
            return tree
        b = self.buckets.setdefault(i, _Bucket())
        b.cycles += 1
        if b.spec_n < self.warmup[0]:
            return tree
        if b.plain_n < self.warmup[1]:
            return None
        spec_wins = b.spec >= b.plain
        if spec_wins != b.winner:
            b.winner, b.interval, b.cycles = spec_wins, self.probe_every, 0
        elif b.cycles >= b.interval:
            b.interval, b.cycles = min(2 * b.interval, self.max_probe_every), 0
            return None if spec_wins else tree  # probe the mode that is losing
        return tree if spec_wins else None

    def record(self, batch_size: int, speculative: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        b = self.buckets.setdefault(self._index(batch_size), _Bucket())
        rate = tokens / seconds
        old = b.spec if speculative else b.plain
        new = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate
        if speculative:
            b.spec, b.spec_n = new, b.spec_n + 1
        else:
            b.plain, b.plain_n = new, b.plain_n + 1

    def observe(self, outcome: CycleOutcome, seconds: float) -> None:
        """The scheduler's report of one cycle (the tokens it emitted in ``seconds``); a cycle whose target call also
        read joining prompts is slower than its mode and is left out."""
        if outcome.joined:
            return
        self.record(outcome.rows, outcome.speculative, outcome.emitted, seconds)

    @property
    def never_speculates(self) -> bool:
        return all(tree is None for _, tree in self.schedule)

    def describe(self) -> list[dict]:
        """Per bucket: its batch-size limit, tree size and the measured tokens/s of both modes."""
        out = []
        for i, (limit, tree) in enumerate(self.schedule):
            b = self.buckets.get(i, _Bucket())
            out.append(
                {
                    "max_batch": limit,
                    "tree_tokens": tree_nodes(tree),
                    "spec_tokens_per_s": b.spec,
                    "plain_tokens_per_s": b.plain,
                    "spec_cycles": b.spec_n,
                    "plain_cycles": b.plain_n,
                }
            )
        return out
