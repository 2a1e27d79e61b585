"""TensorRT-LLM engines: ``trtllm-serve`` on its PyTorch backend (``export/trtllm_pytorch.py``) by default, or the legacy
``trtllm-build`` checkpoint (``export/trtllm_export.py``) for releases up to 1.2.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from typing import Any, Callable

import yaml

from specdec_kit.export import trtllm_export as trt
from specdec_kit.export import trtllm_pytorch
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.export.servers.common import (
    captured_layer_outputs,
    draft_state,
    engine_form,
    save_safetensors,
    serve_script,
    target_config,
    write_target,
)
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import draft_kind


def _trtllm_checkpoint(
    staging: Path, inputs: BuildInputs, target: TargetModel, module, settings: dict, step: Callable[[str], None]
) -> dict[str, Any]:
    """The legacy engine route (TensorRT-LLM <= 1.2): a ``trtllm-build`` checkpoint and the TensorRT backend."""
    tp, pp = inputs.tp, inputs.pp
    kind = inputs.draft
    medusa = engine_form(kind, trtllm_pytorch.LEGACY).method == "Medusa"
    tcfg = target_config(target)
    dtype = target.dtype
    hf = {k: v.to(dtype) for k, v in target.hf_model.state_dict().items()}
    draft = draft_state(module, dtype)
    if medusa:
        dcfg = {"medusa_num_heads": module.num_heads, "medusa_num_layers": module.num_layers}
        if settings["num_eagle_layers"] > module.num_heads:
            raise BuildError(f"tree depth {settings['num_eagle_layers']} exceeds the {module.num_heads} Medusa heads")
    else:
        layers, heads, dim = module.attention_shape
        dcfg = {**draft_kind(kind).family.config_dict(module), "num_key_value_heads": heads, "head_dim": dim}
        if heads % tp and tp % heads:
            raise BuildError(f"draft num_key_value_heads = {heads} and --tp {tp}: neither divides the other")
    ckpt = staging / "trtllm" / "checkpoint"
    config = trt.checkpoint_config(medusa, tcfg, dcfg, settings, inputs.dtype, tp, pp)
    trt.write_json(ckpt / "config.json", config)
    for rank in range(tp * pp):
        step(f"writing TensorRT-LLM shard rank{rank}.safetensors ({rank + 1}/{tp * pp})")
        shard = trt.convert_target(hf, tcfg, tp, pp, rank)
        if rank // tp == pp - 1:  # draft weights live with the last pipeline stage's ranks
            if medusa:
                shard.update(
                    trt.convert_medusa(draft, dcfg["medusa_num_heads"], dcfg["medusa_num_layers"], tp, rank % tp)
                )
            else:
                shard.update(trt.convert_eagle(draft, hf, dcfg, settings["num_eagle_layers"], tp, rank % tp))
        save_safetensors(shard, ckpt / f"rank{rank}.safetensors")
    mode = "medusa" if medusa else "eagle"
    build = [
        "trtllm-build",
        "--checkpoint_dir",
        "trtllm/checkpoint",
        "--output_dir",
        "trtllm/engine",
        "--gemm_plugin",
        inputs.dtype,
        "--use_paged_context_fmha",
        "enable",
        "--speculative_decoding_mode",
        mode,
        "--max_batch_size",
        "8",
        "--max_draft_len",
        str(settings["max_draft_len"]),
    ]
    spec: dict[str, Any] = {"max_draft_len": settings["max_draft_len"]}
    if medusa:
        spec.update(
            decoding_type="Medusa", num_medusa_heads=dcfg["medusa_num_heads"], medusa_choices=settings["choices"]
        )
    else:
        spec.update(
            decoding_type="Eagle",
            num_eagle_layers=settings["num_eagle_layers"],
            max_non_leaves_per_layer=settings["max_non_leaves_per_layer"],
            greedy_sampling=True,
        )
        spec.update(settings["dynamic"] or {"eagle_choices": settings["choices"]})
    serve_cfg = {"backend": "tensorrt", "speculative_config": spec}
    return {
        "build": build,
        "serve_config": serve_cfg,
        "serve": [
            "trtllm-serve",
            "trtllm/engine",
            "--backend",
            "tensorrt",
            "--tokenizer",
            "target",
            "--config",
            "trtllm/serve.yaml",
            "--host",
            "0.0.0.0",
            "--port",
            "${PORT:-8000}",
        ],
        "artifacts": {"trtllm_checkpoint": "trtllm/checkpoint", "trtllm_engine_dir": "trtllm/engine"},
    }


def build_trtllm(
    staging: Path, inputs: BuildInputs, target: TargetModel, module, tree, step, enhancer: dict | None = None
) -> dict[str, Any]:
    """The PyTorch-backend export by default; the legacy engine checkpoint with ``--trtllm-legacy-engine``.
    ``enhancer``: a hybrid's suffix automaton (TensorRT-LLM's ``sa_config``) beside the head."""
    write_target(staging, target, inputs, step)
    legacy = inputs.trtllm_legacy_engine
    if legacy is None:
        step("writing the draft for TensorRT-LLM's PyTorch backend")
        taps = draft_kind(inputs.draft).family.feature_layers(module)
        layers = (
            captured_layer_outputs(module, "TensorRT-LLM") if taps else [target.num_layers - 1]
        )  # the last layer's output, through the target's norm in the drafter
        out = trtllm_pytorch.pytorch_route(
            staging,
            inputs.draft,
            module,
            tree,
            inputs.tp,
            inputs.pp,
            inputs.dtype,
            layers,
            lambda path: save_safetensors(draft_state(module, target.dtype), path),
            enhancer,
        )
        notes = [
            *out["notes"],
            "serving needs a GPU machine with TensorRT-LLM; run trtllm/serve.sh there (PyTorch "
            "backend, no engine build"
            + (", the kit installed beside it for the drafter package)" if out["plugin"] else ")"),
        ]
    else:
        settings = trt.tree_settings(tree)
        try:
            trt.check_tree(settings)
        except trt.TrtllmExportError as exc:
            raise BuildError(f"tree does not fit TensorRT-LLM: {exc}") from exc
        try:
            draft_kind(inputs.draft).family.check_tree(tree)  # Medusa engines take static trees (medusa_choices)
        except ValueError as exc:
            raise BuildError(str(exc)) from None
        out = _trtllm_checkpoint(staging, inputs, target, module, settings, step)
        notes = [
            f"legacy TensorRT engine route for TensorRT-LLM {legacy} (<= 1.2): trtllm-build needs a GPU machine "
            "with that release; run trtllm/build.sh there, then trtllm/serve.sh"
        ]
    (staging / "trtllm" / "serve.yaml").write_text(yaml.safe_dump(out["serve_config"], sort_keys=False))
    commands = {}
    if out["build"]:
        commands["build the engine"] = serve_script(staging / "trtllm" / "build.sh", out["build"])
    commands["serve"] = serve_script(staging / "trtllm" / "serve.sh", out["serve"])
    built = False
    if out["build"] and importlib.util.find_spec("tensorrt_llm") is not None:
        step("tensorrt_llm is importable: running trtllm-build")
        subprocess.run(["bash", str(staging / "trtllm" / "build.sh")], check=True)
        built, notes = True, []
    artifacts = {"target": "target", "trtllm_serve_config": "trtllm/serve.yaml", **out["artifacts"]}
    artifacts = {k: v for k, v in artifacts.items() if k != "trtllm_engine_dir" or built}
    record = {
        "route": "pytorch" if legacy is None else f"legacy-engine {legacy}",
        "engine_built": built,
        "serve_config": out["serve_config"],
    }
    if legacy is not None:
        record["tree"] = settings
    return {"artifacts": artifacts, "serve": {"commands": commands, "notes": notes}, "tensorrt_llm": record}


# -- SGLang -----------------------------------------------------------------------------------
