"""Weight-only quantization of an ONNX Runtime engine's graphs: the target's (``--weights int4``) and the draft's
(``--draft-weights int8``).

Every MatMul whose weight is a constant becomes ONNX Runtime's ``MatMulNBits``: the weight in blocks of 32 along the
input dimension, one float scale per block (symmetric). The two parts quantize differently because only one of them
decides the output:

- The target computes in float (``accuracy_level`` 1: each block dequantized inside the kernel). Quantizing its
  activations too (level 4, int8 dot products: 11 ms instead of 19 for one SmolLM2-135M token on 2 AVX-512 VNNI cores)
  makes a token's logits depend on the shape of the call it is computed in: the few-ulp differences float attention
  has between a one-token call and a tree of five (6e-5 in SmolLM2's logits) cross int8 rounding steps layer after
  layer and grow to about 1 logit. Speculation would then stop being the engine's own plain decoding; with float
  compute the quantized target keeps the float engine's 6e-5. Measured per call at 1 / 4 / 16 tokens: float32 19.5 /
  25.7 / 34.9 ms, int4 11.3 / 26.1 / 35.5 ms (8-bit weights with float compute have no fast kernel here: 125 ms).
- A draft's output only proposes tokens the target then checks, so the draft computes in int8 (level 4), where a
  draft step's largest product, the target's LM head over the whole vocabulary, runs as integer dot products.

Why not ``quantize_dynamic``: it scales each call's activations by their largest value over the whole input tensor,
so a token's result would depend on the other tokens and rows of the call even before any rounding.

A checkpoint dequantized from a 4-bit file (SmolLM2's, from its Q4_1 GGUF) already holds its matrices on a 4-bit
grid: each block of 32 weights is ``d * q + m`` with codes ``q`` in 0..15. Rounding those again onto a symmetric grid
loses most of what the file kept (SmolLM2: 12.5% of the float model's greedy tokens), so a 4-bit target whose
matrices lie on such a grid stores them as they are: the codes and scales in ``MatMulNBits``, the block minima as a
small float product beside it (``x @ W.T = MatMulNBits(x) + (x @ E) @ M`` with ``E`` summing each block of ``x``
and ``M`` the minima; ONNX Runtime's float zero points would say the same but run 10-30x slower here). Matrices off
the grid (SmolLM2's embedding, tied to its LM head, was 8-bit) then stay float rather than be rounded again.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdec_kit.export.onnx_edit import CONTRIB, consumers, replace_nodes, save_rewritten, use_contrib_ops

FLOAT_COMPUTE, INT8_COMPUTE = 1, 4  # MatMulNBits accuracy levels


@dataclass(frozen=True)
class WeightFormat:
    """How one part's constant MatMul weights are stored and multiplied."""

    name: str
    bits: int
    accuracy_level: int
    block_size: int = 32
    symmetric: bool = True

    def manifest(self) -> dict[str, Any]:
        return {**asdict(self), "format": self.name, "operator": f"{CONTRIB}.MatMulNBits"}


TARGET_WEIGHTS: dict[str, WeightFormat | None] = {"float": None, "int4": WeightFormat("int4", 4, FLOAT_COMPUTE)}
DRAFT_WEIGHTS: dict[str, WeightFormat | None] = {"float": None, "int8": WeightFormat("int8", 8, INT8_COMPUTE)}


def untie_transposed_weights(model) -> int:
    """A MatMul whose weight is a ``Transpose`` of a constant (a tied LM head: the embedding table read transposed)
    gets the transposed table as its own constant, so it can be quantized; the embedding lookup keeps the float
    table. Returns how many were untied."""
    from onnx import numpy_helper

    constants = {init.name: init for init in model.graph.initializer}
    users = consumers(model)
    untied = 0
    for node in list(model.graph.node):
        if node.op_type != "Transpose" or node.input[0] not in constants:
            continue
        if not all(user.op_type == "MatMul" and user.input[1] == node.output[0] for user in users[node.output[0]]):
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        table = numpy_helper.to_array(constants[node.input[0]])
        transposed = table.transpose(perm) if perm else table.T
        model.graph.initializer.append(numpy_helper.from_array(transposed.copy(order="C"), node.output[0]))
        model.graph.node.remove(node)
        untied += 1
    return untied


def gemms_as_matmuls(model) -> int:
    """Every ``Gemm`` by a constant matrix (``torch.onnx`` exports a ``Linear`` over a 2-D input as one: a draft tree's
    first LM head) rewritten as ``MatMul`` by that constant laid out as a MatMul weight (plus ``Add`` of its bias),
    so the quantizer, which reads MatMuls, stores it like the others. Returns how many were rewritten."""
    from onnx import helper, numpy_helper

    constants = {init.name: init for init in model.graph.initializer}
    nodes = list(model.graph.node)  # held until ``replace_nodes``, which matches them by id
    rewritten = {}
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and not attrs.get("transA", 0)
        if node.op_type != "Gemm" or node.input[1] not in constants or not plain:
            continue
        weight = numpy_helper.to_array(constants[node.input[1]])
        name = f"{node.name or node.output[0]}_weight"
        model.graph.initializer.append(
            numpy_helper.from_array((weight.T if attrs.get("transB", 0) else weight).copy(order="C"), name)
        )
        out = node.output[0]
        if len(node.input) > 2 and node.input[2]:
            rewritten[id(node)] = [
                helper.make_node("MatMul", [node.input[0], name], [f"{out}_product"], name=node.name),
                helper.make_node("Add", [f"{out}_product", node.input[2]], [out]),
            ]
        else:
            rewritten[id(node)] = [helper.make_node("MatMul", [node.input[0], name], [out], name=node.name)]
    if rewritten:
        replace_nodes(model, rewritten)
    return len(rewritten)


def grid_codes(weight, block_size: int, bits: int = 4):
    """``weight`` [N, K] as ``(codes [N, K/block] x block, scales, minima)`` when every block of ``block_size``
    along K is exactly ``scale * code + minimum`` with codes in 0..2^bits-1 and a float16 scale (how GGUF's Q4_1
    stores and dequantizes it); None when any weight is off that grid."""
    import numpy as np

    rows, width = weight.shape
    if width % block_size:
        return None
    blocks = weight.astype(np.float32).reshape(rows, width // block_size, block_size)
    low, high = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
    scales = ((high - low) / (2**bits - 1)).astype(np.float16).astype(np.float32)
    codes = np.rint((blocks - low) / np.where(scales > 0, scales, 1))
    if codes.min() < 0 or codes.max() > 2**bits - 1 or not np.array_equal(scales * codes + low, blocks):
        return None
    return codes.astype(np.uint8), scales[..., 0], low[..., 0]


def matmul_weights(model) -> list[tuple[object, object]]:
    """(MatMul node, its constant weight initializer) for every MatMul that multiplies by a constant."""
    constants = {init.name: init for init in model.graph.initializer}
    return [(n, constants[n.input[1]]) for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in constants]


def on_grid_nodes(model, node, codes, scales, minima, fmt: WeightFormat) -> list:
    """The nodes that replace MatMul ``node`` (x @ W.T, W = scales * codes + minima per block): ``MatMulNBits`` over
    the codes (its default zero point 8: W = scales * (codes - 8) + (minima + 8 * scales)) plus the block minima's
    product; their constants are added to ``model``."""
    import numpy as np
    from onnx import helper, numpy_helper

    rows, blocks, size = codes.shape
    name = node.output[0]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # the first of each pair in the low bits
    block_sums = np.kron(np.eye(blocks, dtype=np.float32), np.ones((size, 1), np.float32))  # [K, blocks]
    shifted_minima = (minima + 8 * scales).T.astype(np.float32)  # [blocks, N]
    for array, suffix in (
        (packed, "codes"),
        (scales.reshape(-1), "scales"),
        (block_sums, "block_sums"),
        (np.ascontiguousarray(shifted_minima), "minima"),
    ):
        model.graph.initializer.append(numpy_helper.from_array(array, f"{name}_{suffix}"))
    x = node.input[0]
    return [
        helper.make_node(
            "MatMulNBits",
            [x, f"{name}_codes", f"{name}_scales"],
            [f"{name}_scaled"],
            domain=CONTRIB,
            K=blocks * size,
            N=rows,
            bits=fmt.bits,
            block_size=size,
            accuracy_level=fmt.accuracy_level,
        ),
        helper.make_node("MatMul", [x, f"{name}_block_sums"], [f"{name}_sums"]),
        helper.make_node("MatMul", [f"{name}_sums", f"{name}_minima"], [f"{name}_offsets"]),
        helper.make_node("Add", [f"{name}_scaled", f"{name}_offsets"], [name]),
    ]


def quantize_on_grid(model, fmt: WeightFormat) -> dict[str, int] | None:
    """Store every constant MatMul weight that lies on a ``fmt.bits`` grid as its codes; None (nothing changed)
    when none does. The others stay float."""
    from onnx import numpy_helper

    if fmt.bits != 4 or not fmt.symmetric:
        return None
    found = []
    for node, init in matmul_weights(model):
        grid = grid_codes(numpy_helper.to_array(init).T, fmt.block_size, fmt.bits)  # MatMul's weight is W.T
        found.append((node, grid))
    if not any(grid is not None for _, grid in found):
        return None
    use_contrib_ops(model)
    replace_nodes(model, {id(node): on_grid_nodes(model, node, *grid, fmt) for node, grid in found if grid is not None})
    on_grid = sum(grid is not None for _, grid in found)
    constants = {init.name for init in model.graph.initializer}
    transposed = {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in constants}
    tied = sum(n.op_type == "MatMul" and n.input[1] in transposed for n in model.graph.node)  # a tied LM head
    return {"matmuls": on_grid, "on_grid": on_grid, "kept_float": len(found) - on_grid + tied}


def quantize_graph(path: Path, fmt: WeightFormat) -> dict[str, int]:
    """Rewrite the graph at ``path`` (weights as external data beside it) with its constant MatMul weights in
    ``fmt``. Returns ``matmuls``, how many MatMuls became ``MatMulNBits`` (those multiplying activations by
    activations, e.g. attention, stay float), and ``on_grid`` / ``kept_float`` where the weights already lay on a
    4-bit grid (stored exactly; the others left float)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(path))  # the external data too: the old data file is rewritten below
    exact = quantize_on_grid(model, fmt)
    if exact is not None:
        save_rewritten(model, path)
        return exact
    untie_transposed_weights(model)
    gemms_as_matmuls(model)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=fmt.bits,
        block_size=fmt.block_size,
        is_symmetric=fmt.symmetric,
        accuracy_level=fmt.accuracy_level,
        op_types_to_quantize=("MatMul",),
    )
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs every node it leaves alone
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    quantized = quantizer.model.model
    save_rewritten(quantized, path)
    return {"matmuls": sum(node.op_type == "MatMulNBits" for node in quantized.graph.node)}
