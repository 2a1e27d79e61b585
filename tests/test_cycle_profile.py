"""The cycle profiler: a batched run's time, sorted into the stages of a cycle, accounts for the run."""

from __future__ import annotations

import json

from specdec_kit.bench.cycle_profile import main


def test_the_profile_sorts_a_cycle_into_its_stages(demo_engine, tmp_path):
    assert main(["--engine", str(demo_engine), "--batches", "1,3", "--new-tokens", "12", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "speculative.json").read_text())
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        stages = r["ms_per_cycle"]
        assert stages["ONNX Runtime: target_step"] > 0 and stages["ONNX Runtime: draft_step"] > 0
        assert stages["past K/V copied into graph inputs"] > 0 and stages["draft tree search"] > 0
        accounted = sum(stages.values()) * r["cycles"] / 1000
        assert 0.6 * r["wall_s"] < accounted < 1.1 * r["wall_s"]  # the stages hold the run's time, once
    table = (tmp_path / "speculative.md").read_text()
    assert "| ONNX Runtime: target_step |" in table and "batch 3" in table
