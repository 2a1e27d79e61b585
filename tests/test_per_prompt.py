"""A benchmark row's speedups prompt by prompt, each the median over its repeats."""

from __future__ import annotations

import pytest

from specdec_kit.bench.per_prompt import by_prompt, per_prompt_table
from specdec_kit.runtime.decoding.generate import RequestStats


def run(prompt_tokens: int, prefill_s: float, total_s: float, tokens: int = 100, accepted: int = 0) -> dict:
    stats = RequestStats(
        prompt_tokens=prompt_tokens,
        generated_tokens=tokens,
        cycles=tokens - accepted,
        accepted_tokens=accepted,
        prefill_s=prefill_s,
        total_s=total_s,
    )
    return {"tps": tokens / total_s, "tokens": tokens, "total_s": total_s, "stats": stats}


def test_each_prompt_gets_the_medians_of_its_repeats_and_a_long_prefill_pulls_its_ratio_toward_one():
    plain = {
        (0, 0): run(40, 0.1, 2.1),
        (0, 1): run(40, 0.1, 2.1),
        (0, 2): run(40, 0.1, 2.1),
        (1, 0): run(700, 1.0, 3.0),
    }
    griffin = {
        (0, 0): run(40, 0.1, 1.1, accepted=50),  # decoding 2 s -> 1 s
        (0, 1): run(40, 0.1, 1.6, accepted=50),  # a slow repeat: the median is the middle one
        (0, 2): run(40, 0.1, 1.35, accepted=50),
        (1, 0): run(700, 1.0, 2.0, accepted=50),  # the same halving after 1 s of shared prefill
        (2, 0): run(90, 0.1, 1.0),  # no plain run to set it against: left out
    }
    short, long = by_prompt(griffin, plain)
    assert (short["prompt"], short["prompt_tokens"], short["generated_tokens"]) == (0, 40, 100)
    assert short["speedup"] == pytest.approx(2.1 / 1.35) and short["decode_speedup"] == pytest.approx(2.0 / 1.25)
    assert short["prefill_share"] == pytest.approx(0.1 / 2.1) and short["acceptance_length"] == pytest.approx(2.0)
    assert long["decode_speedup"] == pytest.approx(2.0) and long["speedup"] == pytest.approx(1.5)
    assert long["prefill_share"] == pytest.approx(1 / 3)


def test_a_reference_timed_from_outside_has_no_prompt_rows_and_the_table_lists_the_rest():
    outside = {(0, 0): {"tps": 50.0, "tokens": 100, "total_s": 2.0}}
    assert by_prompt(outside, {(0, 0): run(40, 0.1, 2.1)}) == []
    row = {"prompt_set": "spec_bench", "temperature": 0.0, "method": "griffin (7, 2, 4)"}
    rows = [dict(row, by_prompt=by_prompt({(3, 0): run(769, 0.9, 3.0)}, {(3, 0): run(769, 0.9, 3.6)}))]
    table = per_prompt_table(rows + [dict(row, method="outside", by_prompt=[])])
    assert table.count("\n") == 3  # header, rule, one prompt
    assert "| spec_bench | 0 | griffin (7, 2, 4) | 3 | 769 | 100 | 25% | 1.20x | 1.29x | 1.00 |" in table
    assert per_prompt_table([dict(row, by_prompt=[])]) == ""


def test_a_request_that_generated_nothing_has_no_decoding_ratio_and_the_table_says_so():
    nothing = {(0, 0): run(40, 0.1, 0.1, tokens=0)}
    (row,) = by_prompt(nothing, {(0, 0): run(40, 0.1, 2.1)})
    assert row["decode_speedup"] is None and row["prefill_share"] == pytest.approx(0.1 / 2.1)
    table = per_prompt_table([{"prompt_set": "chat", "temperature": 0.7, "method": "griffin", "by_prompt": [row]}])
    assert "| chat | 0.7 | griffin | 0 | 40 | 0 | 5% |" in table and "| - |" in table
