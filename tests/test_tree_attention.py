"""The kit's ONNX Runtime CPU operator ``specdec.TreeAttention`` (``runtime/ort/tree_attention.c``) and the graph
rewrite that uses it (``runtime/ort/packed_graphs.py``): ONNX Runtime's own Attention computes the same within float
error (grouped-query heads, broadcast masks, masked and unmasked slots, a scale attribute, a row that sees nothing), a
row's result does not depend on the rows beside it or on the masked slots after it, and only the Attention nodes it
computes exactly as ONNX defines them are rewritten."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specdec_kit.runtime.ort import custom_ops
from specdec_kit.runtime.ort.custom_ops import custom_op_library
from specdec_kit.runtime.ort.packed_graphs import rewrite

pytestmark = pytest.mark.usefixtures("own_kernel_cache")  # the library and graphs built per test


def attention_model(mask_rank: int = 4, mask_type: int = TensorProto.BOOL, **attrs) -> onnx.ModelProto:
    """ONNX's Attention over 4-D q, k, v and a mask of ``mask_rank`` dimensions."""
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "attention",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, [None, None, None, None]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, [None, None, None, None]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [None, None, None, None]),
            helper.make_tensor_value_info("mask", mask_type, [None] * mask_rank),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 10
    return model


def session(model: onnx.ModelProto, kit: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if kit:
        library = custom_op_library().library
        assert library is not None  # this machine has a C compiler: the library must build
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def pair(mask_rank: int = 4, **attrs) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """ONNX Runtime's Attention and the rewritten graph's ``TreeAttention``."""
    model = attention_model(mask_rank, **attrs)
    reference = session(model, kit=False)
    assert rewrite(model) == 1
    assert [(n.domain, n.op_type) for n in model.graph.node] == [("specdec", "TreeAttention")]
    return reference, session(model, kit=True)


def inputs(rng, batch, heads, kv_heads, rows, length, dim, vdim=None, mask_shape=None, visible=0.7):
    q = rng.standard_normal((batch, heads, rows, dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, length, dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, length, vdim or dim)).astype(np.float32)
    mask = rng.random(mask_shape or (batch, 1, rows, length)) < visible
    mask[..., 0] = True
    return {"q": q, "k": k, "v": v, "mask": mask}


@pytest.mark.parametrize(
    "batch,heads,kv_heads,rows,length,dim,vdim",
    [
        (1, 9, 3, 1, 64, 64, None),  # SmolLM2's heads, a plain step
        (1, 9, 3, 8, 200, 64, None),  # a verified tree; positions not a multiple of 16
        (1, 9, 3, 7, 333, 64, None),  # 21 rows a key/value head: value tiles of 6, 5, 5 and 5 rows
        (2, 4, 4, 5, 37, 32, None),  # several sequences, as many key heads as query heads
        (1, 6, 2, 3, 50, 24, 40),  # a head size that is no multiple of 16, another value size
        (1, 2, 1, 40, 40, 16, None),  # a prompt's rows
        (1, 3, 1, 150, 160, 64, None),  # a longer prompt's, scored 64 rows at a time
        (1, 9, 3, 8, 700, 64, None),  # a tree over a long context: several chunks of positions, the last one partial
        (1, 9, 3, 70, 300, 64, None),  # rows in two passes over several chunks
        (1, 6, 2, 4, 290, 24, 40),  # several chunks with the generic head size
    ],
)
def test_tree_attention_equals_onnx_runtimes_attention(batch, heads, kv_heads, rows, length, dim, vdim):
    rng = np.random.default_rng(rows * 31 + length)
    reference, kit = pair()
    feeds = inputs(rng, batch, heads, kv_heads, rows, length, dim, vdim)
    want, got = reference.run(None, feeds)[0], kit.run(None, feeds)[0]
    assert got.shape == want.shape == (batch, heads, rows, vdim or dim)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("mask_shape", [(1, 1, 4, 48), (1, 3, 4, 48), (4, 48), (1, 4, 48)])
def test_broadcast_masks_and_a_scale_attribute(mask_shape):
    rng = np.random.default_rng(len(mask_shape))
    reference, kit = pair(mask_rank=len(mask_shape), scale=0.3)
    feeds = inputs(rng, 1, 3, 1, 4, 48, 32, mask_shape=mask_shape)
    np.testing.assert_allclose(kit.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-5, atol=2e-6)


def test_a_row_that_sees_nothing_gets_zeros_as_onnx_runtime_gives():
    rng = np.random.default_rng(5)
    reference, kit = pair()
    feeds = inputs(rng, 1, 2, 1, 3, 20, 16)
    feeds["mask"][:, :, 1] = False
    got = kit.run(None, feeds)[0]
    assert not got[:, :, 1].any()
    np.testing.assert_allclose(got, reference.run(None, feeds)[0], rtol=1e-5, atol=2e-6)


def test_chunks_no_row_sees_are_skipped_and_a_row_may_see_only_the_last():
    """Positions come in chunks, each row's merged in order: a chunk in the middle that every row misses, and a row
    that sees nothing before the last chunk, give what ONNX Runtime gives."""
    rng = np.random.default_rng(11)
    reference, kit = pair()
    feeds = inputs(rng, 1, 9, 3, 4, 520, 64)
    feeds["mask"][..., 128:300] = False
    feeds["mask"][:, :, 2, :500] = False
    want, got = reference.run(None, feeds)[0], kit.run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("length", [192, 600])  # one chunk and a partial one; several
def test_a_rows_result_is_the_same_bit_for_bit_alone_in_a_tree_and_before_more_masked_slots(length):
    """A plain step (one row over the cache) and a verified tree (that row among others, the cache grown by a block
    of slots no row sees) give the row the same bits: greedy verification then accepts what plain decoding picks."""
    rng = np.random.default_rng(7)
    _, kit = pair()
    feeds = inputs(rng, 1, 9, 3, 8, length, 64, visible=1.0)
    tree = kit.run(None, feeds)[0]
    for row in (0, 3, 7):
        alone = {name: value for name, value in feeds.items()}
        alone["q"], alone["mask"] = feeds["q"][:, :, row : row + 1], feeds["mask"][:, :, row : row + 1]
        assert np.array_equal(kit.run(None, alone)[0][:, :, 0], tree[:, :, row])
        grown = dict(alone)
        grown["k"] = np.concatenate([feeds["k"], rng.standard_normal((1, 3, 64, 64)).astype(np.float32)], axis=2)
        grown["v"] = np.concatenate([feeds["v"], rng.standard_normal((1, 3, 64, 64)).astype(np.float32)], axis=2)
        grown["mask"] = np.concatenate([alone["mask"], np.zeros((1, 1, 1, 64), bool)], axis=3)
        assert np.array_equal(kit.run(None, grown)[0][:, :, 0], tree[:, :, row])


@pytest.mark.parametrize(
    "attrs,mask_type",
    [
        ({"is_causal": 1}, TensorProto.BOOL),
        ({"softcap": 30.0}, TensorProto.BOOL),
        ({"qk_matmul_output_mode": 1}, TensorProto.BOOL),
        ({}, TensorProto.FLOAT),  # an additive mask
    ],
)
def test_attention_it_would_not_compute_as_defined_stays_onnx_runtimes(attrs, mask_type):
    model = attention_model(mask_type=mask_type, **attrs)
    assert rewrite(model) == 0
    assert [n.op_type for n in model.graph.node] == ["Attention"]


def test_the_mask_type_is_found_through_the_shape_nodes_before_it_and_the_rewrite_can_be_switched_off(monkeypatch):
    model = attention_model()
    graph = model.graph
    graph.input[3].CopyFrom(helper.make_tensor_value_info("slots", TensorProto.BOOL, [None, None, None]))
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph.initializer.append(axes)
    graph.node.insert(0, helper.make_node("Unsqueeze", ["slots", "axes"], ["mask"]))
    assert rewrite(onnx.ModelProto.FromString(model.SerializeToString())) == 1
    assert rewrite(onnx.ModelProto.FromString(model.SerializeToString()), attention=False) == 0
    monkeypatch.setenv(custom_ops.ATTENTION_SWITCH_ENV, "0")
    assert rewrite(model) == 0
