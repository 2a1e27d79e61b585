"""Write an engine's graphs as ONNX (torch's dynamo exporter, each at its plan's opset) from the runtime's
``GraphPlan``s."""

from __future__ import annotations

from pathlib import Path

from specdec_kit.runtime.ort.graphs import GraphPlan


def argument_shapes(plan: GraphPlan) -> tuple:
    """The plan's dynamic axes in argument order; the inputs past the module's named parameters (a cached graph's
    per-layer buffers, after a draft graph's joined tokens where it takes them) are its ``*rest``, one argument to
    ``torch.export``."""
    import inspect

    named = sum(
        p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        for p in inspect.signature(plan.module.forward).parameters.values()
    )
    dims = [plan.dims[name] for name in plan.spec.inputs]
    return tuple(dims) if len(dims) == named else (*dims[:named], tuple(dims[named:]))


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
