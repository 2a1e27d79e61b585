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
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
        return {**asdict(self), "format": self.name, "operator": "com.microsoft.MatMulNBits"}


TARGET_WEIGHTS: dict[str, WeightFormat | None] = {"float": None, "int4": WeightFormat("int4", 4, FLOAT_COMPUTE)}
DRAFT_WEIGHTS: dict[str, WeightFormat | None] = {"float": None, "int8": WeightFormat("int8", 8, INT8_COMPUTE)}


def untie_transposed_weights(model) -> int:
    """A MatMul whose weight is a ``Transpose`` of a constant (a tied LM head: the embedding table read transposed)
    gets the transposed table as its own constant, so it can be quantized; the embedding lookup keeps the float
    table. Returns how many were untied."""
    from onnx import numpy_helper

    constants = {init.name: init for init in model.graph.initializer}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    untied = 0
    for node in list(model.graph.node):
        if node.op_type != "Transpose" or node.input[0] not in constants:
            continue
        if not all(user.op_type == "MatMul" and user.input[1] == node.output[0] for user in consumers[node.output[0]]):
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        table = numpy_helper.to_array(constants[node.input[0]])
        transposed = table.transpose(perm) if perm else table.T
        model.graph.initializer.append(numpy_helper.from_array(transposed.copy(order="C"), node.output[0]))
        model.graph.node.remove(node)
        untied += 1
    return untied


def quantize_graph(path: Path, fmt: WeightFormat) -> int:
    """Rewrite the graph at ``path`` (weights as external data beside it) with its constant MatMul weights in
    ``fmt``; returns how many MatMuls were quantized (those multiplying activations by activations, e.g. attention,
    stay float)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(path))  # the external data too: the old data file is rewritten below
    untie_transposed_weights(model)
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
    data = path.with_name(path.name + ".data")
    mode = data.stat().st_mode & 0o777
    data.unlink()  # onnx appends to an existing data file
    onnx.save_model(quantized, str(path), save_as_external_data=True, location=data.name, size_threshold=1024)
    data.chmod(mode)  # onnx creates it private; keep the exporter's permissions
    return sum(node.op_type == "MatMulNBits" for node in quantized.graph.node)
