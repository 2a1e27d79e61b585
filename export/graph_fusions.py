"""Rewrites of an exported graph into fewer, larger ONNX Runtime kernels doing the same arithmetic.

A CPU decoding step of a small model is bound by memory and by per-node cost: SmolLM2-135M's exported step is about
2,300 nodes, and each MatMul wakes ONNX Runtime's thread pool. Two rewrites, before ONNX Runtime's own optimizer:

- Weight products that read the same activation (a layer's q/k/v projections, an MLP's gate and up) become one
  MatMul over their weights side by side and a ``Split``: seven weight products a Llama layer become four, and the
  wider products keep both cores busy longer per wake.
- ``x * Reciprocal(Sqrt(v))``, how torch's exporter writes an RMSNorm's ``rsqrt``, becomes ``x / Sqrt(v)``: the form
  ONNX Runtime's ``SimplifiedLayerNormalization`` fusion recognizes, so each norm's seven nodes run as one kernel.
- Rotary embeddings, ``x * cos + rotate_half(x) * sin`` (seven nodes for each of a layer's queries and keys), become
  one ONNX Runtime ``RotaryEmbedding`` kernel each, reading the step's own cos/sin halves as its tables.

All keep the graph's inputs and outputs; the build's parity and greedy-identity checks run on the result.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from specdec_kit.export.onnx_edit import CONTRIB, consumers, producers, replace_nodes, save_rewritten, use_contrib_ops


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
    writers = producers(model)
    users = consumers(model)
    graph_outputs = {o.name for o in model.graph.output}
    dropped: dict[int, list] = {}
    for node in model.graph.node:
        if node.op_type != "Reciprocal" or getattr(writers.get(node.input[0]), "op_type", None) != "Sqrt":
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


def _constant_ints(model) -> dict[str, list[int]]:
    """Integer initializers and Constant nodes by name, as lists (the slice bounds and axes the rewrites check)."""
    from onnx import TensorProto, numpy_helper

    found = {
        init.name: numpy_helper.to_array(init).reshape(-1).tolist()
        for init in model.graph.initializer
        if init.data_type in (TensorProto.INT64, TensorProto.INT32) and len(init.dims) <= 1
    }
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.dtype.kind == "i" and value.ndim <= 1:
                found[node.output[0]] = value.reshape(-1).tolist()
    return found


def _shapes(model) -> dict[str, list]:
    """Each value's dimensions as the exporter recorded them: a number, a symbol's name, or None."""
    shapes = {}
    for info in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        dims = info.type.tensor_type.shape.dim
        shapes[info.name] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None) for d in dims
        ]
    return shapes


class _RotaryMatcher:
    """Finds ``Add(Mul(x, Unsqueeze(Cos(c))), Mul(Concat(Neg(Slice(x, h:)), Slice(x, :h)), Unsqueeze(Sin(c))))`` with
    ``c = Concat(f, f)`` along the last axis and ``h`` half of ``x``'s last axis: transformers' rotary embedding,
    whose cos and sin repeat one half, applied by ``rotate_half``."""

    BIG = 2**62  # a Slice's "to the end"

    def __init__(self, model):
        self.writers = producers(model)
        self.users = consumers(model)
        self.ints = _constant_ints(model)
        self.shapes = _shapes(model)
        self.outputs = {o.name for o in model.graph.output}

    def made_by(self, name: str, op: str):
        node = self.writers.get(name)
        return node if node is not None and node.op_type == op else None

    def private(self, node) -> bool:
        """Read by one node only and not a graph output: the rewrite may drop it."""
        return len(self.users[node.output[0]]) == 1 and node.output[0] not in self.outputs

    def table(self, name: str, op: str) -> str | None:
        """``f`` when ``name`` is ``Unsqueeze(op(Concat(f, f)), axes=[1])``."""
        unsqueeze = self.made_by(name, "Unsqueeze")
        if unsqueeze is None or self.ints.get(unsqueeze.input[1]) != [1]:
            return None
        trig = self.made_by(unsqueeze.input[0], op)
        both = self.made_by(trig.input[0], "Concat") if trig is not None else None
        if both is None or len(both.input) != 2 or both.input[0] != both.input[1]:
            return None
        return both.input[0] if all(a.i in (-1, 2) for a in both.attribute if a.name == "axis") else None

    def half_slice(self, node, x: str, start: int, end: int) -> bool:
        if node is None or node.input[0] != x or not self.private(node):
            return False
        starts, ends = self.ints.get(node.input[1]), self.ints.get(node.input[2])
        axes = self.ints.get(node.input[3]) if len(node.input) > 3 else None
        steps = self.ints.get(node.input[4]) if len(node.input) > 4 else [1]
        return (
            starts == [start]
            and ends is not None
            and (ends == [end] or (end >= self.BIG and ends[0] >= self.BIG))
            and axes in ([-1], [3])
            and steps == [1]
        )

    def rotated_half(self, x: str, f: str) -> int | None:
        """Half of ``x``'s head dimension when ``x`` is ``[batch, heads, tokens, head_dim]`` and ``f`` is
        ``[batch, tokens, head_dim / 2]`` with the same batch and tokens (each token of ``x`` has its own row)."""
        xs, fs = self.shapes.get(x), self.shapes.get(f)
        if not xs or not fs or len(xs) != 4 or len(fs) != 3 or None in (xs[0], xs[2], xs[3]):
            return None
        half = xs[3] // 2 if isinstance(xs[3], int) and xs[3] % 2 == 0 else None
        return half if half and fs == [xs[0], xs[2], half] else None

    def match(self, add) -> tuple[str, str, list] | None:
        """``(x, f, nodes the rewrite replaces)`` for a rotary ``Add``, else None."""
        products = [self.made_by(name, "Mul") for name in add.input]
        if None in products or not all(self.private(p) for p in products):
            return None
        for direct, rotated in (products, products[::-1]):
            for x, cos in (direct.input, direct.input[::-1]):
                f = self.table(cos, "Cos")
                half = self.rotated_half(x, f) if f is not None else None
                if half is None:
                    continue
                for turned, sin in (rotated.input, rotated.input[::-1]):
                    join = self.made_by(turned, "Concat")
                    if join is None or not self.private(join) or self.table(sin, "Sin") != f or len(join.input) != 2:
                        continue
                    neg = self.made_by(join.input[0], "Neg")
                    upper = self.made_by(neg.input[0], "Slice") if neg is not None and self.private(neg) else None
                    lower = self.made_by(join.input[1], "Slice")
                    if self.half_slice(upper, x, half, self.BIG) and self.half_slice(lower, x, 0, half):
                        return x, f, [direct, rotated, join, neg, upper, lower]
        return None


def fuse_rotary_embeddings(model) -> int:
    """Each rotary embedding of a 4-D ``[batch, heads, tokens, head_dim]`` tensor becomes one ``RotaryEmbedding``
    (ONNX Runtime's kernel, halves not interleaved). Its tables are the step's own ``cos(f)``/``sin(f)`` rows
    ``[batch * tokens, head_dim / 2]``, each token reading its own row, so positions and any rope scaling stay as
    the exporter computed them. Returns how many were fused."""
    from onnx import helper, numpy_helper

    matcher = _RotaryMatcher(model)
    replaced: dict[int, list] = {}
    tables: dict[str, tuple[str, str, str]] = {}  # f -> (row of each token, cos rows, sin rows)
    for add in model.graph.node:
        found = matcher.match(add) if add.op_type == "Add" else None
        if found is None:
            continue
        x, f, dropped = found
        made = []
        if f not in tables:
            made, tables[f] = _rotary_tables(f, matcher.shapes[f][2])
        rows, cos, sin = tables[f]
        rotate = helper.make_node(
            "RotaryEmbedding", [x, rows, cos, sin], [add.output[0]], domain=CONTRIB, interleaved=0, name=add.name
        )
        replaced[id(add)] = [*made, rotate]
        replaced.update({id(node): [] for node in dropped})
    if not replaced:
        return 0
    import numpy as np

    constants = {"rotary_zero": 0, "rotary_one": 1, **{f"{f}_rows_shape": [-1, matcher.shapes[f][2]] for f in tables}}
    present = {init.name for init in model.graph.initializer}
    for name, value in constants.items():
        if name not in present:
            model.graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=np.int64), name))
    use_contrib_ops(model)
    replace_nodes(model, replaced)
    return sum(1 for nodes in replaced.values() if nodes)


def _rotary_tables(f: str, half: int) -> tuple[list, tuple[str, str, str]]:
    """Nodes giving ``RotaryEmbedding`` its position ids ``arange(batch * tokens)`` as ``[batch, tokens]`` and the
    cos/sin rows of ``f`` ``[batch, tokens, half]`` flattened to ``[batch * tokens, half]``."""
    from onnx import helper

    names = {
        part: f"{f}_rotary_{part}" for part in ("lead", "count", "range", "rows", "cos", "sin", "cos_rows", "sin_rows")
    }
    nodes = [
        helper.make_node("Shape", [f], [names["lead"]], start=0, end=2),
        helper.make_node("ReduceProd", [names["lead"]], [names["count"]], keepdims=0),
        helper.make_node("Range", ["rotary_zero", names["count"], "rotary_one"], [names["range"]]),
        helper.make_node("Reshape", [names["range"], names["lead"]], [names["rows"]]),
        helper.make_node("Cos", [f], [names["cos"]]),
        helper.make_node("Sin", [f], [names["sin"]]),
        helper.make_node("Reshape", [names["cos"], f"{f}_rows_shape"], [names["cos_rows"]]),
        helper.make_node("Reshape", [names["sin"], f"{f}_rows_shape"], [names["sin_rows"]]),
    ]
    return nodes, (names["rows"], names["cos_rows"], names["sin_rows"])


def fuse_graph(path: Path) -> dict[str, int]:
    """Apply every rewrite to the graph at ``path`` (weights as external data beside it) and save it in place.
    Returns how many of each were made (the engine's manifest records them)."""
    import onnx

    model = onnx.load(str(path))  # the external data too: the data file is rewritten below
    counts = {
        "shared_input_matmuls": fuse_shared_input_matmuls(model),
        "rsqrt_divisions": rsqrt_as_division(model),
        "rotary_embeddings": fuse_rotary_embeddings(model),
    }
    if any(counts.values()):
        save_rewritten(model, path)
    return counts
