"""A benchmark's speedups split by the machine's memory-bandwidth state at each prompt."""

from __future__ import annotations

import pytest

from specdec_kit.bench.bandwidth_split import by_state, split_point, state_table
from specdec_kit.bench.report import markdown


def test_two_states_split_between_them_and_one_state_does_not():
    two = [44.0, 46.5, 43.1, 76.0, 78.2, 45.0, 75.1]
    split = split_point(two)
    assert 46.5 < split < 75.1 and split == pytest.approx((46.5 * 75.1) ** 0.5)
    assert split_point([44.0, 46.5, 43.1, 45.0, 49.0]) is None  # one state: no gap of 30%
    assert split_point([44.0]) is None and split_point([]) is None


def runs_of(pairs: list[tuple[float, float]]) -> dict:
    """Runs keyed (prompt, repeat) as ``speedup.measure`` returns them: (copy GB/s, tokens/s) each."""
    return {(i, 0): {"copy_gbs": gbs, "tps": tps} for i, (gbs, tps) in enumerate(pairs)}


def test_each_state_gets_the_median_speedup_of_its_prompts():
    plain = runs_of([(45, 60.0), (44, 64.0), (77, 90.0), (76, 85.0), (46, 62.0)])
    griffin = runs_of([(45, 96.0), (44, 96.0), (77, 99.0), (76, 102.0), (46, 93.0)])
    below, above = by_state(griffin, plain, split=60.0)
    assert (below["state"], below["prompts"], below["copy_gbs"]) == ("below", 3, 45.0)
    assert below["speedup"] == pytest.approx(1.5)  # 1.6, 1.5, 1.5
    assert (above["prompts"], above["copy_gbs"]) == (2, 76.5)
    assert above["speedup"] == pytest.approx((99 / 90 + 102 / 85) / 2)
    none_above = by_state(runs_of([(45, 96.0)]), runs_of([(45, 60.0)]), split=60.0)[1]
    assert none_above["prompts"] == 0 and none_above["speedup"] is None


def test_the_report_shows_both_states_under_the_table():
    plain = runs_of([(45, 60.0), (77, 90.0)])
    row = {
        "prompt_set": "chat",
        "temperature": 0.0,
        "method": "griffin",
        "tokens_per_s": 97.0,
        "speedup": 1.35,
        "copy_gbs": 61.0,
        "acceptance_length": 2.0,
        "acceptance_per_depth": [0.6],
        "by_bandwidth": by_state(runs_of([(45, 96.0), (77, 99.0)]), plain, split=59.0),
    }
    text = markdown([row], "a machine")
    assert "split at 59" in text
    assert "| chat | 0 | griffin | 1.60x (1 at 45 GB/s) | 1.10x (1 at 77 GB/s) |" in text
    assert state_table([dict(row, by_bandwidth=None)]) == []


def test_the_report_sets_the_decoding_phase_beside_the_end_to_end_speedup():
    """A long prompt's prefill is paid by every method: the end-to-end speedup adds it to both sides, the decoding
    phase's leaves it out (a reference timed from outside has no per-request stats, so no decoding-phase ratio)."""
    from specdec_kit.bench.speedup import machine, summarize
    from specdec_kit.runtime.decoding.generate import RequestStats

    pause = {"gc_s": 0.2, "full_gcs": 1}  # each timed request held one full collection of 200 ms

    def run(prefill_s: float, total_s: float) -> dict:
        stats = RequestStats(generated_tokens=100, cycles=50, accepted_tokens=50, prefill_s=prefill_s, total_s=total_s)
        return {"tps": 100 / total_s, "tokens": 100, "total_s": total_s, "stats": stats, "copy_gbs": 45.0} | pause

    results = {
        ("spec_bench", 0.0, "plain"): {(0, 0): run(1.0, 3.0)},  # 1 s of prefill, 2 s decoding
        ("spec_bench", 0.0, "griffin"): {(0, 0): run(1.0, 2.0)},  # the same prefill, decoding in half the time
        ("spec_bench", 0.0, "outside"): {(0, 0): {"tps": 40.0, "tokens": 100, "total_s": 2.5, "copy_gbs": 45.0}},
    }
    rows = {r["method"]: r for r in summarize(results, ["plain", "griffin", "outside"])}
    assert rows["griffin"]["speedup"] == pytest.approx(1.5) and rows["griffin"]["decode_speedup"] == pytest.approx(2.0)
    assert rows["plain"]["decode_speedup"] == pytest.approx(1.0) and rows["outside"]["decode_speedup"] is None
    text = markdown(list(rows.values()), "a machine")
    assert "| speedup | decoding alone |" in text and "| 1.50x | 2.00x |" in text
    assert "garbage collection 400 ms inside the 2 timed requests (2 full collections)" in machine(results)
