"""Per-cycle width of a head's dynamic tree: verify only as many of its best nodes as their chances pay for.

A head's dynamic tree is drafted at its configured size, but on a CPU each node the target verifies costs time (on
SmolLM2-135M, 2 cores: 12 tokens cost the target 1.57 times what one does), while the head's path probabilities say
which nodes are likely to be accepted: in one cycle the top three nodes hold nearly all the chance, in another a
confident run deserves every node. ``WidthCut`` keeps, each cycle, the number of best nodes (by path probability,
so any prefix of them is a tree) that maximizes the expected tokens per second over the batch: (1 + the kept
nodes' chances) per row over the predicted seconds of a cycle that wide (``proposal_sizing.best_width``). The cycle
cost is a line in the width fit to the cycles measured (``CycleCost``), the chances are the head's own, scaled by
how many tokens verification has accepted against how many they promised (``trust``), greedy and sampled rows
apart (a sampled row's scores are its coupled chances of drawing each node). Nothing is cut until both are measured.

Verification decides what is emitted, so every cut is lossless; only speed changes.
"""

from __future__ import annotations

import itertools
import math

import torch

from specdec_kit.runtime.decoding.drafting import DraftTree
from specdec_kit.runtime.decoding.proposal_sizing import CycleCost, RunningMean, best_width


def best_first(tree: DraftTree) -> list[list[tuple[int, float]]]:
    """Per row, its draft nodes (root left out, padding too) best first, each with its chance (its path probability);
    ties go to the earlier node (a parent before its children), so every prefix of the order is a tree. In Python:
    a tree of a few dozen nodes sorts faster there than a dozen small tensor operations run."""
    rows = []
    for scores, valid in zip(tree.scores.tolist(), tree.valid.tolist()):
        nodes = sorted((i for i in range(1, len(scores)) if valid[i]), key=lambda i: (-scores[i], i))
        rows.append([(i, math.exp(scores[i])) for i in nodes])
    return rows


def padded(keep: list[int], count: int, tree: DraftTree) -> list[int]:
    """A row's kept nodes and, where it has fewer than ``count``, padding nodes (never accepted) to fill the width."""
    spare = (i for i in range(tree.tokens.shape[1] - 1, 0, -1) if i not in keep)
    return keep + [next(spare) for _ in range(count - len(keep))]


def cut_tree(tree: DraftTree, keep: list[list[int]]) -> DraftTree:
    """The tree of each row's root and its nodes ``keep`` (tree indices, ancestor-closed, as many in every row): its
    ancestor mask and depths read from the tree's, not computed again."""
    nodes = [[0, *sorted(row)] for row in keep]
    parents = tree.parents.tolist()
    new_parents = []
    for row, kept in zip(parents, nodes):
        at = {old: new for new, old in enumerate(kept)}
        new_parents.append([-1] + [at.get(row[old], -1) for old in kept[1:]])
    dev = tree.tokens.device
    index = torch.tensor(nodes, device=dev)
    width = index.shape[1]
    rows_of = index[:, :, None].expand(-1, -1, tree.tree_mask.shape[2])
    mask = torch.gather(torch.gather(tree.tree_mask, 1, rows_of), 2, index[:, None, :].expand(-1, width, -1))
    return DraftTree(
        tokens=torch.gather(tree.tokens, 1, index),
        parents=torch.tensor(new_parents, device=dev),
        valid=torch.gather(tree.valid, 1, index),
        tree_mask=mask,
        depth=torch.gather(tree.depth, 1, index),
        scores=torch.gather(tree.scores, 1, index),
    )


class WidthCut:
    """Learns what a head's trees cost per width and how far their chances hold; ``cut`` keeps each cycle's best
    width. Cycle times are the generation loop's (``observe``): from the draft to the accepted tokens' hand-over."""

    least_trusted = 16  # cycles before ``trust`` leaves 1
    trust_smoothing = 1 / 64

    def __init__(self) -> None:
        self.cost = CycleCost()
        self.predicted: dict[bool, RunningMean] = {}  # per sampled-or-not: chances kept per row and cycle
        self.achieved: dict[bool, RunningMean] = {}  # and the draft tokens verification accepted
        self.kept: tuple[float, bool] | None = None  # the last cut's promise per row and whether its rows sample

    def trust(self, sampled: bool) -> float:
        """Accepted draft tokens over the chances that promised them (1 until ``least_trusted`` cycles)."""
        predicted, achieved = self.predicted.get(sampled), self.achieved.get(sampled)
        if predicted is None or predicted.count < self.least_trusted or not predicted.value:
            return 1.0
        return achieved.value / predicted.value

    def cut(self, tree: DraftTree, sampled: bool) -> DraftTree:
        """The tree cut to the width that promises the most tokens per second (the whole tree before costs are
        measured, or when it has no scores)."""
        self.kept = None
        if tree.scores is None or tree.tokens.shape[1] < 2:
            return tree
        ranked = best_first(tree)
        sums = [list(itertools.accumulate((chance for _, chance in row), initial=0.0)) for row in ranked]
        line = self.cost.line(tree.tokens.shape[0])
        width = tree.tokens.shape[1]
        if line is not None:
            trust = self.trust(sampled)
            width = best_width([[trust * s for s in row] for row in sums], *line)[0]
        self.kept = (sum(row[min(width, len(row)) - 1] for row in sums) / len(sums), sampled)
        if width >= tree.tokens.shape[1]:
            return tree
        return cut_tree(tree, [padded([i for i, _ in row[: width - 1]], width - 1, tree) for row in ranked])

    def observe(self, batch: int, width: int, seconds: float, accepted: float) -> None:
        """The cycle that verified the last cut tree: its rows, width (root included), seconds and mean accepted
        draft tokens per row."""
        self.cost.observe(batch, width, seconds)
        if self.kept is not None:
            promised, sampled = self.kept
            self.predicted.setdefault(sampled, RunningMean(self.trust_smoothing)).add(promised)
            self.achieved.setdefault(sampled, RunningMean(self.trust_smoothing)).add(accepted)
        self.kept = None
