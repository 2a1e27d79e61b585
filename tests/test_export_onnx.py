"""ONNX Runtime engines: the graphs match PyTorch, generation through them is lossless, the manifest
protects what it lists, and the builder's command line reuses, rebuilds and refuses as documented."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
from conftest import hf_greedy, left_in

from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.export.onnx_build import target_parity
from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.core.manifest import EngineError, read_manifest
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import DynamicTreeConfig, parse_tree_spec, tree_to_dict
from specdec_kit.runtime.decoding.drafting import NoDrafter, TorchFeatureStep
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.engine import open_engine
from specdec_kit.runtime.loader import load_draft_for
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import drafter_for

REPO = Path(__file__).resolve().parents[1]
TREES = {
    "griffin": tree_to_dict(DynamicTreeConfig(12, 3, 3)),
    "eagle2": tree_to_dict(DynamicTreeConfig(10, 2, 3)),
    "eagle3": tree_to_dict(DynamicTreeConfig(10, 3, 3)),
    "medusa": tree_to_dict(parse_tree_spec("static:mc_sim_7b_63:16")),
}


def inputs_for(paths: dict, kind: str, backend: str = "onnxruntime", **kw) -> BuildInputs:
    return BuildInputs(
        draft=kind,
        target=paths["target"],
        draft_path=paths[kind],
        tokenizer=paths["target"],
        backend=backend,
        dtype="float32",
        tree=kw.pop("tree", TREES.get(kind, TREES["griffin"])),
        **kw,
    )


@pytest.fixture(scope="module")
def checkpoints(demo_checkpoints, eagle3_checkpoint) -> dict:
    return dict(demo_checkpoints, eagle3=eagle3_checkpoint)


ONE_CALL_TREE = tree_to_dict(DynamicTreeConfig(6, 2, 2))  # small: the one-call graph unrolls the search to export it
EXTRA_TREE = DynamicTreeConfig(3, 1, 1)  # a tree the one-call engine carries beside its own (a tree search's candidate)


class Engines(dict):
    """Each engine built on first use, then shared by the module: ``engines["eagle2"]`` (ONNX Runtime, drafting level
    by level; EAGLE-3 in one call per cycle, which its greedy test then checks against PyTorch's level-by-level
    drafts), ``engines["griffin-torch"]``, or ``engines["griffin-onecall"]`` (ONNX Runtime with the draft_tree graph
    of ``ONE_CALL_TREE`` and one of ``EXTRA_TREE``). A test tier that opens one engine builds one."""

    def __init__(self, checkpoints: dict, root: Path):
        super().__init__()
        self.checkpoints, self.root = checkpoints, root

    def __missing__(self, name: str) -> Path:
        kind, _, variant = name.partition("-")
        if variant == "onecall":
            inputs = inputs_for(self.checkpoints, kind, tree=ONE_CALL_TREE, extra_trees=(tree_to_dict(EXTRA_TREE),))
        else:
            inputs = inputs_for(self.checkpoints, kind, variant or "onnxruntime", draft_tree=kind == "eagle3")
        path = build_engine(inputs, self.root / name).path
        self[name] = path
        return path


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory) -> Engines:
    return Engines(checkpoints, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def torch_target(demo_checkpoints) -> TargetModel:
    return TargetModel.from_pretrained(demo_checkpoints["target"], dtype="float32", device="cpu")


def prompts(vocab: int, count: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [
        torch.randint(0, vocab, (int(n),), generator=gen).tolist()
        for n in torch.randint(2, 15, (count,), generator=gen)
    ]


def test_manifest_records_the_build(engines):
    m = read_manifest(engines["griffin"])
    assert m["backend"] == "onnxruntime" and m["draft"]["kind"] == "griffin" and m["dtype"] == "float32"
    assert m["tree"] == TREES["griffin"] and m["kit_version"] and len(m["inputs"]["sha256"]) == 64
    assert {"target_step", "draft_step", "target_step_optimized", "draft_step_optimized"} <= set(m["artifacts"])
    assert "draft_tree" not in m["artifacts"] and "whole_tree" not in m["onnx"]  # built with draft_tree=False
    assert m["onnx"]["greedy_identical_to_torch"] is True
    assert m["onnx"]["parity_max_abs"]["logits"] < 1e-3
    # q/k/v and gate/up read one activation each: 3 products a layer merged away; every RMSNorm's rsqrt a division,
    # which ONNX Runtime's optimizer then runs as one SimplifiedLayerNormalization kernel; queries' and keys' rotary
    # embeddings one RotaryEmbedding kernel each
    layers = m["target"]["num_hidden_layers"]
    assert m["onnx"]["fusions"]["target_step"] == {
        "shared_input_matmuls": 3 * layers,
        "rsqrt_divisions": 2 * layers + 1,
        "rotary_embeddings": 2 * layers,
    }
    optimized = onnx.load(str(engines["griffin"] / m["artifacts"]["target_step_optimized"]), load_external_data=False)
    ops = [n.op_type for n in optimized.graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 2 * layers + 1 and ops.count("RotaryEmbedding") == 2 * layers
    assert "Neg" not in ops  # no rotate_half left
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in m["files"].values())
    assert any(rel.startswith("tokenizer/") for rel in m["files"])


def test_graphs_have_dynamic_batch_token_and_cache_axes(engines):
    import onnx

    m = read_manifest(engines["griffin"])
    for role in ("target_step", "draft_step"):
        model = onnx.load(str(engines["griffin"] / m["artifacts"][role]), load_external_data=False)
        dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        assert isinstance(dims["input_ids"][0], str) and isinstance(dims["input_ids"][1], str)
        layers = m["target"]["num_hidden_layers"] if role == "target_step" else m["draft"]["num_hidden_layers"]
        buffers = [name for name in dims if name.startswith("past_")]
        assert buffers == [f"past_key_{i}" for i in range(layers)] + [f"past_value_{i}" for i in range(layers)]
        assert all(isinstance(dims[b][0], str) and isinstance(dims[b][2], str) for b in buffers)


def test_target_graph_matches_pytorch_on_prefill_and_trees(engines, torch_target):
    engine = open_engine(engines["griffin"], device="cpu")
    worst = target_parity(torch_target, engine.target, torch_target.vocab_size, seed=3)
    assert worst["logits"] < 1e-4 and worst["features"] < 1e-4, worst


def test_target_step_writes_the_cache_in_place_and_keeps_padded_rows_finite(engines, torch_target):
    """The target graph writes the new tokens' keys/values into the buffers the runtime binds (no other buffer is
    made) at each row's slots; a padding token whose mask row is empty attends to nothing (ONNX Runtime gives it
    zeros, not NaN, which would reach the batch's real tokens through the value products)."""
    engine = open_engine(engines["griffin"], device="cpu")
    ids = torch.randint(0, torch_target.vocab_size, (2, 6), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(6).expand(2, 6)
    pending = (torch.arange(6)[None, :] <= torch.arange(6)[:, None]).expand(2, 6, 6).clone()
    pending[1, 3:] = False  # row 1 has 3 real tokens; its padding sees nothing
    cache, reference = engine.target.new_cache(2, 8), torch_target.new_cache(2, 8)
    buffer = cache.keys.data_ptr()
    got = engine.target(ids, positions, pending, cache)
    want = torch_target(ids, positions, pending, reference)
    assert cache.keys.data_ptr() == buffer and torch.isfinite(got.logits).all()
    assert torch.allclose(got.logits[0], want.logits[0], atol=1e-4)
    assert torch.allclose(got.logits[1, :3], want.logits[1, :3], atol=1e-4)
    assert torch.allclose(cache.keys[:, 0, :, :6], reference.keys[:, 0, :, :6], atol=1e-4)
    assert torch.allclose(cache.values[:, 1, :, :3], reference.values[:, 1, :, :3], atol=1e-4)
    with torch.inference_mode():
        cache.commit(torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 0, 0]]), torch.tensor([6, 3]))
        reference.commit(torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 0, 0]]), torch.tensor([6, 3]))
    step = torch.ones(2, 1, 1, dtype=torch.bool)  # then one token each, at different slots
    got = engine.target(ids[:, :1], torch.tensor([[6], [3]]), step, cache)
    want = torch_target(ids[:, :1], torch.tensor([[6], [3]]), step, reference)
    assert torch.allclose(got.logits, want.logits, atol=1e-4)
    assert torch.allclose(cache.keys[:, 1, :, 3], reference.keys[:, 1, :, 3], atol=1e-4)


def test_draft_graph_matches_pytorch_with_pending_tree_slots(engines, demo_checkpoints, torch_target):
    """Second draft level: new tokens see committed slots and earlier pending slots through the mask."""
    engine = open_engine(engines["griffin"], device="cpu")
    module = load_draft(demo_checkpoints["griffin"], "griffin", torch_target.hidden_size, torch_target.vocab_size)
    steps = [TorchFeatureStep(module, torch_target.lm_head), engine.drafter.step]
    gen = torch.Generator().manual_seed(0)
    d, v = torch_target.hidden_size, torch_target.vocab_size
    feats, toks = torch.randn(2, 5, d, generator=gen), torch.randint(0, v, (2, 5), generator=gen)
    ar = torch.arange(5)
    causal = (ar[None, :] <= ar[:, None]).expand(2, 5, 5)
    caches = [s.new_cache(2, 16) for s in steps]
    first = [
        s(feats, toks, ar.expand(2, 5), causal, c, logits_at=torch.tensor([[4], [2]])) for s, c in zip(steps, caches)
    ]
    for c in caches:
        c.commit(ar.expand(2, 5), torch.tensor([5, 3]))
    level_feats, level_toks = torch.randn(2, 2, d, generator=gen), torch.randint(0, v, (2, 2), generator=gen)
    pending = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool).expand(2, 2, 4)  # 2 earlier + 2 new
    positions = (caches[0].lengths + 1)[:, None].expand(2, 2)
    second = [s(level_feats, level_toks, positions, pending, c) for s, c in zip(steps, caches)]
    for a, b in (first, second):
        assert torch.allclose(a[0], b[0], atol=1e-4) and torch.allclose(a[1], b[1], atol=1e-4)
    assert torch.allclose(caches[0].keys[:, :, :, :7], caches[1].keys[:, :, :, :7], atol=1e-5)


@pytest.mark.parametrize("which", ["engine tree", "extra tree"])
def test_a_dynamic_tree_engine_drafts_each_cycle_in_one_call(engines, which, kind="griffin"):
    """The engine's tree, and each extra tree it was built with, is drafted by a graph of its own, one session call
    per cycle (the step graph runs only for rows joining), with the same trees as the step graph's level-by-level
    search: same tokens, same acceptance, greedy and sampled (the graph ranks a sampled row's children by its draws
    as the runtime does). A tree it carries no graph for drafts level by level."""
    engine = open_engine(engines[f"{kind}-onecall"], device="cpu")
    onnx = engine.manifest["onnx"]
    assert onnx["whole_tree"] == ONE_CALL_TREE
    assert onnx["extra_whole_trees"] == {"draft_tree_3_1_1": tree_to_dict(EXTRA_TREE)}
    tree = engine.tree if which == "engine tree" else EXTRA_TREE
    drafter = engine.drafter_for(tree)
    step = drafter.step
    tree_graph, step_graph = step.whole[0], step.graph
    assert step.whole[1] == tree and tree_graph.path.name.startswith(
        "draft_tree" if which == "engine tree" else "draft_tree_3_1_1"
    )
    assert engine.drafter_for(DynamicTreeConfig(5, 2, 2)).step.whole is None
    batch = prompts(engine.target.vocab_size)
    sampled = [SamplingParams(temperature=0.8, seed=11 * i) for i in range(len(batch))]
    calls_before = step_graph.calls
    whole = SpeculativeGenerator(engine.target, drafter).generate(batch, 40)
    cycles = sum(r.stats.cycles for r in whole)
    assert tree_graph.calls >= max(r.stats.cycles for r in whole)
    assert step_graph.calls == calls_before + 1  # the batch's prompts, read when it was admitted
    whole_sampled = SpeculativeGenerator(engine.target, drafter).generate(batch, 40, sampled)
    step.whole = None
    stepwise = SpeculativeGenerator(engine.target, drafter).generate(batch, 40)
    stepwise_sampled = SpeculativeGenerator(engine.target, drafter).generate(batch, 40, sampled)
    assert step_graph.calls > tree_graph.calls and cycles > 0
    for one_call, level_by_level in ((whole, stepwise), (whole_sampled, stepwise_sampled)):
        assert [r.tokens for r in one_call] == [r.tokens for r in level_by_level]
        assert [r.stats.accepted_tokens for r in one_call] == [r.stats.accepted_tokens for r in level_by_level]
        assert sum(r.stats.accepted_tokens for r in one_call) > 0
    plain = SpeculativeGenerator(engine.target, NoDrafter()).generate(batch, 40, sampled)
    assert [r.tokens for r in whole_sampled] == [r.tokens for r in plain]


def test_a_hybrid_drafts_its_heads_scored_tree_in_one_call(engines, kind="griffin"):
    """A hybrid ranks the head's nodes by their scores: the one-call graph gives them as the level-by-level search
    does (same tokens, parents and scores, greedy and under a draw coupling), so merged cycles draft in one call too
    (the step graph reads only the batch's prompts), the output the target's own. (Which cycles merge follows their
    measured times, so acceptance is not compared run against run.)"""
    from specdec_kit.runtime.core.coupling import DrawCoupling
    from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter
    from specdec_kit.runtime.registry import lookup_drafter

    engine = open_engine(engines[f"{kind}-onecall"], device="cpu")
    one_call, stepwise = engine.drafter_for(engine.tree), engine.drafter_for(engine.tree)
    stepwise.step.whole = None
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(2, 5, engine.target.hidden_size, generator=gen)
    toks = torch.randint(0, engine.target.vocab_size, (2, 5), generator=gen)
    counts = torch.tensor([5, 3])
    noise = torch.rand(2, 8, engine.target.vocab_size, generator=gen).clamp_min(1e-9).log().neg().log().neg()
    for coupling in (None, DrawCoupling(noise, torch.tensor([0.0, 1.25]))):
        trees = []
        for drafter in (one_call, stepwise):
            drafter.reset(2, 64)
            drafter.couple_draws(coupling)
            trees.append(drafter.draft(feats, toks, counts))
        assert trees[0].scores is not None and trees[1].scores is not None
        assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
        assert torch.allclose(trees[0].scores, trees[1].scores, atol=1e-4)
        assert (trees[0].scores[:, 1:] != 0).all()  # the nodes' path scores, not a placeholder
    batch = prompts(engine.target.vocab_size)
    sampled = [SamplingParams(temperature=0.8, seed=5 * i) for i in range(len(batch))]
    head = engine.drafter_for(engine.tree)
    tree_graph, step_graph = head.step.whole[0], head.step.graph
    tree_calls, step_calls = tree_graph.calls, step_graph.calls
    hybrid = SpeculativeGenerator(engine.target, HybridDrafter(head, lookup_drafter("suffix")))
    greedy, drawn = hybrid.generate(batch, 40), hybrid.generate(batch, 40, sampled)
    assert tree_graph.calls > tree_calls and step_graph.calls <= step_calls + 2
    plain = SpeculativeGenerator(engine.target, NoDrafter())
    assert [r.tokens for r in greedy] == [r.tokens for r in plain.generate(batch, 40)]
    assert [r.tokens for r in drawn] == [r.tokens for r in plain.generate(batch, 40, sampled)]
    assert sum(r.stats.accepted_tokens for r in greedy + drawn) > 0


@pytest.mark.parametrize(
    "kind", ["griffin", *(pytest.param(k, marks=pytest.mark.slow) for k in ("eagle2", "eagle3", "medusa"))]
)
def test_greedy_through_onnx_equals_pytorch_and_transformers(engines, checkpoints, torch_target, kind):
    engine = open_engine(engines[kind], device="cpu")
    # a feature draft's dynamic tree is drafted in one call where its engine has the one-call graph (EAGLE-3's here)
    assert (getattr(getattr(engine.drafter, "step", None), "whole", None) is not None) == (kind == "eagle3")
    target = torch_target
    batch = prompts(target.vocab_size)
    got = engine.generator().generate(batch, 40)
    module = load_draft_for(target, kind, checkpoints[kind])
    drafter = drafter_for(kind, module, target, engine.tree)
    ref = SpeculativeGenerator(target, drafter, eos_token_ids=engine.target.eos_token_ids()).generate(batch, 40)
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert [r.stats.accepted_tokens for r in got] == [r.stats.accepted_tokens for r in ref]
    assert sum(r.stats.accepted_tokens for r in got) > 0  # the drafts do propose accepted tokens
    for prompt, res in zip(batch[:3], got[:3]):
        assert res.tokens == hf_greedy(target.hf_model, prompt, 40)


def test_torch_backend_engine_generates_the_same(engines):
    ort_engine, torch_engine = open_engine(engines["griffin"]), open_engine(engines["griffin-torch"])
    batch = prompts(ort_engine.target.vocab_size, 3)
    assert [r.tokens for r in ort_engine.generator().generate(batch, 24)] == [
        r.tokens for r in torch_engine.generator().generate(batch, 24)
    ]


def copy_engine(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupted_incomplete_or_mismatched_engines_are_refused(engines, tmp_path):
    eng = copy_engine(engines["griffin"], tmp_path / "e1")
    graph = next(p for p in (eng / "graphs").iterdir() if p.name.endswith(".data"))
    data = bytearray(graph.read_bytes())
    data[100] ^= 0xFF
    graph.write_bytes(bytes(data))
    with pytest.raises(EngineError, match=f"{graph.name}: SHA-256"):
        open_engine(eng)
    eng = copy_engine(engines["griffin"], tmp_path / "e2")
    (eng / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(EngineError, match="tokenizer.json: listed in manifest.json but missing"):
        open_engine(eng)
    eng = copy_engine(engines["griffin"], tmp_path / "e3")
    with open(eng / "graphs" / "target_step.onnx", "ab") as fh:
        fh.write(b"x")
    with pytest.raises(EngineError, match="target_step.onnx: size"):
        open_engine(eng, checksums=False)
    eng = copy_engine(engines["griffin"], tmp_path / "e4")
    with pytest.raises(EngineError, match="draft kind is 'griffin', expected 'medusa'"):
        open_engine(eng, expect_draft="medusa")
    manifest = json.loads((eng / "manifest.json").read_text())
    older = {**manifest, "onnx": {k: v for k, v in manifest["onnx"].items() if k != "graph_interface"}}
    (eng / "manifest.json").write_text(json.dumps(older))  # built before the per-layer buffers: graphs of interface 1
    with pytest.raises(
        EngineError,
        match=r"interface 1 and this kit runs interface 6 .*rebuild the engine with "
        r"python export/build_engine.py .*--force",
    ):
        open_engine(eng)
    older = {**manifest, "onnx": {**manifest["onnx"], "graph_interface": 5}}
    (eng / "manifest.json").write_text(json.dumps(older))  # draft graphs that rank no joined tokens
    with pytest.raises(
        EngineError, match=r"interface 5 and this kit runs interface 6 .*rank each request's own tokens"
    ):
        open_engine(eng)
    (eng / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(EngineError, match="schema_version 99"):
        open_engine(eng)
    del manifest["tree"]
    (eng / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="key 'tree' is missing"):
        open_engine(eng)
    (eng / "manifest.json").write_text("{not json")
    with pytest.raises(EngineError, match="manifest.json: unreadable or not JSON"):
        open_engine(eng)
    with pytest.raises(EngineError, match="not an engine directory"):
        open_engine(tmp_path)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "export" / "build_engine.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_cli_builds_reuses_and_force_rebuilds(demo_checkpoints, tmp_path):
    args = [
        "--draft",
        "eagle",
        "--target",
        str(demo_checkpoints["target"]),
        "--draft-path",
        str(demo_checkpoints["eagle"]),
        "--backend",
        "torch",
        "--output",
        str(tmp_path / "eng"),
    ]
    first = run_cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "built torch engine: eagle draft" in first.stdout and "specdec-generate --engine" in first.stdout
    stamp = (tmp_path / "eng" / "manifest.json").stat().st_mtime_ns
    again = run_cli(*args, cwd=tmp_path)
    assert again.returncode == 0 and "reused torch engine" in again.stdout
    assert (tmp_path / "eng" / "manifest.json").stat().st_mtime_ns == stamp
    forced = run_cli(*args, "--force", cwd=tmp_path)
    assert forced.returncode == 0 and "built torch engine" in forced.stdout
    other = run_cli(*args[:-2], "--tree", "static:chain-3", "--output", str(tmp_path / "eng"), cwd=tmp_path)
    assert other.returncode == 2 and "not an engine built from these inputs" in other.stderr
    assert left_in(tmp_path) == ["eng"]  # no staging directories left behind
    default = run_cli(*args[:-2], cwd=tmp_path)  # the kit's own folder, engines/eagle-torch
    assert default.returncode == 0 and "built torch engine" in default.stdout, default.stderr
    changed = run_cli(*args[:-2], "--tree", "static:chain-3", cwd=tmp_path)  # e.g. a head updated by a pull
    assert changed.returncode == 0 and "built torch engine" in changed.stdout, changed.stderr
    assert read_manifest(tmp_path / "engines" / "eagle-torch")["tree"] != read_manifest(tmp_path / "eng")["tree"]


def test_a_tools_own_engine_directory_is_rebuilt_when_its_inputs_changed(demo_checkpoints, tmp_path):
    """``replace_other`` (what the benchmarks pass for their engines): an engine from other inputs is rebuilt, an
    identical one still reused."""
    out = tmp_path / "eng"
    build_engine(inputs_for(demo_checkpoints, "griffin", "torch"), out)
    other = inputs_for(demo_checkpoints, "griffin", "torch", tree=tree_to_dict(DynamicTreeConfig(6, 2, 2)))
    with pytest.raises(BuildError, match="not an engine built from these inputs"):
        build_engine(other, out)
    rebuilt = build_engine(other, out, replace_other=True)
    assert not rebuilt.reused and read_manifest(out)["tree"] == other.tree
    assert build_engine(other, out, replace_other=True).reused
    assert left_in(tmp_path) == ["eng"]


@pytest.mark.slow
def test_bad_input_fails_cleanly_and_writes_nothing(demo_checkpoints, tmp_path):
    out = tmp_path / "out"
    unknown = run_cli("--draft", "lookahead", cwd=tmp_path)
    assert unknown.returncode == 2 and "invalid choice: 'lookahead'" in unknown.stderr
    # a draft whose hidden size does not fit the target
    misfit = tmp_path / "misfit"
    shutil.copytree(demo_checkpoints["griffin"], misfit)
    cfg = json.loads((misfit / "config.json").read_text())
    (misfit / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] * 2}))
    res = run_cli(
        "--draft",
        "griffin",
        "--target",
        str(demo_checkpoints["target"]),
        "--draft-path",
        str(misfit),
        "--output",
        str(out),
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "hidden_size does not fit the target: expected 64, found 128" in res.stderr
    # a missing weights file
    (misfit / "config.json").write_text(json.dumps(cfg))
    (misfit / "pytorch_model.bin").unlink()
    res = run_cli(
        "--draft",
        "griffin",
        "--target",
        str(demo_checkpoints["target"]),
        "--draft-path",
        str(misfit),
        "--output",
        str(out),
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "no weights file" in res.stderr
    # an output whose parent is a file
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = run_cli(
        "--draft",
        "griffin",
        "--target",
        str(demo_checkpoints["target"]),
        "--draft-path",
        str(demo_checkpoints["griffin"]),
        "--backend",
        "torch",
        "--output",
        str(blocker / "eng"),
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "cannot write in" in res.stderr
    # tensor parallelism that does not divide the heads (4 query heads, 2 KV heads)
    res = run_cli(
        "--draft",
        "hass",
        "--target",
        str(demo_checkpoints["target"]),
        "--draft-path",
        str(demo_checkpoints["hass"]),
        "--backend",
        "tensorrt-llm",
        "--tp",
        "3",
        "--output",
        str(out),
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "num_attention_heads = 4 is not divisible by --tp 3" in res.stderr
    # the same into a directory that holds something else: the --tp problem is what gets reported
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    res = run_cli(
        "--draft",
        "hass",
        "--target",
        str(demo_checkpoints["target"]),
        "--draft-path",
        str(demo_checkpoints["hass"]),
        "--backend",
        "tensorrt-llm",
        "--tp",
        "3",
        "--output",
        str(occupied),
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "not divisible by --tp 3" in res.stderr and "Traceback" not in res.stderr
    # --output naming a file
    res = run_cli(
        "--draft",
        "griffin",
        "--target",
        str(demo_checkpoints["target"]),
        "--draft-path",
        str(demo_checkpoints["griffin"]),
        "--backend",
        "torch",
        "--output",
        str(blocker),
        cwd=tmp_path,
    )
    assert (
        res.returncode == 2
        and "is a file, expected an engine directory" in res.stderr
        and "Traceback" not in res.stderr
    )
    assert (occupied / "notes.txt").read_text() == "mine" and blocker.read_text() == ""
    assert left_in(tmp_path) == ["file", "misfit", "occupied"]  # nothing half-written


def test_concurrent_builds_of_one_engine_build_it_once(demo_checkpoints, tmp_path, monkeypatch):
    """Two builds of the same output (two build Jobs of one engine): the second waits for the first's lock, then
    reuses its engine instead of moving another directory into place."""
    import threading
    import time

    import specdec_kit.export.builder as builder

    release, loads = threading.Event(), []
    load = builder.TargetModel.from_pretrained

    def held_load(*args, **kwargs):  # the first build stays inside its lock until the test lets it go
        loads.append(1)
        release.wait(60)
        return load(*args, **kwargs)

    monkeypatch.setattr(builder.TargetModel, "from_pretrained", held_load)
    results, steps = {}, []

    def run(name: str) -> None:
        results[name] = build_engine(
            inputs_for(demo_checkpoints, "griffin", "torch"),
            tmp_path / "eng",
            step=lambda msg: steps.append((name, msg)),
        )

    first = threading.Thread(target=run, args=("first",))
    first.start()
    while not loads:
        time.sleep(0.01)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    deadline = time.monotonic() + 60
    while ("second", f"waiting for another build of {tmp_path / 'eng'} to finish") not in steps:
        assert time.monotonic() < deadline, steps
        time.sleep(0.01)
    release.set()
    first.join(120)
    second.join(120)
    assert not results["first"].reused and results["second"].reused and len(loads) == 1
    assert results["second"].manifest == results["first"].manifest
    assert left_in(tmp_path) == ["eng"]


def test_a_failure_after_staging_removes_the_staging_directory(demo_checkpoints, tmp_path, monkeypatch):
    import specdec_kit.export.builder as builder

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(builder, "write_manifest", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        build_engine(inputs_for(demo_checkpoints, "griffin", "torch"), tmp_path / "eng")
    assert left_in(tmp_path) == []


@pytest.mark.slow
def test_an_eagle3_engine_taps_the_target_and_fuses_in_a_graph_of_its_own(engines, torch_target):
    manifest = read_manifest(engines["eagle3"])
    layers = list(range(torch_target.num_layers))
    assert manifest["target"]["feature_layers"] == layers and manifest["draft"]["feature_layers"] == layers
    assert manifest["draft"]["draft_vocab_size"] == 3 * torch_target.vocab_size // 4
    assert {"draft_fuse", "draft_fuse_optimized"} <= set(manifest["artifacts"])
    engine = open_engine(engines["eagle3"], device="cpu")
    assert engine.target.feature_size == len(layers) * torch_target.hidden_size


def test_extra_trees_are_refused_where_no_one_call_graph_would_carry_them(checkpoints, tmp_path):
    """Extra trees are one-call draft graphs beside the engine's own: a kind, backend or build without that graph
    is told so before anything is built, and a malformed tree names itself."""
    from specdec_kit.export.cli import parse_extra_trees

    extra = (tree_to_dict(EXTRA_TREE),)
    cases = {
        "medusa": inputs_for(checkpoints, "medusa", extra_trees=extra),
        "torch": inputs_for(checkpoints, "griffin", "torch", extra_trees=extra),
        "no graph": inputs_for(checkpoints, "griffin", tree=ONE_CALL_TREE, draft_tree=False, extra_trees=extra),
    }
    for name, inputs in cases.items():
        with pytest.raises(BuildError, match="--extra-trees: one-call draft graphs"):
            build_engine(inputs, tmp_path / name)
    assert not list(tmp_path.rglob("manifest.json"))
    assert parse_extra_trees("4:3:1, 8:3:2") == (
        tree_to_dict(DynamicTreeConfig(4, 3, 1)),
        tree_to_dict(DynamicTreeConfig(8, 3, 2)),
    )
    with pytest.raises(BuildError, match="'4:3' is not TOTAL_TOKENS:DEPTH:TOP_K"):
        parse_extra_trees("6:3:2,4:3")


def test_extra_trees_leave_out_the_engines_own_tree_and_repeats(checkpoints):
    """Naming the engine's own tree, or a tree twice, among the extra trees builds the same engine: the same graphs,
    the same digest (a reuse, not a rebuild)."""
    own, extra = ONE_CALL_TREE, tree_to_dict(EXTRA_TREE)
    plain = inputs_for(checkpoints, "griffin", tree=own, extra_trees=(extra,))
    named = inputs_for(checkpoints, "griffin", tree=own, extra_trees=(own, extra, extra))
    assert named.extra_trees == (extra,)
    assert named.digest() == plain.digest()
    assert inputs_for(checkpoints, "griffin", tree=own, extra_trees=(own,)).extra_trees == ()


def _drafting(drafter) -> list:
    """The trees ``drafter`` drafts from now on, recorded as it returns them."""
    drafted = []
    original = drafter.draft
    drafter.draft = lambda *a: drafted.append(original(*a)) or drafted[-1]
    return drafted


def test_a_reduced_vocabulary_engine_drafts_each_requests_own_tokens_beside_its_vocabulary(
    demo_checkpoints, torch_target, tmp_path
):
    """A GRIFFIN head over a quarter-reduced vocabulary of the target's rows: its engine carries what the drafter joins
    tokens with, and both its draft graphs (the one-call tree and the level-by-level step) draft tokens of the
    request's own outside the vocabulary, the output staying the target's greedy decoding. Opened with
    ``joined_vocab=False`` (``--joined-vocab off``) the same engine drafts inside its vocabulary alone, never reading
    the file, with the same output."""
    from specdec_kit.runtime.checkpoint import save_draft
    from specdec_kit.runtime.decoding import joined_vocab
    from specdec_kit.runtime.synthetic import with_draft_vocab

    vocab = torch_target.vocab_size
    reduced = with_draft_vocab(load_draft_for(torch_target, "griffin", demo_checkpoints["griffin"]), 3 * vocab // 4)
    head = save_draft(reduced, tmp_path / "head", "griffin").parent
    built = build_engine(
        inputs_for(dict(demo_checkpoints, griffin=head), "griffin", tree=ONE_CALL_TREE), tmp_path / "eng"
    ).path
    manifest = read_manifest(built)
    assert manifest["onnx"]["joined_vocab"] == "joined_vocab.safetensors"
    engine = open_engine(built, device="cpu")
    outside = ~reduced.t2d
    asked = [p + torch.nonzero(outside)[::2, 0].tolist() for p in prompts(vocab, 3)]  # half the ids outside
    plain = SpeculativeGenerator(engine.target, NoDrafter())
    for tree in (engine.tree, DynamicTreeConfig(5, 2, 2)):  # one call; level by level
        drafter = engine.drafter_for(tree)
        assert drafter.joined is not None and drafter.step.drafts_whole(tree) == (tree == engine.tree)
        drafted = _drafting(drafter)
        spec = SpeculativeGenerator(engine.target, drafter)
        for p in asked:
            assert spec.generate([p], 24)[0].tokens == plain.generate([p], 24)[0].tokens
        tokens = torch.cat([t.tokens[:, 1:].flatten() for t in drafted])
        own = {t for p in asked for t in p + plain.generate([p], 24)[0].tokens}
        assert bool(outside[tokens].any())  # joined tokens were drafted
        assert set(tokens[outside[tokens]].tolist()) <= own  # and only the requests' own

    joined_vocab._engine_tensors.cache_clear()
    fixed = open_engine(built, device="cpu", joined_vocab=False)
    for tree in (fixed.tree, DynamicTreeConfig(5, 2, 2)):
        drafter = fixed.drafter_for(tree)
        assert drafter.joined is None
        drafted = _drafting(drafter)
        spec = SpeculativeGenerator(fixed.target, drafter)
        for p in asked:
            assert spec.generate([p], 24)[0].tokens == plain.generate([p], 24)[0].tokens
        tokens = torch.cat([t.tokens[:, 1:].flatten() for t in drafted])
        valid = torch.cat([t.valid[:, 1:].flatten() for t in drafted])
        assert not bool(outside[tokens[valid]].any())  # the vocabulary as trained
    assert joined_vocab._engine_tensors.cache_info().currsize == 0  # its file never read
