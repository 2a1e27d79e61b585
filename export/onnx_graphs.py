"""Write an engine's graphs as ONNX (torch's dynamo exporter, each at its plan's opset) from the runtime's
``GraphPlan``s."""

from __future__ import annotations

from pathlib import Path

from specdec_kit.runtime.ort.graphs import GraphPlan


def argument_shapes(plan: GraphPlan) -> tuple:
    """The plan's dynamic axes in argument order; a cached graph's per-layer buffers are its ``*past``, one
    argument to ``torch.export``."""
    named = [plan.dims[name] for name in plan.spec.inputs if not name.startswith("past_")]
    buffers = tuple(plan.dims[name] for name in plan.spec.inputs if name.startswith("past_"))
    return (*named, buffers) if buffers else tuple(named)


def export_plan(plan: GraphPlan, graphs: Path) -> Path:
    """``graphs/<role>.onnx`` (weights as external data beside it) with the plan's names and dynamic axes."""
    import torch

    spec = plan.spec
    path = graphs / f"{spec.name}.onnx"
    program = torch.onnx.export(
        plan.module.eval(),
        plan.args,
        dynamo=True,
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        dynamic_shapes=argument_shapes(plan),
        opset_version=plan.opset,
        optimize=True,
        verbose=False,
    )
    program.save(str(path), external_data=True)
    return path
