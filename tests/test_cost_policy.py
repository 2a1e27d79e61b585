"""The cost-based speculation policy: from measured target costs (a curve over the tokens of one call), draft costs
and acceptance it picks, per batch size, the tree or plain decoding that gives the most tokens/s; and a real server
running it stays lossless under concurrent streams."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdec_kit.runtime.generate import CycleOutcome
from specdec_kit.runtime.trees import DynamicTreeConfig
from specdec_kit.serving.cost_policy import CostPolicy, Ema, candidate_trees, interpolate
from specdec_kit.serving.policy import tree_nodes

TREE = DynamicTreeConfig(total_tokens=16, depth=3, top_k=4)
ACCEPTED = {16: 2.0, 8: 1.6, 4: 1.2, 2: 0.7}  # accepted draft tokens per row, by tree size


def verify_seconds(tokens: int, rows: int) -> float:
    """A target that costs the same up to 16 tokens per call (memory-bound), then grows with them (compute-bound),
    and a little more for each row (its cache is read)."""
    return 0.010 + 0.0005 * max(0, tokens - 16) + 0.0004 * rows


def draft_seconds(batch: int) -> float:
    return 0.006 * (1 + batch / 8)


def rate(batch: int, nodes: int) -> float:
    if nodes == 1:
        return batch / verify_seconds(batch, batch)
    return batch * (1 + ACCEPTED[nodes]) / (verify_seconds(batch * nodes, batch) + draft_seconds(batch))


def drive(policy: CostPolicy, batch: int, cycles: int) -> list[int]:
    """Run the policy against the modelled machine at one batch size; the tree sizes it chose (1 = plain). The first
    speculative cycle after plain ones also runs the draft over the context they skipped (one step per cycle)."""
    chosen, skipped = [], 0
    for _ in range(cycles):
        tree = policy.choose(batch)
        nodes = tree_nodes(tree)
        draft = draft_seconds(batch) * (1 + skipped) if tree is not None else 0.0
        skipped = 0 if tree is not None else skipped + 1
        accepted = ACCEPTED.get(nodes, 0.0) * batch
        outcome = CycleOutcome(tree is not None, batch, int(batch + accepted), (nodes - 1) * batch, int(accepted), [],
                               draft, verify_seconds(batch * nodes, batch))
        policy.observe(outcome, outcome.draft_s + outcome.verify_s)
        chosen.append(nodes)
    return chosen


def test_candidates_are_the_engine_tree_and_smaller_ones():
    assert [tree_nodes(t) for t in candidate_trees(TREE)] == [16, 8, 4, 2]
    assert [tree_nodes(t) for t in candidate_trees(DynamicTreeConfig(3, 2, 2))] == [3, 2]


def test_interpolation_follows_the_measured_curve():
    points = {1: Ema(1.0, 3), 9: Ema(2.0, 3)}
    assert interpolate(points, 5) == pytest.approx(1.5)
    assert interpolate(points, 17) == pytest.approx(3.0)  # on along the last segment
    assert interpolate({4: Ema(2.0, 1)}, 8) == 2.0  # one point: that value (optimistic, so it gets measured)
    assert interpolate(points, 0) == 1.0 and interpolate({}, 3) is None


def test_it_picks_the_fastest_candidate_for_each_batch_size():
    best = {b: max([1, 2, 4, 8, 16], key=lambda n: rate(b, n)) for b in (1, 4, 16)}
    assert best == {1: 16, 4: 4, 16: 1}  # the modelled machine: a big tree alone, a small one at 4, plain at 16
    policy = CostPolicy(candidate_trees(TREE), warmup=3, probe_every=25)
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
    """Catch-up cycles stay out of the draft's cost, and the probes of a runner-up that keeps losing back off."""
    policy = CostPolicy(candidate_trees(TREE), warmup=3, probe_every=25)
    chosen = drive(policy, 16, 1000)
    assert policy.draft[16].value == pytest.approx(draft_seconds(16))  # a step's cost, not a catch-up's
    probes = [i for i, n in enumerate(chosen[100:]) if n != 1]
    assert 2 <= len(probes) <= 8, probes  # 36 at a fixed interval of 25
    assert all(b - a > a - c for a, b, c in zip(probes[1:], probes[2:], probes)), probes  # further apart each time
    assert drive(policy, 1, 100)[-50:].count(16) >= 47  # a big tree alone still wins, from clean measurements


def test_a_batch_size_it_has_not_seen_is_predicted_then_measured_once_it_recurs():
    policy = CostPolicy(candidate_trees(TREE), warmup=3, settle=10)
    drive(policy, 1, 60)
    drive(policy, 4, 60)
    chosen = drive(policy, 16, 80)
    assert 16 not in chosen[:10]  # the 256-token verification was predicted too slow from the other sizes' costs
    assert all(policy.measured_at(k, 16) for k in range(len(policy.trees) + 1))  # then each candidate at 16 itself
    assert chosen[-30:].count(1) >= 28
    assert policy.predicted_rate(0, 16) == pytest.approx(rate(16, 1))  # 16 rows x 1 token, not 1 row x 16


def test_without_trees_it_never_speculates():
    policy = CostPolicy([])
    assert policy.never_speculates and policy.choose(4) is None


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
        sizes = [c["tree_tokens"] for c in info["speculation"]]
        assert sizes[0] == 1 and sizes[1:] == sorted(sizes[1:], reverse=True) and len(sizes) >= 3
        assert any(c["accepted_per_row"] for c in info["speculation"][1:])  # trees were run and measured
    finally:
        srv.stop()
