"""The export cache: a graph exported once is reused by later builds of the same graph, byte for byte what a new
export writes, and the build's checks pass on it; any change of weights, settings, axes or code misses; the cache
stays within its bound."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from test_export_onnx import inputs_for

from specdec_kit.export.builder import build_engine
from specdec_kit.export.export_cache import BUDGET_ENV, budget_bytes, cached_export, plan_key, prune
from specdec_kit.export.inputs import BuildInputs
from specdec_kit.export.onnx_build import quiet_export
from specdec_kit.export.onnx_graphs import export_plan
from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_to_dict
from specdec_kit.runtime.models.pretrained import cache_root
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.ort.graphs import target_plan


def griffin_inputs(checkpoints: dict, tree: DynamicTreeConfig) -> BuildInputs:
    return inputs_for(checkpoints, "griffin", tree=tree_to_dict(tree), draft_tree=False)


def test_a_second_build_takes_the_exported_graphs_from_the_cache(demo_checkpoints, tmp_path):
    """Another tree on the same target and head: both graphs come from the cache (the build says so) and the engine
    passes the build's checks against PyTorch; the cached target graph is, byte for byte, what a new export writes.
    (The cache is the user's own, where the kit's kernels are cached too: an earlier run's graphs of the same inputs
    and code count as exported before.)"""
    said: list[str] = []
    build_engine(griffin_inputs(demo_checkpoints, DynamicTreeConfig(8, 3, 2)), tmp_path / "a")
    second = build_engine(
        griffin_inputs(demo_checkpoints, DynamicTreeConfig(6, 2, 2)), tmp_path / "b", step=said.append
    )
    reused = [s for s in said if "taken from the export cache" in s]
    assert [s.split(".onnx")[0] for s in reused] == ["target_step", "draft_step"], said
    assert second.manifest["onnx"]["greedy_identical_to_torch"] is True
    plan = target_plan(TargetModel.from_pretrained(demo_checkpoints["target"], dtype=torch.float32))
    entry = cache_root() / "onnx-exports" / plan_key(plan)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with quiet_export():
        export_plan(plan, fresh)
    for name in ("target_step.onnx", "target_step.onnx.data"):
        assert (entry / name).read_bytes() == (fresh / name).read_bytes(), name


def test_any_change_the_export_reads_changes_the_key(demo_checkpoints):
    target = TargetModel.from_pretrained(demo_checkpoints["target"], dtype=torch.float32)
    plan = target_plan(target)
    key = plan_key(plan)
    assert plan_key(copy.deepcopy(plan)) == key  # a copy of the same graph: the same key
    assert plan_key(target_plan(target)) == key
    changed = copy.deepcopy(plan)
    with torch.no_grad():
        next(changed.module.parameters()).view(-1)[0] += 1e-3  # one weight
    assert plan_key(changed) != key
    norm = copy.deepcopy(plan)
    found = [m for m in norm.module.modules() if isinstance(getattr(m, "variance_epsilon", None), float)]
    assert found, "no norm with an epsilon setting in the target"
    found[0].variance_epsilon *= 10  # one setting, no tensor
    assert plan_key(norm) != key
    axes = copy.deepcopy(plan)
    name = next(iter(axes.dims))
    axes.dims = {**axes.dims, name: None}  # one dynamic axis fixed
    assert plan_key(axes) != key
    opset = copy.deepcopy(plan)
    opset.opset += 1
    assert plan_key(opset) != key


def test_the_cache_stays_within_its_bound_and_keeps_no_graph_too_large(demo_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "onnx-exports"
    root.mkdir(parents=True)
    for age, name in enumerate(("old", "newer", "newest")):
        entry = root / name
        entry.mkdir()
        (entry / "g.onnx").write_bytes(b"x" * 1000)
        stamp = 1_000_000 + age
        os.utime(entry, (stamp, stamp))
    prune(root, 2000)
    assert sorted(p.name for p in root.iterdir()) == ["newer", "newest"]
    target = TargetModel.from_pretrained(demo_checkpoints["target"], dtype=torch.float32)
    plan = target_plan(target)
    exported = []

    def export(plan, graphs: Path) -> Path:
        exported.append(plan.spec.name)
        (graphs / f"{plan.spec.name}.onnx").write_bytes(b"graph")
        return graphs / f"{plan.spec.name}.onnx"

    weights = sum(t.numel() * t.element_size() for t in plan.module.state_dict().values())
    monkeypatch.setenv(BUDGET_ENV, str(3 * weights / (1 << 30)))  # a quarter of the bound holds less than the graph
    out = tmp_path / "graphs"
    out.mkdir()
    assert cached_export(plan, out, export) == (out / "target_step.onnx", False)
    assert cached_export(plan, out, export)[1] is False and exported == ["target_step", "target_step"]
    monkeypatch.setenv(BUDGET_ENV, "1")
    assert cached_export(plan, out, export)[1] is False
    assert cached_export(plan, out, export)[1] is True and len(exported) == 3


@pytest.mark.parametrize("value, message", [("lots", "expected a size in GB"), ("-1", "expected a size in GB >= 0")])
def test_a_bad_bound_is_refused_naming_the_variable(monkeypatch, value, message):
    monkeypatch.setenv(BUDGET_ENV, value)
    with pytest.raises(ValueError, match=f"{BUDGET_ENV}={value!r}: {message}"):
        budget_bytes()
