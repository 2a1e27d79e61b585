"""Sizing model-free proposals by what they are worth: the cost line, the nodes' calibration, the cut they give, and
a drafter that learns from real cycles to stop verifying what is never accepted, greedy output unchanged.

Times are given to the sizing directly (never measured here), so every assertion is exact.
"""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from specdec_kit.runtime.core.lookup import Proposal, SuffixSettings
from specdec_kit.runtime.core.trees import parse_tree_spec
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.lookup_drafting import LookupDrafter, verified_part
from specdec_kit.runtime.decoding.proposal_sizing import (
    CycleCost,
    NodeCalibration,
    ProposalSizing,
    accepted_nodes,
    prefix,
)


def chain(tokens: list[int], score: float = 1.0) -> Proposal:
    return Proposal(list(tokens), list(range(-1, len(tokens) - 1)), [score] * len(tokens))


def test_the_cost_line_is_fit_to_the_cycles_and_ignores_a_pause():
    cost = CycleCost(prior_weight=1e-9)
    assert cost.predict(1, 5) is None  # nothing measured yet
    for width in (1, 4, 8, 16, 1, 24):
        cost.observe(1, width, 0.020 + 0.002 * width)
    a, b = cost.line(1)
    assert a == pytest.approx(0.020) and b == pytest.approx(0.002)
    cost.observe(1, 1, 5.0)  # a prefill between cycles: far above the line, not a cycle
    assert cost.line(1) == pytest.approx((a, b))
    assert cost.predict(2, 1) is None  # another batch size is measured apart


def test_without_spread_in_widths_the_slope_is_the_prior():
    cost = CycleCost(prior_slope=0.05)
    for _ in range(8):
        cost.observe(1, 1, 0.010)
    a, b = cost.line(1)
    assert a + b == pytest.approx(0.010) and b == pytest.approx(0.05 * (a + b))  # each token adds 5% of one


def test_the_accepted_path_is_read_back_from_the_tokens_and_a_skipped_cycle_is_refused():
    tree = Proposal([7, 8, 9, 5], [-1, 0, 0, 1], [0.9, 0.6, 0.3, 0.5])
    assert accepted_nodes(tree, [7, 8, 4]) == {0, 1}  # 7 then 8 accepted, 4 the target's own
    assert accepted_nodes(tree, [3]) == set()  # nothing accepted
    assert accepted_nodes(tree, [7, 6, 2]) is None  # 6 is no child of 7: a plain cycle passed in between


def test_a_merged_cycle_teaches_the_calibration_what_the_lookup_put_in_the_tree():
    """A hybrid verifies a merged tree: the lookup's nodes in it are judged, those the merge left out are not, and
    the cycle's time (a head's draft in it) is not a lookup cycle's."""
    lookup = Proposal([7, 8, 9], [-1, 0, 1], [1.0, 1.0, 1.0])
    tree = Proposal([7, 8, 3], [-1, 0, -1], [1.0, 1.0, 0.5])  # the merge kept 7 8, the head added 3
    part = verified_part(lookup, tree)
    assert part.tokens == [7, 8] and part.parents == [-1, 0]
    sizing = ProposalSizing()
    sizing.begin([part], None, [tree])
    sizing.settle([[7, 8, 5]], now=1.0)
    assert sum(sizing.calibration.proposed.values()) == 6  # two nodes, each in its three cells
    assert sum(sizing.calibration.accepted.values()) == 6
    assert not sizing.cost.seen
    sizing.begin([part], None, [tree])
    sizing.settle([[3, 9, 5]], now=2.0)  # 9 is no child of 3: not one cycle's verdict
    assert sum(sizing.calibration.proposed.values()) == 6


def test_the_sizing_scales_its_estimates_by_what_its_own_cycles_accepted():
    """Chances measured cell by cell can still over-promise the nodes a cut keeps: the sizing learns the ratio of
    accepted to expected nodes over the cycles that verified its nodes and scales every estimate by it. Merged cycles
    (a head's nodes beside) count too, so a trust that fell while the lookup led recovers once merged trees lead."""
    sizing = ProposalSizing(cuts=False)
    for width in (1, 3, 6, 12):
        sizing.cost.observe(1, width, 0.010)
    sizing.calibration.expected = lambda proposal: [0.8] * len(proposal)  # a chain of 3: 2.4 nodes expected
    proposal = chain([1, 2, 3])
    for cycle in range(ProposalSizing.least_trusted - 1):
        sizing.begin([proposal], started=float(cycle))
        sizing.settle([[1, 9]], now=cycle + 0.01)  # one node accepted
    assert sizing.trust == 1.0  # too few cycles yet
    sizing.begin([proposal], started=99.0)
    sizing.settle([[1, 9]], now=99.01)
    assert sizing.trust == pytest.approx(1 / 2.4)
    assert sizing.rate([proposal]) == pytest.approx((1 + 1.0) / sizing.cost.predict(1, 4))
    tree, timed = chain([1, 2, 3, 4]), list(sizing.cost.seen[1])
    for cycle in range(8 * ProposalSizing.least_trusted):
        sizing.begin([proposal], None, [tree])  # merged cycles that accept the lookup's whole chain
        sizing.settle([[1, 2, 3, 9]], now=float(cycle))
    assert sizing.trust > 0.9 * 3 / 2.4
    assert list(sizing.cost.seen[1]) == timed  # a merged cycle's time is not the lookup's


def test_calibration_learns_that_a_score_overstates_and_that_a_long_match_is_a_copy():
    cal = NodeCalibration(prior=4.0)
    short, long = chain([1, 2, 3]), chain([1, 2, 3])
    short.match, long.match = 1, 12
    assert cal.expected(short) == [1.0, 1.0, 1.0]  # unmeasured: the scores themselves
    for _ in range(96):
        cal.observe(short, {0})  # after a one-token match the first node is accepted, the rest never
        cal.observe(long, {0, 1, 2})  # after a long one, all
    first, second, third = cal.expected(short)
    assert first == pytest.approx(1.0) and second < 0.05 and third < 0.05
    assert min(cal.expected(long)) > 0.95
    unseen = chain([1, 2, 3])
    unseen.match = 3  # no evidence at this match length: the depth and score's, over all matches
    assert cal.expected(unseen)[1] == pytest.approx(0.5, abs=0.02)


def test_calibration_learns_that_a_copy_under_way_goes_on():
    cal = NodeCalibration()
    cold, warm = chain([1, 2]), chain([1, 2])
    warm.last_accepted = 6  # the row's last cycle accepted 6 draft tokens
    for _ in range(64):
        cal.observe(cold, set())
        cal.observe(warm, {0, 1})
    assert max(cal.expected(cold)) < 0.1 and min(cal.expected(warm)) > 0.9


def test_calibration_keeps_sampled_rows_apart_from_greedy_ones():
    """A sampled row accepts a node only where its draw picks the node's token: what sampled rows accepted does not
    lower a greedy row's estimate, nor a greedy row's raise a sampled one's."""
    cal = NodeCalibration()
    greedy, drawn = chain([1, 2]), chain([1, 2])
    drawn.sampled = True
    for _ in range(64):
        cal.observe(greedy, {0, 1})
        cal.observe(drawn, set())
    assert min(cal.expected(greedy)) > 0.9 and max(cal.expected(drawn)) < 0.1


def test_a_lookup_drafter_learns_which_rows_sample_from_the_loop(random_case):
    """The loop hands a lookup drafter its rows' sampling (no draws: it needs none), and each row's proposals say
    it, greedy and sampled rows in one batch; the sampled output is plain sampling's."""
    from specdec_kit.runtime.core.sampling import SamplingParams
    from specdec_kit.runtime.decoding.drafting import NoDrafter

    drafter = LookupDrafter.of(SuffixSettings(min_token_prob=0.0), parse_tree_spec("dynamic:8:4:2"))
    assert drafter.couples_draws and drafter.coupled_depth == 0
    seen: list[list[bool]] = []
    propose = drafter.proposals

    def recorded(tokens, counts):
        roots, found = propose(tokens, counts)
        seen.append([p.sampled for p in found])
        return roots, found

    drafter.proposals = recorded
    prompts = random_case.prompts[:2]
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=7)]
    out = SpeculativeGenerator(random_case.target, drafter, eos_token_ids=[]).generate(prompts, 24, params)
    assert seen and all(rows == [False, True] for rows in seen if len(rows) == 2)
    plain = SpeculativeGenerator(random_case.target, NoDrafter(), eos_token_ids=[]).generate(prompts, 24, params)
    assert [r.tokens for r in out] == [r.tokens for r in plain]


def sized(acceptance: list[float], slope: float, nodes: int = 12) -> tuple[int, float]:
    """The width a sizing picks for a chain of ``nodes`` whose k-th node is accepted with ``acceptance[k]``, on a
    line of 10 ms + ``slope`` per token."""
    sizing = ProposalSizing()
    for width in (1, 3, 6, 12, 1, 9):
        sizing.cost.observe(1, width, 0.010 + slope * width)
    sizing.calibration.expected = lambda proposal: acceptance[: len(proposal)]
    return sizing.best([chain(list(range(nodes)))])


def test_the_cut_weighs_acceptance_against_cost():
    assert sized([0.0] * 12, slope=0.002)[0] == 1  # nothing is accepted: plain decoding
    assert sized([0.9] * 12, slope=0.0)[0] == 13  # free verification: the whole chain
    width, rate = sized([0.5, 0.3, 0.1, 0.05, 0.01] + [0.0] * 7, slope=0.002)
    assert 2 <= width <= 4  # the first nodes pay for their 2 ms, the later ones not
    assert rate > 1 / 0.012


def test_every_so_often_more_than_the_cut_is_verified_to_keep_measuring_it():
    sizing = ProposalSizing(probe_every=4)
    for width in (1, 2, 4, 8):
        sizing.cost.observe(1, width, 0.010 + 0.005 * width)
    for _ in range(200):
        sizing.calibration.observe(chain([1, 2, 3, 4]), set())
    widths = [len(sizing.cut([chain([1, 2, 3, 4])])[0]) for _ in range(8)]
    assert widths == [0, 0, 0, 2, 0, 0, 0, 2]  # a probe: twice the cut and two more nodes
    assert prefix(chain([1, 2, 3]), 2).tokens == [1, 2]


class SteepCost(CycleCost):
    """A machine where each more token verified costs half a one-token cycle (real times are not asserted on)."""

    def __init__(self):
        super().__init__()
        for width in (1, 2, 4, 8):
            super().observe(1, width, 0.010 * (1 + 0.5 * (width - 1)))

    def observe(self, batch: int, width: int, seconds: float) -> None:
        pass


def test_a_sized_drafter_learns_from_real_cycles_cuts_where_width_costs_and_stays_lossless(random_case):
    """Real cycles on a random target (whose text rarely repeats) teach the sizing the cost line and the nodes'
    acceptance; where width is dear, it verifies less than whole proposals; the output is the target's greedy
    decoding throughout."""
    drafter = LookupDrafter.of(SuffixSettings(min_token_prob=0.0), parse_tree_spec("dynamic:16:11:2"))
    assert drafter.sizing.cuts
    generator = SpeculativeGenerator(random_case.target, drafter, eos_token_ids=[])
    budget, prompts = 48, random_case.prompts[:4]
    reference = [hf_greedy(random_case.hf, p, budget) for p in prompts]
    assert [generator.generate([p], budget)[0].tokens for p in prompts] == reference
    assert drafter.sizing.cost.line(1) is not None, "no cycle's time was measured"
    assert sum(drafter.sizing.calibration.proposed.values()) > 0, "no verdict reached the calibration"

    drafter.sizing.cost = SteepCost()
    shortened = []
    cut = drafter.sizing.cut

    def recorded(proposals: list[Proposal]) -> list[Proposal]:
        out = cut(proposals)
        shortened.append(sum(map(len, out)) < sum(map(len, proposals)))
        return out

    drafter.sizing.cut = recorded
    assert [generator.generate([p], budget)[0].tokens for p in prompts] == reference
    assert any(shortened), "the sizing never cut a proposal"
