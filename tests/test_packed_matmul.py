"""The kit's ONNX Runtime CPU operator ``specdec.PackedMatMul`` (``runtime/ort/packed_matmul.c``) and the graph
rewrite that uses it (``runtime/ort/packed_graphs.py``): the same products as ONNX Runtime's MatMul, a row's result
independent of the rows beside it, the rewrite limited to constant float weights, cached, and switchable off."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec_kit.runtime.ort import custom_ops
from specdec_kit.runtime.ort.backend import OrtGraph
from specdec_kit.runtime.ort.custom_ops import custom_op_library
from specdec_kit.runtime.ort.packed_graphs import pack_weight, packed_graph, rewrite

pytestmark = pytest.mark.usefixtures("own_kernel_cache")  # the library and graphs built per test


def library():
    ops = custom_op_library()
    assert ops.library is not None, ops.reason  # this machine has a C compiler: the library must build
    return ops.library


def session(model: onnx.ModelProto, path, packed: bool) -> ort.InferenceSession:
    onnx.save(model, str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if packed:
        options.register_custom_ops_library(str(library()))
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def matmul_model(weights: list[np.ndarray], rank: int) -> onnx.ModelProto:
    """x [.., K] times each weight, one output each; a last MatMul of x by a graph input (no constant to pack)."""
    k = weights[0].shape[0]
    dims = [None] * (rank - 1) + [k]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(len(weights))]
    nodes.append(helper.make_node("MatMul", ["x", "free"], ["y_free"]))
    graph = helper.make_graph(
        nodes,
        "products",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
            helper.make_tensor_value_info("free", TensorProto.FLOAT, [k, 3]),
        ],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(weights))]
        + [helper.make_tensor_value_info("y_free", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_packing_puts_each_block_of_32_columns_contiguous_and_pads_the_last():
    w = np.arange(3 * 40, dtype=np.float32).reshape(3, 40)
    packed = pack_weight(w)
    assert packed.shape == (2, 3, 32)
    assert np.array_equal(packed[0], w[:, :32])
    assert np.array_equal(packed[1, :, :8], w[:, 32:]) and not packed[1, :, 8:].any()


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_packed_products_equal_onnx_runtimes_matmul(tmp_path, rank):
    rng = np.random.default_rng(rank)
    k = 70
    weights = [(rng.standard_normal((k, n)) * 0.1).astype(np.float32) for n in (1, 32, 100, 257)]
    model = matmul_model(weights, rank)
    reference = session(model, tmp_path / "plain.onnx", packed=False)
    rewritten = onnx.load(str(tmp_path / "plain.onnx"))
    assert rewrite(rewritten) == len(weights)  # the MatMul by a graph input stays ONNX Runtime's
    assert [n.op_type for n in rewritten.graph.node].count("MatMul") == 1
    packed = session(rewritten, tmp_path / "packed.onnx", packed=True)
    free = rng.standard_normal((k, 3)).astype(np.float32)
    shapes = {1: [(k,)], 2: [(r, k) for r in (0, 1, 3, 8, 9, 14, 15, 17, 43)], 3: [(2, r, k) for r in (1, 6, 13)]}[rank]
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        want = reference.run(None, {"x": x, "free": free})
        got = packed.run(None, {"x": x, "free": free})
        for a, b in zip(want, got):
            assert a.shape == b.shape
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_a_rows_product_is_the_same_bit_for_bit_whichever_rows_share_the_call(tmp_path):
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((576, 96)) * 0.05).astype(np.float32)]
    model = matmul_model(weights, 2)
    rewrite(model)
    packed = session(model, tmp_path / "packed.onnx", packed=True)
    free = np.zeros((576, 3), np.float32)
    rows = rng.standard_normal((31, 576)).astype(np.float32)  # three tiles of 10-11 rows
    together = packed.run(["y0"], {"x": rows, "free": free})[0]
    for i in (0, 5, 11, 20, 30):
        alone = packed.run(["y0"], {"x": rows[i : i + 1], "free": free})[0]
        assert np.array_equal(alone[0], together[i])


def test_a_weight_other_nodes_read_stays_beside_its_packed_copy():
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((8, 40)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["w", "w"], ["twice"])],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("twice", TensorProto.FLOAT, None),
        ],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert rewrite(model) == 1
    assert sorted(i.name for i in model.graph.initializer) == ["w", "w.packed32"]
    node = model.graph.node[0]
    assert (node.domain, node.op_type, node.attribute[0].i) == ("specdec", "PackedMatMul", 40)


def test_the_packed_graph_is_written_once_follows_its_source_and_leaves_with_it(tmp_path):
    rng = np.random.default_rng(2)
    source = tmp_path / "g.onnx"
    onnx.save(matmul_model([rng.standard_normal((16, 64)).astype(np.float32)], 2), str(source))
    first = packed_graph(source)
    assert first is not None and first.exists() and first.parent != source.parent
    written = first.stat().st_mtime_ns
    assert packed_graph(source) == first and first.stat().st_mtime_ns == written
    onnx.save(matmul_model([rng.standard_normal((16, 64)).astype(np.float32)], 2), str(source))
    second = packed_graph(source)
    assert second != first and not first.parent.exists()  # the rebuilt source's old copy is gone
    other = tmp_path / "other.onnx"
    onnx.save(matmul_model([rng.standard_normal((16, 32)).astype(np.float32)], 2), str(other))
    source.unlink()
    assert packed_graph(other) is not None and not second.parent.exists()  # so is a deleted source's
    nothing = tmp_path / "none.onnx"
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "none",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(nothing))
    assert packed_graph(nothing) is None and packed_graph(nothing) is None


def test_an_ort_graph_runs_packed_on_cpu_and_says_why_not_when_switched_off(tmp_path, monkeypatch):
    import torch

    rng = np.random.default_rng(3)
    source = tmp_path / "g.onnx"
    onnx.save(matmul_model([rng.standard_normal((16, 64)).astype(np.float32)], 2), str(source))
    x = torch.from_numpy(rng.standard_normal((4, 16)).astype(np.float32))
    feeds = {"x": x, "free": torch.zeros(16, 3)}
    outputs = {"y0": ((4, 64), torch.float32), "y_free": ((4, 3), torch.float32)}
    packed = OrtGraph(source, torch.device("cpu"))
    assert packed.packed_matmul == "on"
    assert {n.op_type for n in onnx.load(str(packed.session_path)).graph.node} >= {"PackedMatMul"}
    unoptimized = OrtGraph(source, torch.device("cpu"), optimize=True)
    assert unoptimized.packed_matmul.startswith("off: graph not yet optimized")
    monkeypatch.setenv(custom_ops.SWITCH_ENV, "0")
    custom_ops.forget_library()
    plain = OrtGraph(source, torch.device("cpu"))
    assert plain.packed_matmul == f"off: {custom_ops.SWITCH_ENV}=0"
    got, want = packed.run(feeds, outputs), plain.run(feeds, outputs)
    torch.testing.assert_close(got["y0"], want["y0"], rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_library_is_absent_with_its_reason(monkeypatch):
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(custom_ops.shutil, "which", lambda name: None)
    ops = custom_op_library()
    assert ops.library is None and "no C compiler" in ops.reason


def test_the_benchmarks_machine_line_names_the_matmul_kernel(monkeypatch):
    from specdec_kit.bench.speedup import machine

    library()
    assert "float MatMuls by the kit's PackedMatMul, 8-bit draft products by " in machine()
    assert "attention by its TreeAttention" in machine()
    monkeypatch.setenv(custom_ops.ATTENTION_SWITCH_ENV, "0")
    assert f"attention by ONNX Runtime ({custom_ops.ATTENTION_SWITCH_ENV}=0)" in machine()
    monkeypatch.setenv(custom_ops.SWITCH_ENV, "0")
    custom_ops.forget_library()
    assert f"float MatMuls by ONNX Runtime ({custom_ops.SWITCH_ENV}=0)" in machine()
