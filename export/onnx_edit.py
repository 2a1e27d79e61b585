"""Editing an exported ONNX graph in place: who writes and who reads a value, swapping nodes, saving with its weights
beside it. Shared by the rewrites that run between export and ONNX Runtime's optimizer (fusions, quantization)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

CONTRIB = "com.microsoft"  # ONNX Runtime's own operators (MatMulNBits, RotaryEmbedding, ...)


def consumers(model) -> dict[str, list]:
    """Each value's reading nodes, by name."""
    users: dict[str, list] = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            users[name].append(node)
    return users


def use_contrib_ops(model) -> None:
    """Declare ONNX Runtime's operator domain, once, for the nodes a rewrite adds from it."""
    from onnx import helper

    if not any(op.domain == CONTRIB for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CONTRIB, 1))


def producers(model) -> dict[str, object]:
    """The node that writes each value, by name."""
    return {out: node for node in model.graph.node for out in node.output}


def replace_nodes(model, replaced: dict[int, list]) -> None:
    """Each node whose id is in ``replaced`` becomes that list of nodes, where it stood (the others keep their
    order); nodes and constants nothing reads any more are dropped. The ids are those of node objects the caller
    still holds: protobuf makes a new wrapper for a node no one holds, and a freed one's id can name another."""
    nodes = [new for node in model.graph.node for new in replaced.get(id(node), [node])]
    wanted = {o.name for o in model.graph.output}
    while True:  # from the outputs back: a node whose values nothing reads goes, then what only it read
        read = wanted | {name for node in nodes for name in node.input}
        kept = [node for node in nodes if any(out in read for out in node.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for node in model.graph.node for name in node.input}
    for init in [i for i in model.graph.initializer if i.name not in used]:
        model.graph.initializer.remove(init)


def save_rewritten(model, path: Path) -> None:
    """``model`` over the graph at ``path``, its weights rewritten into the data file beside it."""
    import onnx

    data = path.with_name(path.name + ".data")
    mode = data.stat().st_mode & 0o777 if data.exists() else path.stat().st_mode & 0o777
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(path), save_as_external_data=True, location=data.name, size_threshold=1024)
    if data.exists():  # a graph without large constants has none
        data.chmod(mode)  # onnx creates it private; keep the exporter's permissions
