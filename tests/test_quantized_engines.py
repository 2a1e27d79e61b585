"""Quantized ONNX Runtime engines (``--weights int4``, ``--draft-weights int8``): every constant MatMul weight of the
quantized part is quantized in each of its graphs, the target computes in float and the draft in int8, speculation
through the engine is exactly the same engine's plain decoding (a quantized target is its own reference; a float one
is still PyTorch's), and the build reports, without bounding, how far a quantized target's greedy tokens stray from
the float model's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import griffin_inputs, make_prompts

from specdec_kit.bench.cycle_profile import graphs_of
from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildInputs
from specdec_kit.export.quantize import gemms_as_matmuls, untie_transposed_weights
from specdec_kit.runtime.core.manifest import read_manifest
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.engine import open_engine

REPO = Path(__file__).resolve().parents[1]
TREE = DynamicTreeConfig(6, 2, 2)  # small: the one-call draft graph is exported and quantized too


def inputs(paths: dict, weights: str, draft_weights: str) -> BuildInputs:
    return griffin_inputs(paths, TREE, weights=weights, draft_weights=draft_weights)


@pytest.fixture(scope="module")
def quantized(demo_checkpoints, tmp_path_factory) -> Path:
    """One engine quantizes both parts (a draft's int8 alone changes nothing the target's checks see)."""
    out = tmp_path_factory.mktemp("quantized") / "int4-draftint8"
    return build_engine(inputs(demo_checkpoints, "int4", "int8"), out).path


def matmuls(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """One graph's float products by a constant matrix (MatMul or Gemm), and its MatMulNBits' (bits, accuracy
    level)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    constants = {init.name for init in graph.initializer}
    float_weights = sum(n.op_type in ("MatMul", "Gemm") and n.input[1] in constants for n in graph.node)
    attrs = [{a.name: a.i for a in n.attribute} for n in graph.node if n.op_type == "MatMulNBits"]
    return float_weights, [(a["bits"], a["accuracy_level"]) for a in attrs]


def test_each_part_stores_its_weights_in_its_format(quantized):
    m = read_manifest(quantized)
    section = m["onnx"]["weights"]
    assert m["inputs"]["options"]["weights"] == "int4" and m["inputs"]["options"]["draft_weights"] == "int8"
    expected = {"target_step": (4, 1), "draft_step": (8, 4), "draft_tree": (8, 4)}
    assert {r for r in m["artifacts"] if not r.endswith("_optimized")} == set(expected)
    for role, quant in expected.items():
        for artifact in (role, f"{role}_optimized"):  # the build's graph optimizations keep them
            float_weights, nbits = matmuls(quantized / m["artifacts"][artifact])
            # the target multiplies in float (accuracy level 1), a draft in int8 (4)
            assert float_weights == 0 and set(nbits) == {quant}, artifact
            counts = section["target" if role == "target_step" else "draft"]["quantized_matmuls"]
            assert len(nbits) == (counts if role == "target_step" else counts[role]) > 0, artifact
    assert section["draft"]["format"] == "int8" and section["target"]["format"] == "int4"
    assert section["target"]["block_size"] == 32 and m["onnx"]["parity_bound"] is None
    assert m["onnx"]["greedy_identical_to_plain"] is True and "greedy_identical_to_torch" not in m["onnx"]
    assert 0.0 <= m["onnx"]["greedy_agreement_with_float"] <= 1.0


def test_speculation_equals_the_quantized_engines_own_plain_decoding(quantized):
    engine = open_engine(quantized, device="cpu")
    assert engine.drafter is not None
    assert engine.drafter.step.whole is not None  # the quantized one-call draft graph drafts each cycle
    batch = make_prompts(engine.target.vocab_size, 6, seed=11, lo=2, hi=15)
    plain = SpeculativeGenerator(engine.target, None).generate(batch, 40)
    together = engine.generator().generate(batch, 40)
    one_by_one = [engine.generator().generate([p], 40)[0] for p in batch[:3]]
    assert [r.tokens for r in together] == [r.tokens for r in plain]
    assert [r.tokens for r in one_by_one] == [r.tokens for r in plain[:3]]
    assert sum(r.stats.accepted_tokens for r in together) > 0  # quantized drafts still get accepted


def test_an_onnx_runtime_engine_decodes_with_torch_on_one_thread(quantized):
    """ONNX Runtime's pools own the cores while the loop runs, through ``generate`` or through the stages the server's
    scheduler drives one by one; torch's count is restored after each."""
    engine = open_engine(quantized, device="cpu")
    graphs = graphs_of(engine)
    assert {"target_step", "draft_step", "draft_tree"} <= set(graphs)
    seen: list[tuple[str, int]] = []

    def recording(role: str, run):
        def run_and_record(*args, **kwargs):
            seen.append((role, torch.get_num_threads()))
            return run(*args, **kwargs)

        return run_and_record

    for role, graph in graphs.items():
        graph.run = recording(role, graph.run)
    prompts = make_prompts(engine.target.vocab_size, 2, seed=3, lo=2, hi=9)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = engine.generator()
        gen.generate(prompts, 12)
        assert torch.get_num_threads() == 2
        batch = gen.admit(None, gen.prefill(prompts[:1], [12], [SamplingParams()]))
        batch = gen.admit(batch, gen.prefill(prompts[1:], [12], [SamplingParams()]))  # a prompt joining a running batch
        assert torch.get_num_threads() == 2
        while batch.size:
            gen.cycle(batch)
            gen.retire(batch)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert {role for role, _ in seen} == {"target_step", "draft_step", "draft_tree"}
    assert {threads for _, threads in seen} == {1}


def test_a_quantized_target_stores_its_matrices_in_a_sixth_of_the_room(quantized, demo_checkpoints):
    from onnx import numpy_helper
    from safetensors.torch import load_file

    graph = onnx.load(str(quantized / read_manifest(quantized)["artifacts"]["target_step"])).graph
    stored = sum(numpy_helper.to_array(init).nbytes for init in graph.initializer)
    tensors = load_file(demo_checkpoints["target"] / "model.safetensors")
    stays_float = 4 * sum(t.numel() for name, t in tensors.items() if t.dim() == 1 or "embed_tokens" in name)
    matrices = 4 * sum(t.numel() for name, t in tensors.items() if t.dim() == 2 and "embed_tokens" not in name)
    # 4 bits and a float scale per 32 weights: 0.625 bytes a weight instead of 4
    assert stays_float < stored < stays_float + matrices / 6


def test_a_tied_lm_head_is_untied_into_its_own_quantizable_weight():
    from onnx import helper, numpy_helper

    table = numpy_helper.from_array(torch.randn(10, 4).numpy(), "embed")
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["h"]),
        helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "embed_t"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [3, 10])],
        [table],
    )
    model = helper.make_model(graph)
    assert untie_transposed_weights(model) == 1
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert constants["embed_t"].shape == (4, 10) and (constants["embed_t"] == constants["embed"].T).all()
    assert [n.op_type for n in model.graph.node] == ["Gather", "MatMul"]


def test_a_gemm_by_a_constant_becomes_a_matmul_the_quantizer_reads():
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    weight, bias = torch.randn(6, 4).numpy(), torch.randn(6).numpy()
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["with_bias"], transB=1),
        helper.make_node("Gemm", ["x", "w"], ["without"], transB=1),
        helper.make_node("Gemm", ["x", "w_t"], ["scaled"], alpha=2.0),  # not a plain product: left alone
    ]
    graph = helper.make_graph(
        nodes,
        "gemms",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [3, 6]) for n in ("with_bias", "without", "scaled")],
        [numpy_helper.from_array(a, n) for a, n in ((weight, "w"), (bias, "b"), (weight.T.copy(), "w_t"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = torch.randn(3, 4).numpy()

    def outputs(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    before = outputs(model)
    assert gemms_as_matmuls(model) == 2
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add", "MatMul", "Gemm"]
    for got, expected in zip(outputs(model), before):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def run_builder(*args: str, cwd: Path, draft: str = "griffin") -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "export" / "build_engine.py"), "--draft", draft, *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True)


def test_the_builder_refuses_unknown_formats_serving_engines_and_weightless_drafts(tmp_path):
    unknown = run_builder("--weights", "int2", cwd=tmp_path)
    assert unknown.returncode == 2 and "invalid choice: 'int2'" in unknown.stderr
    served = run_builder("--weights", "int4", "--backend", "vllm", cwd=tmp_path)
    assert served.returncode == 2 and "Traceback" not in served.stderr
    assert "--weights int4: quantized weights are built for the onnxruntime backend; --backend vllm" in served.stderr
    weightless = run_builder("--draft-weights", "int8", draft="ngram", cwd=tmp_path)
    assert weightless.returncode == 2 and "a ngram draft has no weights to quantize" in weightless.stderr
    assert not list(tmp_path.rglob("manifest.json"))  # nothing built


def q4_1_weight(rows: int, width: int, rng) -> np.ndarray:
    """A [rows, width] matrix as a dequantized Q4_1 file holds it: per block of 32, float16 scale x code + minimum."""
    codes = rng.integers(0, 16, size=(rows, width // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1's grid runs from each block's minimum to its maximum
    scales = (rng.random((rows, width // 32, 1)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    minima = -(rng.random((rows, width // 32, 1)) * 0.1).astype(np.float32)
    return (scales * codes + minima).astype(np.float32).reshape(rows, width)


def test_weights_already_on_a_4_bit_grid_are_stored_as_they_are(tmp_path):
    """A checkpoint dequantized from a 4-bit file keeps its own weights in an int4 engine (not rounded again onto
    another grid); a matrix off the grid then stays float. Exact up to float rounding of the products."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from specdec_kit.export.quantize import TARGET_WEIGHTS, grid_codes, quantize_graph

    rng = np.random.default_rng(0)
    on_grid, off_grid = q4_1_weight(48, 64, rng), rng.standard_normal((48, 48)).astype(np.float32)
    assert grid_codes(off_grid, 32) is None
    nudged = on_grid.copy()
    nudged[3, 5] = np.nextafter(nudged[3, 5], np.float32(1))  # one weight one ulp off its grid
    assert grid_codes(nudged, 32) is None
    codes, scales, minima = grid_codes(on_grid, 32)
    assert codes.shape == (48, 2, 32) and codes.max() == 15 and scales.shape == minima.shape == (48, 2)

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "v"], ["y"])],
        "two",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, None, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, None, 48])],
        [numpy_helper.from_array(on_grid.T.copy(), "w"), numpy_helper.from_array(off_grid.T.copy(), "v")],
    )
    path = tmp_path / "two.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, location="two.onnx.data", size_threshold=0)
    assert quantize_graph(path, TARGET_WEIGHTS["int4"]) == {"matmuls": 1, "on_grid": 1, "kept_float": 1}
    onnx.checker.check_model(str(path))
    ops = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops == ["MatMulNBits", "MatMul", "MatMul", "Add", "MatMul"]  # codes, the minima's product, float v
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    expected = x @ on_grid.T @ off_grid.T
    assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max()


def test_merged_products_of_4_bit_weights_stay_on_their_grid(tmp_path):
    """The build merges q/k/v-like products before quantizing: their weights side by side are still each row's own
    4-bit blocks, so an int4 target stores the merged product exactly too."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from specdec_kit.export.graph_fusions import fuse_graph
    from specdec_kit.export.quantize import TARGET_WEIGHTS, quantize_graph

    rng = np.random.default_rng(1)
    wide, narrow = q4_1_weight(48, 64, rng), q4_1_weight(16, 64, rng)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "a"], ["ya"]), helper.make_node("MatMul", ["x", "b"], ["yb"])],
        "pair",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, None, 64])],
        [
            helper.make_tensor_value_info("ya", onnx.TensorProto.FLOAT, [None, None, 48]),
            helper.make_tensor_value_info("yb", onnx.TensorProto.FLOAT, [None, None, 16]),
        ],
        [numpy_helper.from_array(wide.T.copy(), "a"), numpy_helper.from_array(narrow.T.copy(), "b")],
    )
    path = tmp_path / "pair.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save_model(model, str(path), save_as_external_data=True, location="pair.onnx.data", size_threshold=1024)
    assert fuse_graph(path)["shared_input_matmuls"] == 1
    assert quantize_graph(path, TARGET_WEIGHTS["int4"]) == {"matmuls": 1, "on_grid": 1, "kept_float": 0}
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for out, weight in zip(got, (wide, narrow)):
        expected = x @ weight.T
        assert np.abs(out - expected).max() < 1e-5 * np.abs(expected).max()
