"""The kit's ONNX Runtime CPU operator ``specdec.Int8MatMul`` (``runtime/ort/int8_matmul.c``) and the rewrite of 8-bit
``MatMulNBits`` into it (``runtime/ort/packed_graphs.py``): ONNX Runtime's own results for a draft's int8 products,
the operator's defined arithmetic exactly, a row's result independent of the rows beside it, the scalar build equal
to the vector one, and only the nodes it computes rewritten."""

from __future__ import annotations

import logging
import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec_kit.runtime.ort import custom_ops
from specdec_kit.runtime.ort.custom_ops import custom_op_library, int8_matmul_vectorized
from specdec_kit.runtime.ort.packed_graphs import pack_int8_codes, rewrite

pytestmark = pytest.mark.usefixtures("own_kernel_cache")  # the library and graphs built per test


def quantized_model(shapes: list[tuple[int, int]], rank: int = 2, bias: bool = False, level: int = 4, bits: int = 8):
    """One product per (K, N) of ``shapes``, x{i} [..., K] by a constant, quantized by ONNX Runtime's own quantizer
    as the kit's ``--draft-weights int8`` does (symmetric, blocks of 32); the first with a bias where ``bias``."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(len(shapes) + rank)
    nodes, inputs, outputs, weights = [], [], [], []
    for i, (k, n) in enumerate(shapes):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [None] * (rank - 1) + [k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
        weights.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.05).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"], name=f"product{i}"))
    model = helper.make_model(
        helper.make_graph(nodes, "products", inputs, outputs, weights), opset_imports=[helper.make_opsetid("", 18)]
    )
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=level)
    quantizer.process()
    model = quantizer.model.model
    if bias:
        first = model.graph.node[0]
        model.graph.initializer.append(
            numpy_helper.from_array(rng.standard_normal(shapes[0][1]).astype(np.float32), "bias0")
        )
        first.input.extend([""] * (5 - len(first.input)) + ["bias0"])
    return model


def session(model: onnx.ModelProto, library=None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def rewritten(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    return copy, rewrite(copy, int8=True)


def needs_vnni():
    library = custom_op_library().library
    assert library is not None, custom_op_library().reason  # this machine has a C compiler
    if not int8_matmul_vectorized():
        pytest.skip("this CPU has no AVX-512 VNNI: the rewrite keeps ONNX Runtime's MatMulNBits here")
    return library


def reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """The operator's arithmetic in NumPy: per row and block of 32, x quantized by the block's largest magnitude,
    the integer dot product exact, the blocks summed in order with one float32 rounding each."""
    rows, k = x.shape
    n, blocks, _ = codes.shape
    signed = codes.reshape(n, k).astype(np.int64) - 128
    out = np.zeros((rows, n), np.float32)
    for r in range(rows):
        for b in range(blocks):
            part = x[r, b * 32 : (b + 1) * 32]
            top = np.float32(np.abs(part).max())
            inverse = np.float32(127) / top if top > 0 else np.float32(0)
            xq = np.rint(part * inverse).astype(np.int64)
            dots = (signed[:, b * 32 : (b + 1) * 32] @ xq).astype(np.float32)
            step = scales[:, b] * (top / np.float32(127))
            out[r] = (out[r].astype(np.float64) + dots.astype(np.float64) * step.astype(np.float64)).astype(np.float32)
    return out if bias is None else out + bias


def test_packing_lays_four_ks_of_16_columns_in_a_vector_with_each_blocks_offset_share():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (20, 2, 32), dtype=np.uint8)  # N 20, K 64
    scales = rng.standard_normal((20, 2)).astype(np.float32)
    lanes, packed_scales, corrections = pack_int8_codes(codes, scales)
    signed = codes.reshape(20, 64).astype(np.int32) - 128
    assert lanes.shape == (2, 16, 16, 4) and lanes.dtype == np.int8
    assert packed_scales.shape == corrections.shape == (2, 2, 16) and corrections.dtype == np.int32
    assert lanes[0, 3, 5, 2] == signed[5, 3 * 4 + 2] and lanes[1, 15, 3, 1] == signed[19, 61]
    assert not lanes[1, :, 4:].any() and not packed_scales[1, :, 4:].any()  # columns 20-31 padded with zeros
    assert packed_scales[1, 1, 2] == scales[18, 1]
    assert corrections[0, 1, 7] == 128 * signed[7, 32:].sum()


@pytest.mark.parametrize("rank", [2, 3])
def test_int8_products_are_onnx_runtimes_matmulnbits_results(rank):
    library = needs_vnni()
    shapes = [(32, 5), (96, 16), (64, 40), (576, 257)]
    model = quantized_model(shapes, rank, bias=True)
    ours, replaced = rewritten(model)
    assert replaced == len(shapes) and {n.op_type for n in ours.graph.node} == {"Int8MatMul"}
    want, got = session(model), session(ours, library)
    rng = np.random.default_rng(rank)
    leading = {2: [(0,), (1,), (3,), (8,), (9,), (17,), (40,)], 3: [(2, 1), (2, 6), (3, 9)]}[rank]
    for lead in leading:
        feeds = {f"x{i}": rng.standard_normal((*lead, k)).astype(np.float32) for i, (k, _) in enumerate(shapes)}
        for a, b in zip(want.run(None, feeds), got.run(None, feeds)):
            assert a.shape == b.shape
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(a).max(initial=0))))


def test_int8_products_are_the_operators_defined_arithmetic():
    library = needs_vnni()
    model = quantized_model([(96, 40)], bias=True)
    ours, _ = rewritten(model)
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = model.graph.node[0]
    codes = constants[node.input[1]].reshape(40, 3, 32)
    scales = constants[node.input[2]].reshape(40, 3)
    x = np.random.default_rng(5).standard_normal((6, 96)).astype(np.float32)
    x[2, :32] = 0.0  # a block of zeros: scale 0, no division by it
    got = session(ours, library).run(None, {"x0": x})[0]
    np.testing.assert_allclose(got, reference(x, codes, scales, constants["bias0"]), rtol=1e-6, atol=1e-6)


def test_a_rows_product_is_the_same_bit_for_bit_whichever_rows_share_the_call():
    library = needs_vnni()
    ours, _ = rewritten(quantized_model([(576, 200)]))
    run = session(ours, library)
    rows = np.random.default_rng(1).standard_normal((21, 576)).astype(np.float32)  # tiles of 7 rows
    together = run.run(None, {"x0": rows})[0]
    for i in (0, 6, 7, 13, 20):
        assert np.array_equal(run.run(None, {"x0": rows[i : i + 1]})[0][0], together[i])


def test_the_scalar_build_computes_the_vector_builds_results_bit_for_bit(tmp_path):
    library = needs_vnni()
    compiler = custom_ops._compiler()
    scalar = tmp_path / "scalar.so"
    sources = [str(s) for s in custom_ops.SOURCES if s.suffix == ".c"]
    flags = [*custom_ops.FLAGS, "-mno-avx512vnni"]
    subprocess.run([compiler, *flags, *sources, "-o", str(scalar), *custom_ops.LIBRARIES], check=True)
    import ctypes

    assert ctypes.CDLL(str(scalar)).specdec_int8_matmul_vectorized() == 0
    ours, _ = rewritten(quantized_model([(96, 40), (64, 17)], bias=True))
    rng = np.random.default_rng(2)
    feeds = {
        "x0": rng.standard_normal((5, 96)).astype(np.float32),
        "x1": rng.standard_normal((5, 64)).astype(np.float32),
    }
    for a, b in zip(session(ours, library).run(None, feeds), session(ours, scalar).run(None, feeds)):
        assert np.array_equal(a, b)


def test_only_8_bit_int8_compute_nodes_are_rewritten_and_a_shared_weight_is_packed_once():
    for model in (quantized_model([(64, 16)], level=1), quantized_model([(64, 16)], bits=4)):
        copy, replaced = rewritten(model)
        assert replaced == 0 and [n.op_type for n in copy.graph.node] == ["MatMulNBits"]
    model = quantized_model([(64, 16)])
    node = model.graph.node[0]
    model.graph.node.append(
        helper.make_node(
            "MatMulNBits",
            ["x0", *node.input[1:]],
            ["again"],
            **{a.name: helper.get_attribute_value(a) for a in node.attribute},
            domain=node.domain,
        )
    )
    model.graph.output.append(helper.make_tensor_value_info("again", TensorProto.FLOAT, None))
    copy, replaced = rewritten(model)
    assert replaced == 2
    names = [i.name for i in copy.graph.initializer]
    assert len(names) == len(set(names)) and sum(name.endswith(".vnni") for name in names) == 1
    kept = onnx.ModelProto.FromString(model.SerializeToString())
    assert rewrite(kept, int8=False) == 0 and {n.op_type for n in kept.graph.node} == {"MatMulNBits"}
