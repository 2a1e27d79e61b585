"""The cost-based speculation policy: from measured target costs (a curve over the tokens of one call), draft costs
and acceptance it picks, per batch size, the tree or plain decoding that gives the most tokens/s; and a real server
running it stays lossless under concurrent streams."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import httpx
import pytest

from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.generate import CycleOutcome
from specdec_kit.serving.cost_policy import CostPolicy, Ema, candidate_trees, holds, interpolate
from specdec_kit.serving.policy import tree_nodes

TREE = DynamicTreeConfig(total_tokens=16, depth=3, top_k=4)
ACCEPTED = {16: 2.0, 8: 1.6, 4: 1.2, 2: 0.7}  # accepted draft tokens per row, by tree size


def verify_seconds(tokens: int, rows: int) -> float:
    """A target that costs the same up to 16 tokens per call (memory-bound), then grows with them (compute-bound),
    and a little more for each row (its cache is read)."""
    return 0.010 + 0.0005 * max(0, tokens - 16) + 0.0004 * rows


CANDIDATES = candidate_trees(TREE)
STEPS = {tree_nodes(t): t.depth + 1 for t in CANDIDATES}  # draft calls per cycle: a first level, then expansions


def draft_seconds(batch: int, nodes: int) -> float:
    """Each draft call dearer with more rows; a small tree makes fewer calls."""
    return (0.001 + 0.003 * batch / 8) * STEPS[nodes]


def cost_policy(**kwargs) -> CostPolicy:
    return CostPolicy(CANDIDATES, **kwargs)


def rate(batch: int, nodes: int) -> float:
    if nodes == 1:
        return batch / verify_seconds(batch, batch)
    return batch * (1 + ACCEPTED[nodes]) / (verify_seconds(batch * nodes, batch) + draft_seconds(batch, nodes))


def drive(
    policy: CostPolicy,
    batch: int,
    cycles: int,
    overhead: float = 0.0,
    prefill_every: int = 0,
    unlucky: int = 0,
    draft_cost: Callable[[int, int], float] = draft_seconds,
    per_token: float = 0.0,
) -> list[int]:
    """Run the policy against the modelled machine at one batch size; the tree sizes it chose (1 = plain). Each cycle
    also costs ``overhead`` outside draft and target. The first speculative cycle after plain ones also runs the draft
    over the context they skipped (a tenth of a step per position: one call over more tokens), and every
    ``prefill_every`` cycles a request joins whose 30-token prompt the draft reads at its next speculative cycle.
    The largest tree's first ``unlucky`` cycles accept nothing (text the draft predicts badly). Handing out each token
    costs ``per_token`` more."""
    chosen, skipped, largest, owed = [], 0, 0, dict.fromkeys(ACCEPTED, 0.0)
    for i in range(cycles):
        if prefill_every and i % prefill_every == 0:
            skipped += 30
        tree = policy.choose(batch)
        nodes = tree_nodes(tree)
        draft = draft_cost(batch, nodes) * (1 + 0.1 * skipped) if tree is not None else 0.0
        caught_up = tree is not None and skipped > 0
        skipped = 0 if tree is not None else skipped + 1
        accepted = 0
        if tree is not None:  # whole tokens over the batch, their mean ACCEPTED per row
            owed[nodes] += ACCEPTED[nodes] * batch
            accepted, owed[nodes] = int(owed[nodes]), owed[nodes] - int(owed[nodes])
        if nodes == max(ACCEPTED):
            largest += 1
            accepted *= largest > unlucky
        outcome = CycleOutcome(
            tree is not None,
            batch,
            batch + accepted,
            (nodes - 1) * batch,
            accepted,
            [],
            draft,
            verify_seconds(batch * nodes, batch),
            caught_up,
        )
        policy.observe(outcome, outcome.draft_s + outcome.verify_s + overhead + per_token * outcome.emitted)
        chosen.append(nodes)
    return chosen


def test_candidates_are_the_engine_tree_and_smaller_ones():
    assert [tree_nodes(t) for t in candidate_trees(TREE)] == [16, 8, 4, 2]
    assert [t.top_k for t in candidate_trees(TREE)] == [4, 4, 1, 1]  # the small ones are chains
    big, half, chain4, chain2 = candidate_trees(TREE)
    assert holds(big, half) and holds(chain4, chain2)  # a smaller tree's paths are among a larger one's ...
    assert not holds(half, chain4) and not holds(chain2, chain4)  # ... but not a chain's among a wider tree's
    assert [tree_nodes(t) for t in candidate_trees(DynamicTreeConfig(3, 2, 2))] == [3, 2]


def test_interpolation_follows_the_measured_curve():
    points = {1: Ema(1.0, 3), 9: Ema(2.0, 3)}
    assert interpolate(points, 5) == pytest.approx(1.5)
    assert interpolate(points, 17) == pytest.approx(3.0)  # on along the last segment
    assert interpolate({4: Ema(2.0, 1)}, 8) == 2.0  # one point: that value (optimistic, so it gets measured)
    assert interpolate(points, 0) == 1.0 and interpolate({}, 3) is None


def test_it_picks_the_fastest_candidate_for_each_batch_size():
    best = {b: max([1, 2, 4, 8, 16], key=lambda n: rate(b, n)) for b in (1, 4, 16)}
    assert best == {1: 16, 4: 2, 16: 1}  # the modelled machine: a big tree alone, the smallest at 4, plain at 16
    policy = cost_policy(warmup=3, probe_every=25)
    for batch in (1, 4, 16):
        chosen = drive(policy, batch, 150)
        settled = chosen[-100:]
        assert settled.count(best[batch]) >= 95, (batch, settled)  # the best, but for the runner-up's probes
    again = drive(policy, 1, 100)[-50:]  # the load falls: back to the big tree, from what it measured before
    assert again.count(16) >= 47
    described = {d["tree_tokens"]: d for d in policy.describe()}
    assert described[16]["accepted_per_row"] == pytest.approx(2.0)
    assert described[1]["predicted_tokens_per_s"][16] == pytest.approx(rate(16, 1))


def test_switching_costs_neither_skew_the_draft_cost_nor_keep_being_paid():
    """Catch-up cycles (after plain ones, or over a joining request's prompt) stay out of the draft's cost, and the
    probes of candidates that keep losing back off; candidates predicted at less than half the leader's rate are not
    probed, only measured again when their estimates are ``stale_after`` cycles old."""
    policy = cost_policy(warmup=3, probe_every=25)
    chosen = drive(policy, 16, 1000)
    assert policy.draft[1][16].value == pytest.approx(draft_seconds(16, 16))  # a cycle's cost, not a catch-up's
    settled = chosen[100:]  # plain decoding; the 2- and 4-node trees (0.89x, 0.59x of it) are probed, seldom
    assert settled.count(2) + settled.count(4) <= 10, settled
    # the 8- and 16-node trees (0.34x, 0.2x) only as stale re-measurements: a catch-up and a counted cycle, at most
    # once per 400 cycles each
    assert 0 < settled.count(8) + settled.count(16) <= 2 * 3 * 3, settled
    drive(policy, 1, 100)
    chosen = drive(policy, 4, 1000)
    leader = max(set(chosen[100:]), key=chosen[100:].count)
    assert leader in (2, 4)  # the model's best two, 4% apart: the first to lead keeps the lead (``hold``)
    probes = [i for i, n in enumerate(chosen[100:]) if n != leader]
    # every other candidate is within half the leader's rate here (the slowest, the 16-node tree, at 0.57x): each probed
    assert {chosen[100 + i] for i in probes} == {1, 2, 4, 8, 16} - {leader}
    assert 3 <= len(probes) <= 16, probes  # 36 at a fixed interval of 25
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0], probes  # further apart after each round
    assert drive(policy, 1, 200, prefill_every=20)[-50:].count(16) >= 47  # a big tree alone still wins
    assert policy.draft[1][1].value == pytest.approx(draft_seconds(1, 16))  # prompts read by the draft left out too
    # ... but averaged over the cycles as a cost of speculating: 3 steps' worth every 20 cycles
    assert policy.reading[1].value == pytest.approx(3 * draft_seconds(1, 16) / 20, rel=0.5)


def test_an_unlucky_start_buries_no_tree():
    """A larger tree whose first cycles met text the draft predicts badly is taken to accept at least what a smaller
    one of its kind measured, and wins once its own acceptance shows. (A drafter whose cost is the same for every
    tree, as Medusa's one call.)"""
    policy = cost_policy(warmup=3, probe_every=25)
    one_call = lambda batch, nodes: draft_seconds(batch, 16)  # noqa: E731
    drive(policy, 1, 20, unlucky=8, draft_cost=one_call)
    assert policy.accepted[1].value < policy.accepted[2].value  # the largest tree measured worse than the next
    assert policy.acceptance(1) == policy.accepted[2].value
    assert drive(policy, 1, 200, draft_cost=one_call)[-100:].count(16) >= 95
    assert policy.accepted[1].value > policy.accepted[2].value


def test_a_tree_first_measured_on_a_busy_machine_leads_once_its_probes_measure_it_again():
    """The best tree's first cycles cost three times their draft (the machine busy streaming to clients as a batch
    filled): predicted behind the runner-up, it is still probed, and each probe after a long gap weighs more than
    one sample of a stream, so its estimate follows what it costs now and it takes the lead."""
    busy = [True]
    draft_cost = lambda batch, nodes: draft_seconds(batch, nodes) * (3 if busy[0] and nodes == 16 else 1)  # noqa: E731
    policy = cost_policy(warmup=3, probe_every=25)
    drive(policy, 1, 30, draft_cost=draft_cost)
    busy[0] = False
    assert policy.predicted_rate(1, 1) < 0.8 * policy.predicted_rate(2, 1)  # behind the 8-node tree, the runner-up
    assert drive(policy, 1, 400, draft_cost=draft_cost)[-100:].count(16) >= 95


def test_trees_measured_while_the_machine_was_busy_are_measured_again_and_lead_once_it_is_not():
    """Every tree's first cycles cost far more than plain decoding's (other work on the cores), too far behind to be
    probed; their estimates age, so each is measured again (a catch-up cycle, then one that counts) once they are
    ``stale_after`` cycles old, rarely enough to cost little while the machine stays busy, and the best tree leads
    again once it is not."""
    busy = [True]
    draft_cost = lambda batch, nodes: draft_seconds(batch, nodes) * (30 if busy[0] else 1)  # noqa: E731
    policy = cost_policy(warmup=3, probe_every=25, stale_after=200)
    chosen = drive(policy, 1, 1000, draft_cost=draft_cost)
    assert all(policy.predicted_rate(k, 1) < policy.probe_within * policy.predicted_rate(0, 1) for k in (1, 2, 3, 4))
    assert chosen[-500:].count(1) >= 0.95 * 500  # plain decoding, with the trees' rare re-measurements
    assert 0 < sum(n > 1 for n in chosen[100:]) < 0.05 * 900
    busy[0] = False
    assert drive(policy, 1, 600, draft_cost=draft_cost)[-100:].count(16) >= 95


def test_a_chain_tells_what_each_shorter_chain_would_have_accepted():
    """A chain drafts the first tokens of every longer chain, so its cycle gives each shorter chain's acceptance on
    the same text (its accepted depth capped at the shorter length); trees that branch get nothing from it."""
    trees = candidate_trees(DynamicTreeConfig(total_tokens=6, depth=4, top_k=1)) + [TREE]
    assert [tree_nodes(t) for t in trees] == [6, 3, 2, 16]
    policy = CostPolicy(trees)
    policy._last = 1  # the cycle below ran the 6-node chain
    # four rows accepting 5, 3, 1 and 0 draft tokens: 3 rows reached depth 1, 2 rows depths 2 and 3, 1 row 4 and 5
    policy.observe(CycleOutcome(True, 4, 13, 20, 9, [3, 2, 2, 1, 1], 0.01, 0.02), 0.03)
    assert policy.accepted[1].value == pytest.approx(9 / 4)
    assert policy.accepted[2].value == pytest.approx((2 + 2 + 1 + 0) / 4)  # the 3-node chain: 2 draft tokens
    assert policy.accepted[3].value == pytest.approx((1 + 1 + 1 + 0) / 4)  # the 2-node chain: 1
    assert 4 not in policy.accepted  # the 16-node tree branches: a chain's path says nothing of its siblings


def test_the_overhead_of_a_cycle_counts_against_candidates_that_need_more_cycles():
    """What a cycle costs besides draft and target (streaming, bookkeeping) is paid per cycle: it makes a tree that
    yields more tokens per cycle worth it where plain decoding would win without it."""
    overhead, batch = 0.02, 16
    assert max([1, 2, 4, 8, 16], key=lambda n: rate(batch, n)) == 1  # without the overhead, plain at batch 16
    with_overhead = {
        n: batch * (1 + ACCEPTED.get(n, 0.0)) / (batch / rate(batch, n) * (1 + ACCEPTED.get(n, 0.0)) + overhead)
        for n in (1, 2, 4, 8, 16)
    }
    assert max(with_overhead, key=with_overhead.get) == 2
    policy = cost_policy(warmup=3, probe_every=25)
    assert drive(policy, batch, 150, overhead=overhead)[-100:].count(2) >= 95
    assert policy.overhead[batch].value == pytest.approx(overhead)
    assert policy.predicted_rate(4, batch) == pytest.approx(with_overhead[2], rel=0.02)


def test_a_candidates_own_cycles_at_a_batch_size_outweigh_the_model():
    """Streaming costs per token: a cycle of a tree, yielding more tokens, costs more outside draft and target than
    a plain one, which one overhead per batch size cannot tell apart. Each candidate's whole cycles at the batch size
    itself show it, and the candidate truly fastest wins."""
    batch, per_token = 16, 0.004
    true_rate = {n: 1 / (1 / rate(batch, n) + per_token) for n in (1, 2, 4, 8, 16)}
    assert max(true_rate, key=true_rate.get) == 1
    policy = cost_policy(warmup=3, probe_every=25)
    assert drive(policy, batch, 200, per_token=per_token)[-100:].count(1) >= 95
    for k, n in enumerate((1, 16, 8, 4, 2)):
        if policy.measured_at(k, batch):
            assert policy.predicted_rate(k, batch) == pytest.approx(true_rate[n], rel=0.02)


def test_a_batch_size_near_measured_ones_is_predicted_and_one_far_beyond_them_is_measured():
    """Costs are extrapolated only up to ``reach`` times the largest size measured: at 16 rows after 1 and 4 the
    draft's cost and the target's over 16 x 16 tokens are measured, not guessed from calls 4 times smaller."""
    policy = cost_policy(warmup=3, settle=10)
    drive(policy, 1, 60)
    drive(policy, 4, 60)
    assert all(policy.predicted_rate(k, 16) is None for k in range(1, len(CANDIDATES) + 1))
    chosen = drive(policy, 16, 12)  # the trees' cycles at 16 ...
    assert set(chosen) == {16, 8, 4, 2} and not policy.measured_at(0, 16)
    # ... tell plain decoding's cost at 16 rows: their calls' cost there, less the shared curve's fall to 16 tokens
    assert policy.predicted_rate(0, 16) == pytest.approx(rate(16, 1), rel=0.25)  # (the curve mixes row counts)
    chosen += drive(policy, 16, 68)
    assert all(policy.measured_at(k, 16) for k in range(len(CANDIDATES) + 1))
    assert chosen[-30:].count(1) >= 28  # plain decoding, the fastest at 16 on the modelled machine
    assert policy.predicted_rate(0, 16) == pytest.approx(rate(16, 1))  # 16 rows x 1 token, not 1 row x 16
    # between measured sizes the model predicts: the first cycles at 8 run the best it predicts, measuring nothing
    predicted = {k: policy.predicted_rate(k, 8) for k in range(len(CANDIDATES) + 1)}
    assert None not in predicted.values()
    best = max(predicted, key=lambda k: predicted[k] * (policy.margin if k == 0 else 1.0))
    assert set(drive(policy, 8, 10)) == {policy.nodes(best)}


def test_batch_sizes_beside_a_measured_one_are_predicted_from_its_cycles_not_explored():
    """At many streams requests finish apart, so the batch passes through sizes just below its largest for a few
    cycles each. Whole cycles at 16 rows predict 15 and 14 (``pool``): they run what leads at 16 at once; each size
    on its own (``pool=0``), the policy spends cycles there measuring candidates it already knows beside it."""
    explored = {}
    for pool in (0.25, 0.0):
        policy = cost_policy(warmup=3, settle=10, pool=pool)
        drive(policy, 16, 100)
        leader = policy.nodes(policy.leader[16])
        transient = drive(policy, 15, 20) + drive(policy, 14, 20)
        explored[pool] = sum(n != leader for n in transient)
        if pool:
            for k in range(len(CANDIDATES) + 1):  # predicted from the cycles at 16, moved by the target's curve
                assert policy.predicted_rate(k, 15) == pytest.approx(policy.predicted_rate(k, 16) * 15 / 16, rel=0.1)
    assert explored[0.25] == 0 and explored[0.0] >= 10, explored


def test_a_cycle_that_also_read_joining_prompts_is_no_sample_of_the_targets_or_the_cycles_cost():
    """A target call that read joining prompts beside the trees costs more than the candidate's step: its time joins
    neither the target's curve nor the candidate's whole-cycle estimate; its acceptance still counts."""
    policy = cost_policy(warmup=3)
    drive(policy, 4, 40)
    tree = policy.choose(4)
    k = policy._last
    verify, cycles = {t: e.value for t, e in policy.verify.items()}, {b: e.value for b, e in policy.cycle_at[k].items()}
    accepted = policy.accepted[k].n if k else 0
    nodes = tree_nodes(tree)
    outcome = CycleOutcome(tree is not None, 4, 8, 4 * (nodes - 1), 4, [], 0.002, 1.0)
    outcome.joined = 2
    policy.observe(outcome, 1.5)
    assert {t: e.value for t, e in policy.verify.items()} == verify
    assert {b: e.value for b, e in policy.cycle_at[k].items()} == cycles
    assert not k or policy.accepted[k].n == accepted + 1


def test_plain_decoding_is_measured_at_every_batch_size_that_recurs():
    """Speculation answers to plain decoding: however far behind the model puts it (here after a call over 16 tokens
    measured while the machine was busy), plain decoding is measured at a batch size that recurs, and wins there
    where it is fastest."""
    policy = cost_policy(warmup=3, settle=10)
    for batch in (1, 4, 8):
        drive(policy, batch, 60)
    policy.verify[16] = Ema(1.0, 100)
    assert policy.predicted_rate(0, 16) < 0.1 * max(filter(None, (policy.predicted_rate(k, 16) for k in range(1, 5))))
    chosen = drive(policy, 16, 100)
    assert policy.measured_at(0, 16) and chosen[-30:].count(1) >= 28


def test_without_trees_it_never_speculates():
    policy = CostPolicy([])
    assert policy.never_speculates and policy.choose(4) is None


@pytest.mark.slow
def test_a_server_choosing_trees_by_cost_stays_lossless(demo_engine):
    from server_helpers import Server

    srv = Server(demo_engine, "--speculation", "cost", "--max-num-seqs", "8")
    try:
        client = srv.client()
        prompts = [f"def f{i}(x):" for i in range(8)]

        def complete(p: str) -> str:
            return client.completions.create(model="demo", prompt=p, max_tokens=24, temperature=0).choices[0].text

        expected = [complete(p) for p in prompts]
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, prompts)) == expected
        info = httpx.get(srv.url + "/server_info").json()
        assert info["dtype"] == "float32" and info["weights"] == {"target": "float", "draft": "float"}
        sizes = [c["tree_tokens"] for c in info["speculation"]]
        assert sizes[0] == 1 and sizes[1:] == sorted(sizes[1:], reverse=True) and len(sizes) >= 3
        assert any(c["accepted_per_row"] for c in info["speculation"][1:])  # trees were run and measured
    finally:
        srv.stop()


def test_a_hybrid_drafts_parts_are_candidates_of_their_own():
    """The merged trees, the head's alone and the model-free draft's alone are each measured and never stand in for one
    another (a tree of one part holds no path of another's); the measured widths of a model-free draft's trees, not
    their budgets, are what its cycles are taken to verify."""
    from specdec_kit.runtime.core.trees import HEAD, HYBRID, LOOKUP, SourcedTree
    from specdec_kit.serving.cost_policy import hybrid_candidates

    trees = hybrid_candidates(DynamicTreeConfig(12, 3, 3), DynamicTreeConfig(24, 15, 2))
    assert {t.source for t in trees} == {HYBRID, HEAD, LOOKUP}
    assert not holds(SourcedTree(12, 3, 3, source=HYBRID), SourcedTree(12, 3, 3, source=HEAD))
    assert holds(SourcedTree(12, 3, 3, source=HEAD), SourcedTree(6, 3, 3, source=HEAD))
    policy = CostPolicy(trees)
    seen = set()
    for _ in range(400):
        tree = policy.choose(4)
        width = 1 if tree is None else (3 if tree.source == LOOKUP else tree.total_tokens)
        if tree is not None:
            seen.add(tree.source)
        accepted = 0 if tree is None else 4 * (2 if tree.source == LOOKUP else 1)
        policy.observe(
            CycleOutcome(
                tree is not None, 4, 4 + accepted, 4 * (width - 1), accepted, [], 0.001, 0.01 * width, tree_width=width
            ),
            0.012 * width,
        )
    assert seen == {HYBRID, HEAD, LOOKUP}
    lookup = [k for k, t in enumerate(trees, start=1) if t.source == LOOKUP]
    assert all(policy.nodes(k) == 3 for k in lookup if k in policy.widths)
