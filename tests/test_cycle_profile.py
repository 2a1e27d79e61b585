"""The cycle profiler: a batched run's time, sorted into the stages of a cycle, accounts for the run."""

from __future__ import annotations

import json

from specdec_kit.bench.cycle_profile import main
from specdec_kit.runtime.core.manifest import read_manifest


def test_the_profile_sorts_a_cycle_into_its_stages(demo_engine, tmp_path):
    args = ["--engine", str(demo_engine), "--batches", "1,3", "--new-tokens", "12", "--ops", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = json.loads((tmp_path / "speculative.json").read_text())
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        stages = r["ms_per_cycle"]
        assert stages["ONNX Runtime: target_step"] > 0 and stages["ONNX Runtime: draft_step"] > 0
        assert stages["past K/V copied into graph inputs"] > 0 and stages["draft tree search"] > 0
        accounted = sum(stages.values()) * r["cycles"] / 1000
        assert 0.6 * r["wall_s"] < accounted < 1.1 * r["wall_s"]  # the stages hold the run's time, once
        # ONNX Runtime's own profile, per operator: every norm of the target one fused kernel, its products timed (on
        # the CPU the kit's PackedMatMul: each layer's four weight products and the LM head)
        layers = read_manifest(demo_engine)["target"]["num_hidden_layers"]
        target = r["operators"]["target_step"]
        assert target["calls"] > 0 and target["operators"]["PackedMatMul"]["ms"] > 0
        assert target["operators"]["PackedMatMul"]["nodes"] == 4 * layers + 1 and "MatMul" not in target["operators"]
        assert target["operators"]["SimplifiedLayerNormalization"]["nodes"] == 2 * layers + 1
    table = (tmp_path / "speculative.md").read_text()
    assert "| ONNX Runtime: target_step |" in table and "batch 3" in table
    assert "target_step at batch 3:" in table and "| PackedMatMul |" in table
