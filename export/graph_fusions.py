"""Rewrites of an exported graph into fewer, larger ONNX Runtime kernels doing the same arithmetic.

A CPU decoding step of a small model is bound by memory and by per-node cost: SmolLM2-135M's exported step is about
2,300 nodes, and each MatMul wakes ONNX Runtime's thread pool. Two rewrites, before ONNX Runtime's own optimizer:

- Weight products that read the same activation (a layer's q/k/v projections, an MLP's gate and up) become one
  MatMul over their weights side by side and a ``Split``: seven weight products a Llama layer become four, and the
  wider products keep both cores busy longer per wake.
- ``x * Reciprocal(Sqrt(v))``, how torch's exporter writes an RMSNorm's ``rsqrt``, becomes ``x / Sqrt(v)``: the form
  ONNX Runtime's ``SimplifiedLayerNormalization`` fusion recognizes, so each norm's seven nodes run as one kernel.

Both keep the graph's inputs and outputs; the build's parity and greedy-identity checks run on the result.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from specdec_kit.export.onnx_edit import consumers, replace_nodes, save_rewritten


def fuse_shared_input_matmuls(model) -> int:
    """MatMuls of one activation by constant 2-D weights that nothing else reads become one MatMul over the weights
    concatenated along their output axis, split back into the original outputs. Returns how many MatMuls were
    merged away."""
    import numpy as np
    from onnx import helper, numpy_helper

    constants = {init.name: init for init in model.graph.initializer}
    users = consumers(model)
    groups: dict[tuple[str, int, int], list] = defaultdict(list)
    for node in model.graph.node:
        weight = constants.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is not None and len(weight.dims) == 2 and len(users[weight.name]) == 1:
            groups[(node.input[0], weight.dims[0], weight.data_type)].append(node)
    replaced: dict[int, list] = {}
    for (activation, _, _), members in groups.items():
        if len(members) < 2:
            continue
        weights = [numpy_helper.to_array(constants[m.input[1]]) for m in members]
        name = members[0].output[0] + "_fused"
        model.graph.initializer.append(numpy_helper.from_array(np.concatenate(weights, axis=1), name + "_weight"))
        widths = np.array([w.shape[1] for w in weights], dtype=np.int64)
        model.graph.initializer.append(numpy_helper.from_array(widths, name + "_widths"))
        replaced[id(members[0])] = [
            helper.make_node("MatMul", [activation, name + "_weight"], [name], name=name),
            helper.make_node(
                "Split", [name, name + "_widths"], [m.output[0] for m in members], axis=-1, name=name + "_split"
            ),
        ]
        replaced.update({id(m): [] for m in members[1:]})
    replace_nodes(model, replaced)
    return sum(len(members) - 1 for members in groups.values() if len(members) > 1)


def rsqrt_as_division(model) -> int:
    """``Mul(x, Reciprocal(Sqrt(v)))`` becomes ``Div(x, Sqrt(v))`` where the reciprocal feeds that Mul alone.
    Returns how many were rewritten."""
    producers = {out: node for node in model.graph.node for out in node.output}
    users = consumers(model)
    graph_outputs = {o.name for o in model.graph.output}
    dropped: dict[int, list] = {}
    for node in model.graph.node:
        if node.op_type != "Reciprocal" or getattr(producers.get(node.input[0]), "op_type", None) != "Sqrt":
            continue
        readers = users[node.output[0]]
        if len(readers) != 1 or readers[0].op_type != "Mul" or node.output[0] in graph_outputs:
            continue
        mul = readers[0]
        x = mul.input[1] if mul.input[0] == node.output[0] else mul.input[0]
        mul.op_type = "Div"
        del mul.input[:]
        mul.input.extend([x, node.input[0]])
        dropped[id(node)] = []
    replace_nodes(model, dropped)
    return len(dropped)


def fuse_graph(path: Path) -> dict[str, int]:
    """Apply every rewrite to the graph at ``path`` (weights as external data beside it) and save it in place.
    Returns how many of each were made (the engine's manifest records them)."""
    import onnx

    model = onnx.load(str(path))  # the external data too: the data file is rewritten below
    counts = {"shared_input_matmuls": fuse_shared_input_matmuls(model), "rsqrt_divisions": rsqrt_as_division(model)}
    if any(counts.values()):
        save_rewritten(model, path)
    return counts
