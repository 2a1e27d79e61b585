"""Speedup against the machine's memory bandwidth: a real copy's GB/s, then plain decoding and the head in turns."""

from __future__ import annotations

import json

import pytest

from specdec_kit.bench.bandwidth_state import groups, main
from specdec_kit.runtime.core.memory_bandwidth import copy_bandwidth_gbs


def test_a_copy_measures_a_bandwidth():
    assert 0.1 < copy_bandwidth_gbs(megabytes=8, repeats=2) < 10_000
    with pytest.raises(ValueError, match="expected megabytes >= 1 and repeats >= 1, got 0 and 3"):
        copy_bandwidth_gbs(megabytes=0)


def test_samples_pair_plain_decoding_and_the_head(demo_engine, tmp_path):
    out = tmp_path / "state"
    args = ["--engine", str(demo_engine), "--seconds", "2", "--max-new-tokens", "12", "--prompt", "def add(a, b):"]
    assert main(args + ["--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    samples = result["samples"]
    assert samples and all(s["copy_gbs"] > 0 and s["plain_tokens_per_s"] > 0 for s in samples)
    for s in samples:
        assert s["speedup"] == pytest.approx(s["method_tokens_per_s"] / s["plain_tokens_per_s"], rel=0.01)
        assert s["acceptance_length"] >= 1.0
    assert sum(g["samples"] for g in result["groups"]) == len(samples)
    assert "| copy GB/s | samples | plain tokens/s | griffin tokens/s |" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 0


def test_samples_group_by_bandwidth():
    def one(gbs: float, speedup: float) -> dict:
        return {"copy_gbs": gbs, "plain_tokens_per_s": 60.0, "method_tokens_per_s": 60.0 * speedup, "speedup": speedup}

    grouped = groups([one(44.0, 1.5), one(46.0, 1.6), one(75.0, 1.2), one(41.0, 1.4)])
    assert [(g["copy_gbs"], g["samples"], g["speedup"]) for g in grouped] == [("40-50", 3, 1.5), ("70-80", 1, 1.2)]


def test_bad_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--seconds", "0"])
    assert "expected --seconds > 0 and --max-new-tokens >= 1, got 0.0 and 64" in capsys.readouterr().err
