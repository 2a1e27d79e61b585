"""Graphs whose MatMuls over constant float weights run as the kit's ``specdec.PackedMatMul``, whose 8-bit
``MatMulNBits`` (a draft's ``--draft-weights int8``) run as ``specdec.Int8MatMul``, and whose attention runs as
``specdec.TreeAttention`` (``custom_ops``).

A MatMul ``X[..., K] @ W[K, N]`` with ``W`` a float initializer becomes ``PackedMatMul(X, W_packed, n=N)``, where
``W_packed`` holds the same numbers as ``[ceil(N / 32), K, 32]``: each block of 32 output columns contiguous, the
order the kernel reads them in. A ``MatMulNBits`` of 8-bit symmetric codes in blocks of 32 with int8 compute
(accuracy level 4) becomes ``Int8MatMul(X, codes, scales, corrections, bias, n=N)`` over the same codes and scales
laid out for AVX-512 VNNI (``int8_matmul.c``), where the library has that instruction set. An ONNX ``Attention`` over
4-D inputs with a boolean mask (the target step's: no causal flag, soft cap or extra outputs) becomes
``TreeAttention`` on the same inputs, its scale kept. Only graphs the
build already optimized are rewritten (ONNX Runtime's optimizer would otherwise meet an operator it cannot fuse
through). The rewritten graph is written once per source graph
under ``$SPECDEC_CACHE/packed-graphs`` and reused: the engine directory stays as the build wrote it, read-only
mounts included. Each copy names its source; a copy whose source is gone or was rebuilt is removed when the next one
is written, so engines built and deleted (a test run builds dozens) leave nothing behind.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from specdec_kit.runtime.models.pretrained import cache_root

DOMAIN = "specdec"
OP = "PackedMatMul"
COLUMNS = 32  # the kernel's block of output columns
LAYOUT = "columns32-v1+tree-attention-v1+int8-vnni-v1"  # in the cache key: a new layout never reads an old graph
INT8_OP = "Int8MatMul"
INT8_GROUP, INT8_BLOCK = 16, 32  # the kernel's output columns per vector, and the quantization block along K
ATTENTION_OP = "TreeAttention"
BOOL = 9  # onnx.TensorProto.BOOL
SHAPE_ONLY = {"Unsqueeze", "Squeeze", "Reshape", "Expand", "Identity", "Slice", "Transpose"}  # keep the element type


def pack_weight(weight: np.ndarray) -> np.ndarray:
    """[K, N] -> [ceil(N / 32), K, 32], the last block's missing columns zero."""
    k, n = weight.shape
    blocks = -(-n // COLUMNS)
    padded = np.zeros((k, blocks * COLUMNS), dtype=np.float32)
    padded[:, :n] = weight
    return np.ascontiguousarray(padded.reshape(k, blocks, COLUMNS).transpose(1, 0, 2))


def pack_int8_codes(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``MatMulNBits``' 8-bit codes [N, K / 32, 32] (stored + 128) and scales [N, K / 32] -> ``Int8MatMul``'s
    (codes [ceil(N / 16), K / 4, 16, 4] int8, scales [ceil(N / 16), K / 32, 16], corrections: 128 times each block's
    column sum of codes, same layout, int32); the last group's missing columns zero."""
    n, blocks, _ = codes.shape
    k = blocks * INT8_BLOCK
    groups = -(-n // INT8_GROUP)
    signed = np.zeros((groups * INT8_GROUP, k), dtype=np.int8)
    signed[:n] = (codes.reshape(n, k).astype(np.int16) - 128).astype(np.int8)
    padded_scales = np.zeros((groups * INT8_GROUP, blocks), dtype=np.float32)
    padded_scales[:n] = scales.reshape(n, blocks)
    sums = 128 * signed.reshape(-1, blocks, INT8_BLOCK).sum(-1, dtype=np.int32)

    def by_group(per_block: np.ndarray) -> np.ndarray:  # [groups * 16, blocks] -> [groups, blocks, 16]
        return np.ascontiguousarray(per_block.reshape(groups, INT8_GROUP, blocks).transpose(0, 2, 1))

    lanes = signed.reshape(groups, INT8_GROUP, k // 4, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(lanes), by_group(padded_scales), by_group(sums)


def _as_int8_matmul(node, initializers: dict, packed: dict[str, list[str]], model) -> object | None:
    """The ``Int8MatMul`` node for a ``MatMulNBits`` node it computes (8-bit symmetric codes in blocks of 32, int8
    compute, no zero points or group indices; a bias kept), or None. Its constants are added to ``model`` once per
    weight (``packed``: the codes' name -> theirs, and each zero bias given), however many nodes share it."""
    from onnx import helper, numpy_helper

    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = list(node.input) + [""] * (6 - len(node.input))  # A, B, scales, zero points, group indices, bias
    codes, scales = initializers.get(inputs[1]), initializers.get(inputs[2])
    bias = initializers.get(inputs[5]) if inputs[5] else None
    eligible = (
        attrs.get("bits") == 8
        and attrs.get("block_size") == INT8_BLOCK
        and attrs.get("accuracy_level") == 4
        and attrs.get("K", 0) % INT8_BLOCK == 0
        and not inputs[3]
        and not inputs[4]
        and not any(inputs[6:])
        and codes is not None
        and scales is not None
        and codes.data_type == 2  # uint8
        and scales.data_type == 1  # float
        and (not inputs[5] or (bias is not None and bias.data_type == 1))
    )
    if not eligible:
        return None
    n, k = int(attrs["N"]), int(attrs["K"])
    if codes.name not in packed:
        code_array = numpy_helper.to_array(codes).reshape(n, k // INT8_BLOCK, INT8_BLOCK)
        names = [f"{codes.name}.vnni", f"{codes.name}.vnni_scales", f"{codes.name}.vnni_corrections"]
        arrays = pack_int8_codes(code_array, numpy_helper.to_array(scales))
        model.graph.initializer.extend(numpy_helper.from_array(a, name) for a, name in zip(arrays, names))
        packed[codes.name] = names
    bias_name = bias.name if bias is not None else f"int8_matmul.zero_bias{n}"
    if bias is None and bias_name not in packed:  # one zero bias per width, for every node without one
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(n, dtype=np.float32), bias_name))
        packed[bias_name] = [bias_name]
    return helper.make_node(
        INT8_OP,
        [inputs[0], *packed[codes.name], bias_name],
        list(node.output),
        name=f"{node.name or 'matmul_nbits'}.int8",
        domain=DOMAIN,
        n=n,
    )


def _source_key(graph: Path) -> str:
    """The graph file's bytes and its external data files' sizes and times: a rebuilt engine gets a new key."""
    from specdec_kit.runtime.ort.custom_ops import int8_matmul_vectorized, tree_attention_enabled

    flags = ("" if tree_attention_enabled() else "-attention-off") + ("" if int8_matmul_vectorized() else "-int8-off")
    digest = hashlib.sha256((LAYOUT + flags).encode())
    digest.update(graph.read_bytes())
    for data in sorted(graph.parent.glob(graph.name + "*")):
        if data != graph:
            stat = data.stat()
            digest.update(f"{data.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:20]


class _ElementTypes:
    """Tensors' element types where the graph says them: a declaration, or the input of the shape-only nodes a tensor
    comes through (the graph's declarations and producers read once)."""

    def __init__(self, model):
        graph = model.graph
        self.declared = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info]}
        self.declared.update({init.name: init.data_type for init in graph.initializer})
        self.made_by = {out: node for node in graph.node for out in node.output}

    def of(self, name: str) -> int | None:
        for _ in range(16):
            if self.declared.get(name):
                return self.declared[name]
            node = self.made_by.get(name)
            if node is None or node.op_type not in SHAPE_ONLY or not node.input:
                return None
            name = node.input[0]
        return None


def _as_tree_attention(node, types: Callable[[], _ElementTypes]):
    """The ``TreeAttention`` node for an ``Attention`` node it computes exactly as ONNX defines it, or None
    (``types``: the graph's element types, read on first need)."""
    from onnx import helper

    if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
        return None
    inputs, outputs = list(node.input), [o for o in node.output if o]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    plain = (
        len(inputs) == 4
        and all(inputs)
        and len(outputs) == 1
        and node.output[0]
        and not attrs.get("is_causal", 0)
        and not attrs.get("softcap", 0.0)
        and not attrs.get("qk_matmul_output_mode", 0)
        and "q_num_heads" not in attrs  # their presence means 3-D inputs
        and "kv_num_heads" not in attrs
        and attrs.get("softmax_precision", 1) == 1
        and types().of(inputs[3]) == BOOL
    )
    if not plain:
        return None
    extra = {"scale": float(attrs["scale"])} if "scale" in attrs else {}
    return helper.make_node(
        ATTENTION_OP, inputs, outputs, name=f"{node.name or 'attention'}.tree", domain=DOMAIN, **extra
    )


def rewrite(model, attention: bool | None = None, int8: bool | None = None) -> int:
    """Rewrite ``model`` (an ``onnx.ModelProto`` with its weights loaded) in place; returns the nodes replaced. Its
    attention too where ``attention`` (default: unless ``SPECDEC_TREE_ATTENTION=0``), and its 8-bit ``MatMulNBits``
    where ``int8`` (default: where the library multiplies them with AVX-512 VNNI)."""
    from onnx import TensorProto, helper, numpy_helper

    from specdec_kit.runtime.ort.custom_ops import int8_matmul_vectorized, tree_attention_enabled

    attention = tree_attention_enabled() if attention is None else attention
    int8 = int8_matmul_vectorized() if int8 is None else int8

    initializers = {init.name: init for init in model.graph.initializer}
    packed: dict[str, tuple[str, int]] = {}
    int8_packed: dict[str, list[str]] = {}
    nodes, replaced = [], 0
    types = functools.cache(lambda: _ElementTypes(model))
    for node in model.graph.node:
        tree_attention = _as_tree_attention(node, types) if attention else None
        if tree_attention is not None:
            nodes.append(tree_attention)
            replaced += 1
            continue
        int8_matmul = _as_int8_matmul(node, initializers, int8_packed, model) if int8 else None
        if int8_matmul is not None:
            nodes.append(int8_matmul)
            replaced += 1
            continue
        weight = (
            initializers.get(node.input[1]) if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        )
        if weight is None or weight.data_type != TensorProto.FLOAT or len(weight.dims) != 2:
            nodes.append(node)
            continue
        if weight.name not in packed:
            name = f"{weight.name}.packed{COLUMNS}"
            model.graph.initializer.append(numpy_helper.from_array(pack_weight(numpy_helper.to_array(weight)), name))
            packed[weight.name] = (name, int(weight.dims[1]))
        name, n = packed[weight.name]
        node_name = f"{node.name or f'matmul{replaced}'}.packed"
        nodes.append(helper.make_node(OP, [node.input[0], name], list(node.output), name=node_name, domain=DOMAIN, n=n))
        replaced += 1
    if not replaced:
        return 0
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for node in model.graph.node for name in node.input}
    kept = [init for init in model.graph.initializer if init.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return replaced


SOURCE_NOTE = "source.txt"  # the source graph's path, in each copy's folder


def remove_orphans(root: Path) -> None:
    """Delete the copies whose source graph is gone or no longer has the key they were written under."""
    for folder in root.iterdir() if root.is_dir() else ():
        note = folder / SOURCE_NOTE
        try:
            source = Path(note.read_text())
            current = source.exists() and _source_key(source) == folder.name
        except OSError:  # a copy being written (no note yet), or one removed beside us
            continue
        if not current:
            shutil.rmtree(folder, ignore_errors=True)


def packed_graph(graph: Path) -> Path | None:
    """The rewritten copy of ``graph`` (written on first use), or None where it has nothing to rewrite."""
    import onnx

    root = cache_root() / "packed-graphs"
    folder = root / _source_key(graph)
    done, nothing = folder / graph.name, folder / "nothing-to-pack"
    if done.exists():
        return done
    if nothing.exists():
        return None
    remove_orphans(root)
    model = onnx.load(str(graph))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SOURCE_NOTE).write_text(str(graph.resolve()))
    if not rewrite(model):
        nothing.touch()
        return None
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # written whole, then renamed into place
        written = Path(scratch) / graph.name
        onnx.save(model, str(written), save_as_external_data=True, location=graph.name + ".data")
        os.replace(Path(scratch) / (graph.name + ".data"), folder / (graph.name + ".data"))
        os.replace(written, done)
    return done
