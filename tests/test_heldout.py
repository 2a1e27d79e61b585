"""Held-out acceptance counted as decoding counts: each answer walked cycle by cycle from the chain lengths drafted at
its positions, the per-position share beside it; a tracker resumes only from a best measured the same way."""

from __future__ import annotations

import torch

from specdec_kit.train.heldout import ChainCounts, HeldOutTracker


def test_an_answer_is_walked_as_greedy_decoding_walks_it():
    # one row: a prompt position (not a start), then 8 answer starts; chain lengths drafted from each position
    lengths = torch.tensor([[0, 3, 2, 0, 1, 3, 0, 0, 2]])
    starts = torch.tensor([[False] + [True] * 8])
    counts = ChainCounts(depth=3)
    counts.add(lengths, starts)
    # the first start is the prefill's; cycles at 2 (accepts 2), 5 (3), then 9 is past the answer
    assert (counts.cycles, counts.cycle_hits) == (2, [2, 2, 1])
    assert (counts.positions, counts.position_hits) == (8, [5, 4, 2])
    assert counts.per_cycle() == [1.0, 1.0, 0.5] and counts.per_position() == [0.625, 0.5, 0.25]
    limited = ChainCounts(depth=3, max_new_tokens=3)  # decoding stops after 3 tokens: the cycle at 2 is the last
    limited.add(lengths, starts)
    assert (limited.cycles, limited.cycle_hits) == (1, [1, 1, 0])
    empty = ChainCounts(depth=3)
    empty.add(lengths, torch.zeros_like(starts))
    assert (empty.cycles, empty.positions, empty.per_cycle()) == (0, 0, [0.0, 0.0, 0.0])


def test_the_tracker_keeps_the_best_by_cycles_and_resumes_only_from_a_best_counted_so():
    walks = iter([[0, 1, 0], [0, 3, 0], [0, 0, 0]])  # chain lengths at three starts: the second measure is best

    def measure(module):
        counts = ChainCounts(depth=3)
        counts.add(torch.tensor([next(walks)]), torch.ones(1, 3, dtype=torch.bool))
        return counts

    module = torch.nn.Linear(2, 2)
    tracker = HeldOutTracker(measure, every=1)
    records = []
    for step in range(3):
        with torch.no_grad():
            module.weight.fill_(step)
        records.append(tracker.record(module, step))
    assert [r["tau"] for r in records] == [2.0, 4.0, 1.0] and records[1]["per_position"] == [0.3333] * 3
    assert tracker.best_step == 2 and float(tracker.best_weights["weight"][0, 0]) == 1.0
    resumed = HeldOutTracker(measure, every=1)
    resumed.restore(tracker.state())
    assert (resumed.best_tau, resumed.best_step) == (4.0, 2)
    older = {k: v for k, v in tracker.state().items() if k != "counted"}  # a run saved when positions were counted
    fresh = HeldOutTracker(measure, every=1)
    fresh.restore(older)
    assert (fresh.best_tau, fresh.best_step, fresh.best_weights) == (0.0, -1, {})
