"""The server's speculation policy on its own: tree size by batch size, and the online choice between speculative
and plain cycles (warm-up, the faster mode, probes of the slower one backing off)."""

from __future__ import annotations

import pytest

from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.serving.policy import (
    SpeculationPolicy,
    default_schedule,
    fewest_steps,
    parse_schedule,
    shrink,
    tree_nodes,
)

TREE = DynamicTreeConfig(total_tokens=16, depth=4, top_k=4)


def test_schedule_shrinks_the_tree_with_the_batch_and_turns_off():
    policy = SpeculationPolicy(default_schedule(TREE), adaptive=False)
    sizes = {b: tree_nodes(policy.choose(b)) for b in (1, 2, 3, 16, 17, 32, 33)}
    assert sizes == {1: 16, 2: 16, 3: 4, 16: 4, 17: 2, 32: 2, 33: 1}
    assert policy.choose(33) is None


def test_shrink_keeps_the_likeliest_choices_and_turns_small_dynamic_trees_into_chains():
    static = StaticTree.from_choices([[0], [1], [0, 0], [0, 1]])
    assert tree_nodes(shrink(static, 0.5)) == 3 and isinstance(shrink(static, 0.5), StaticTree)
    assert shrink(TREE, 1.0) is TREE and shrink(static, 1.0) is static
    small = shrink(TREE, 0.01)
    assert small.total_tokens == 2 and small.top_k == 1 and small.depth == 0  # one draft call: a first level
    # 3 draft tokens fit on one path of depth 4: a chain of them, drafted in 3 calls of one beam
    assert shrink(TREE, 0.25) == DynamicTreeConfig(total_tokens=4, depth=2, top_k=1)
    assert shrink(TREE, 0.5) == DynamicTreeConfig(total_tokens=8, depth=4, top_k=4)  # 7 do not: the beams stay
    assert shrink(DynamicTreeConfig(total_tokens=12, depth=5, top_k=2), 0.5) == DynamicTreeConfig(6, 4, 1)


def test_fewest_steps_keeps_only_the_draft_steps_a_trees_nodes_can_use():
    assert fewest_steps(DynamicTreeConfig(total_tokens=4, depth=4, top_k=3)) == DynamicTreeConfig(4, 2, 3)
    assert fewest_steps(DynamicTreeConfig(total_tokens=8, depth=4, top_k=4)) == DynamicTreeConfig(8, 4, 4)


def test_parse_schedule_reads_fractions_and_refuses_nonsense():
    steps = parse_schedule("4:0.5,2:1,inf:0", TREE)
    assert [(limit, tree_nodes(tree)) for limit, tree in steps] == [(2, 16), (4, 8), (1 << 30, 1)]
    for bad in ("4", "x:1", "4:2", "0:1"):
        with pytest.raises(ValueError, match="speculation schedule"):
            parse_schedule(bad, TREE)
    assert SpeculationPolicy(parse_schedule("inf:0", TREE)).never_speculates


def run(policy: SpeculationPolicy, rates: dict[bool, float], cycles: int) -> list[bool]:
    """Drive the policy at batch 1 with a fixed tokens/s per mode; the modes it chose, in order."""
    chosen = []
    for _ in range(cycles):
        speculative = policy.choose(1) is not None
        chosen.append(speculative)
        policy.record(1, speculative, int(rates[speculative]), 1.0)
    return chosen


def test_adaptive_policy_measures_both_modes_then_runs_the_faster():
    policy = SpeculationPolicy(default_schedule(TREE), warmup=(6, 3), probe_every=10, max_probe_every=40)
    chosen = run(policy, {True: 100, False: 60}, 200)
    assert chosen[:6] == [True] * 6 and chosen[6:9] == [False] * 3  # warm-up: both modes measured
    assert sum(chosen[9:]) / len(chosen[9:]) > 0.95  # then speculation, which is faster
    plain_probes = [i for i, spec in enumerate(chosen) if not spec and i >= 9]
    gaps = [b - a for a, b in zip(plain_probes, plain_probes[1:])]
    assert gaps and gaps == sorted(gaps) and max(gaps) <= 41  # probes of the losing mode back off, to a limit
    described = policy.describe()[0]
    assert described["spec_tokens_per_s"] == pytest.approx(100) and described["plain_tokens_per_s"] == pytest.approx(60)


def test_adaptive_policy_switches_to_plain_when_speculation_loses():
    policy = SpeculationPolicy(default_schedule(TREE), warmup=(2, 2), probe_every=5, max_probe_every=20)
    chosen = run(policy, {True: 40, False: 90}, 120)
    assert sum(chosen[4:]) / len(chosen[4:]) < 0.1
    assert any(chosen[4:])  # but speculation is still probed now and then
    assert policy.record(1, True, 5, 0.0) is None  # a zero-length cycle is ignored, not a division by zero
