"""The per-cycle width cut of a head's tree: which nodes it keeps, and that decoding stays lossless under it (greedy
output identical to the target's, sampled output plain sampling's for each seed and distributed as the target's)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import chi_square_pvalue
from test_greedy_lossless import DYNAMIC, build_drafter
from test_sampling_distribution import (
    ALPHA,
    PROMPT,
    SAMPLES,
    VOCAB,
    drafter_for,
    exact_distributions,
    run_mixed,
    six_token_target,
)

from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.decoding.drafting import DraftTree, NoDrafter
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.proposal_sizing import CycleCost
from specdec_kit.runtime.decoding.width_cut import WidthCut, best_first, cut_tree
from specdec_kit.runtime.models.target import TargetModel


@pytest.fixture(scope="module")
def small_target() -> TargetModel:
    return six_token_target()


class FixedCost(CycleCost):
    """A cycle cost that does not depend on this machine's timing: ``a + b * width`` seconds."""

    def __init__(self, a: float, b: float):
        super().__init__()
        self.fixed = (a, b)

    def line(self, batch: int) -> tuple[float, float]:
        return self.fixed


class RecordingCut(WidthCut):
    """A width cut at a fixed cost that keeps every cycle's (drafted width, kept width)."""

    def __init__(self, a: float = 1.0, b: float = 0.5):
        super().__init__()
        self.cost, self.widths = FixedCost(a, b), []

    def cut(self, tree: DraftTree, sampled: bool) -> DraftTree:
        out = super().cut(tree, sampled)
        self.widths.append((tree.tokens.shape[1], out.tokens.shape[1]))
        return out


def hand_tree() -> DraftTree:
    """Root 0; 1 (p .6) and 2 (p .3) under it; 3 (.5) under 1, 4 (.05) under 2, 5 (.4) under 3; a second row with
    the same shape and other chances (2 the best first node)."""
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]] * 2)
    chances = torch.tensor([[1.0, 0.6, 0.3, 0.5, 0.05, 0.4], [1.0, 0.2, 0.7, 0.1, 0.6, 0.05]])
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    return DraftTree.from_parents(tokens, parents, scores=chances.log())


def test_best_first_orders_nodes_by_chance_and_every_prefix_is_a_tree():
    ranked = best_first(hand_tree())
    assert [[i for i, _ in row] for row in ranked] == [[1, 3, 5, 2, 4], [2, 4, 1, 3, 5]]
    assert [c for _, c in ranked[0]] == pytest.approx([0.6, 0.5, 0.4, 0.3, 0.05])
    parents = hand_tree().parents
    for row in range(2):
        for k in range(1, 6):
            kept = {i for i, _ in ranked[row][:k]} | {0}
            assert all(int(parents[row, n]) in kept for n in kept if n), (row, k)


def test_cut_tree_is_the_tree_of_the_kept_nodes():
    tree = hand_tree()
    cut = cut_tree(tree, [[i for i, _ in row[:3]] for row in best_first(tree)])
    # row 0 keeps 1, 3, 5 (a chain); row 1 keeps 2, 4, 1 (in tree order 1, 2, 4: 4's parent 2 is node 2 of the cut)
    assert cut.tokens.tolist() == [[10, 11, 13, 15], [20, 21, 22, 24]]
    assert cut.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, 0, 2]]
    direct = DraftTree.from_parents(cut.tokens, cut.parents)
    assert torch.equal(cut.tree_mask, direct.tree_mask)
    assert torch.equal(cut.depth, direct.depth)
    assert cut.depth.tolist() == [[0, 1, 2, 3], [0, 1, 1, 2]]
    torch.testing.assert_close(cut.scores.exp(), torch.tensor([[1.0, 0.6, 0.5, 0.4], [1.0, 0.2, 0.7, 0.6]]))


def test_rows_with_padding_are_cut_to_one_width():
    """A row with fewer real nodes than the width keeps padding (never accepted) in the places left."""
    tree = hand_tree()
    valid = tree.valid.clone()
    valid[1, 3:] = False  # row 1: only nodes 1 and 2 are real
    padded_tree = DraftTree.from_parents(tree.tokens, torch.where(valid, tree.parents, -1), valid, tree.scores)
    cut = WidthCut()
    cut.cost = FixedCost(1.0, 0.01)
    assert cut.cut(padded_tree, sampled=False).tokens.shape[1] == 6  # the whole tree: nothing to cut
    cut.cost = FixedCost(1.0, 0.1)
    out = cut.cut(padded_tree, sampled=False)
    assert out.tokens.shape[1] == 4  # (1 + (1.5 + 0.9) / 2) / 1.4 beats width 3's 1.538 and width 5's 1.567
    assert out.valid[1].sum() == 3 and out.valid[0].all()
    direct = DraftTree.from_parents(out.tokens, out.parents, out.valid)
    assert torch.equal(out.tree_mask, direct.tree_mask)


def test_the_width_that_pays_is_kept():
    """Rate (1 + kept chances, averaged over rows) / (a + b * width): a costly node must carry its chance."""
    tree = hand_tree()
    cheap, dear = WidthCut(), WidthCut()
    cheap.cost, dear.cost = FixedCost(1.0, 0.01), FixedCost(1.0, 3.0)
    assert cheap.cut(tree, sampled=False).tokens.shape[1] == 6  # every node pays when nodes cost next to nothing
    assert dear.cut(tree, sampled=False).tokens.shape[1] == 1  # nodes costing three plain steps each never pay
    middle = WidthCut()
    middle.cost = FixedCost(1.0, 0.3)
    sums = [[0, 0.6, 1.1, 1.5, 1.8, 1.85], [0, 0.7, 1.3, 1.5, 1.6, 1.65]]
    rates = [(2 + sum(s[w - 1] for s in sums)) / 2 / (1.0 + 0.3 * w) for w in range(1, 7)]
    expected = 1 + max(range(6), key=lambda i: rates[i])
    assert middle.cut(tree, sampled=False).tokens.shape[1] == expected
    assert 1 < expected < 6


def test_trust_scales_the_chances_by_what_verification_accepted():
    cut = WidthCut()
    cut.cost = FixedCost(1.0, 0.5)
    for _ in range(cut.least_trusted):  # the head promised 1.5 tokens a cycle, verification accepted 0.75
        cut.kept = (1.5, False)
        cut.observe(1, 4, 0.02, 0.75)
    assert cut.trust(False) == pytest.approx(0.5)
    assert cut.trust(True) == 1.0  # sampled rows' cycles are counted apart
    assert cut.cut(hand_tree(), sampled=True).tokens.shape[1] == 3  # chances as the head gives them
    assert cut.cut(hand_tree(), sampled=False).tokens.shape[1] == 1  # halved, no node pays


def test_nothing_is_cut_before_cycles_are_timed():
    cut = WidthCut()
    assert cut.cut(hand_tree(), sampled=False).tokens.shape[1] == 6
    for width in (6, 6, 6, 6):
        cut.observe(1, width, 0.03, 1.0)
    assert cut.cost.line(1) is not None


@pytest.mark.parametrize("quality", ["good", "random"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_identical_under_the_cut(predictable_case, random_case, quality, batch):
    case = predictable_case if quality == "good" else random_case
    width_cut = RecordingCut(1.0, 0.1)
    gen = SpeculativeGenerator(case.target, build_drafter("griffin", quality, case.target), width_cut=width_cut)
    prompts = case.prompts[:8] if batch == 1 else case.prompts
    for start in range(0, len(prompts), batch):
        for res, ref in zip(
            gen.generate(prompts[start : start + batch], 64), case.references[start : start + batch], strict=True
        ):
            assert res.tokens == ref
    kept = [k for _, k in width_cut.widths]
    assert all(w == DYNAMIC.total_tokens for w, _ in width_cut.widths)
    assert min(kept) < DYNAMIC.total_tokens, "the cut never cut: the test would not see a cut tree verified"
    if quality == "good":
        assert max(kept) > 2  # a draft that predicts well keeps deep trees


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_sampled_distribution_under_the_cut(small_target, setting):
    params = [SamplingParams(seed=20_000 + i, **setting) for i in range(SAMPLES)]
    width_cut = RecordingCut(1.0, 0.2)
    drafter = drafter_for("griffin-oracle-vocab-dynamic", small_target)
    gen = SpeculativeGenerator(small_target, drafter, eos_token_ids=[], width_cut=width_cut)
    seqs = torch.tensor([r.tokens for r in gen.generate([PROMPT] * SAMPLES, 3, params)])
    joint, marginal3 = exact_distributions(small_target, SamplingParams(**setting))
    observed12 = torch.zeros(VOCAB, VOCAB)
    observed12.index_put_((seqs[:, 0], seqs[:, 1]), torch.ones(SAMPLES), accumulate=True)
    p12 = chi_square_pvalue(observed12, joint)
    p3 = chi_square_pvalue(torch.bincount(seqs[:, 2], minlength=VOCAB), marginal3)
    assert min(p12, p3) > ALPHA / 2, f"p-values {p12:.2e}, {p3:.2e}"
    kept = {k for _, k in width_cut.widths}
    assert 1 < min(kept) < 10, f"widths kept {sorted(kept)}: cut trees, not the root alone, should be verified"


def test_a_seed_gives_plain_samplings_tokens_under_the_cut(small_target):
    count, budget = 24, 10
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=7 * i - 50) for i in range(count)]
    prompts = [PROMPT + [i % VOCAB] for i in range(count)]
    plain = SpeculativeGenerator(small_target, NoDrafter(), eos_token_ids=[]).generate(prompts, budget, params)
    width_cut = RecordingCut(1.0, 0.2)
    gen = SpeculativeGenerator(
        small_target, drafter_for("eagle-random-dynamic", small_target), eos_token_ids=[], width_cut=width_cut
    )
    assert [r.tokens for r in gen.generate(prompts, budget, params)] == [r.tokens for r in plain]
    assert run_mixed(gen, prompts[:6], budget, params[:6]) == [r.tokens for r in plain[:6]]
    assert math.isfinite(width_cut.trust(True))
