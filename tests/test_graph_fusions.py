"""The build's graph rewrites (``export/graph_fusions.py``): fewer nodes, the same outputs, the norm in the form
ONNX Runtime's optimizer turns into one kernel, rotary embeddings as ONNX Runtime's own kernel."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdec_kit.export.graph_fusions import fuse_graph
from specdec_kit.export.onnx_build import optimize_graph
from specdec_kit.runtime.models.attention import apply_rope

WIDTH = 64
HEAD = 16


def norm_then_projections(rng) -> onnx.ModelProto:
    """An RMSNorm as torch exports it (rsqrt as Sqrt + Reciprocal), then q/k/v-like products of its output, and a
    fourth product whose weight another node also reads (it must stay on its own)."""
    weight = lambda n: numpy_helper.from_array((rng.standard_normal((WIDTH, n)) * 0.1).astype(np.float32), f"w{n}")  # noqa: E731
    scalar = lambda v, name: numpy_helper.from_array(np.array(v, np.float32), name)  # noqa: E731
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "last"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["rsqrt"]),
        helper.make_node("Mul", ["x", "rsqrt"], ["scaled"]),
        helper.make_node("Mul", ["gamma", "scaled"], ["normed"]),
        helper.make_node("MatMul", ["normed", "w64"], ["q"]),
        helper.make_node("MatMul", ["normed", "w16"], ["k"]),
        helper.make_node("MatMul", ["normed", "w17"], ["v"]),
        helper.make_node("MatMul", ["normed", "w8"], ["shared"]),
        helper.make_node("Add", ["w8", "w8"], ["w8_twice"]),
    ]
    outputs = [("q", 64), ("k", 16), ("v", 17), ("shared", 8)]
    graph = helper.make_graph(
        nodes,
        "norm_then_projections",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, None, WIDTH])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [None, None, w]) for n, w in outputs]
        + [helper.make_tensor_value_info("w8_twice", onnx.TensorProto.FLOAT, [WIDTH, 8])],
        [
            weight(64),
            weight(16),
            weight(17),
            weight(8),
            scalar(2.0, "two"),
            scalar(1e-5, "eps"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
            numpy_helper.from_array((1 + rng.standard_normal(WIDTH) * 0.1).astype(np.float32), "gamma"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def run(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_shared_input_products_merge_and_the_norm_becomes_one_kernel(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "g.onnx"
    onnx.save_model(
        norm_then_projections(rng), str(path), save_as_external_data=True, location="g.onnx.data", size_threshold=1024
    )
    x = rng.standard_normal((2, 3, WIDTH)).astype(np.float32)
    before = run(path, x)

    assert fuse_graph(path) == {"shared_input_matmuls": 2, "rsqrt_divisions": 1, "rotary_embeddings": 0}
    onnx.checker.check_model(str(path), full_check=True)
    ops = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops.count("MatMul") == 2 and ops.count("Split") == 1  # q/k/v as one product; the shared weight alone
    assert "Reciprocal" not in ops and ops.count("Div") == 1
    after = run(path, x)
    for b, a in zip(before, after):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()

    optimized = tmp_path / "g.optimized.onnx"
    optimize_graph(path, optimized, ["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(optimized), load_external_data=False).graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 1 and "Sqrt" not in ops and "Pow" not in ops
    assert fuse_graph(path) == {"shared_input_matmuls": 0, "rsqrt_divisions": 0, "rotary_embeddings": 0}


class RotaryQueriesAndKeys(torch.nn.Module):
    """Rotary embeddings as the runtime's attention applies them (transformers' cos/sin tables, ``apply_rope``) to
    queries and keys, and a lookalike that rotates at a quarter of the head instead of its half (not RoPE: it must
    stay as it is)."""

    def __init__(self):
        super().__init__()
        config = LlamaConfig(hidden_size=4 * HEAD, num_attention_heads=4, rope_theta=10000.0)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, queries, keys, position_ids):
        cos, sin = self.rotary(queries, position_ids)
        quarter, other = HEAD // 4, keys + 1.0
        lookalike = torch.cat((-other[..., quarter:], other[..., :quarter]), dim=-1)
        return (
            apply_rope(queries, cos, sin),
            apply_rope(keys, cos, sin),
            other * cos[:, None] + lookalike * sin[:, None],
        )


def test_rotary_embeddings_become_one_kernel_each_with_the_same_outputs(tmp_path):
    rng = np.random.default_rng(1)
    batch, tokens = torch.export.Dim("batch"), torch.export.Dim("tokens")
    example = (torch.randn(2, 4, 3, HEAD), torch.randn(2, 2, 3, HEAD), torch.arange(6).reshape(2, 3))
    path = tmp_path / "rope.onnx"
    torch.onnx.export(
        RotaryQueriesAndKeys().eval(),
        example,
        dynamo=True,
        input_names=["queries", "keys", "position_ids"],
        dynamic_shapes=({0: batch, 2: tokens}, {0: batch, 2: tokens}, {0: batch, 1: tokens}),
        opset_version=18,
        verbose=False,
    ).save(str(path), external_data=True)
    feeds = {  # two sequences at different positions, more tokens than the example had
        "queries": rng.standard_normal((2, 4, 5, HEAD)).astype(np.float32),
        "keys": rng.standard_normal((2, 2, 5, HEAD)).astype(np.float32),
        "position_ids": np.array([[7, 8, 9, 10, 11], [300, 301, 302, 303, 304]]),
    }
    session = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])  # noqa: E731
    before = session(path).run(None, feeds)
    nodes_before = len(onnx.load(str(path), load_external_data=False).graph.node)

    assert fuse_graph(path)["rotary_embeddings"] == 2  # queries and keys; the lookalike stays
    onnx.checker.check_model(str(path), full_check=True)
    graph = onnx.load(str(path), load_external_data=False).graph
    assert [n.op_type for n in graph.node].count("RotaryEmbedding") == 2
    assert len(graph.node) < nodes_before
    after = session(path).run(None, feeds)
    for b, a in zip(before, after):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    assert fuse_graph(path)["rotary_embeddings"] == 0
