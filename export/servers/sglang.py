"""SGLang engines: the draft in SGLang's EAGLE layout (EAGLE-3 in the official one), for GRIFFIN the kit's model package
registered through ``SGLANG_EXTERNAL_MODEL_PACKAGE``, and ``serve.sh`` running ``sglang.launch_server`` through the
engine's launcher (``sglang/launch.py``: the API key from the environment, never on the command line).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from specdec_kit.export import trtllm_export as trt
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.export.servers.common import (
    PLUGINS,
    captured_layer_outputs,
    checked_weight_map,
    draft_state,
    engine_form,
    save_safetensors,
    serve_script,
    write_target,
)
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import draft_kind

SGLANG_PLUGIN = "specdec_griffin_sglang"


LAUNCHER = "sglang/launch.py"


def write_launcher(staging: Path) -> None:
    """The engine's SGLang launcher: ``sglang.launch_server`` with the API key from the environment, kept out of
    SGLang's command line, logs and /server_info (see the file)."""
    (staging / "sglang").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PLUGINS / "sglang" / "launch.py", staging / LAUNCHER)


def launch_command(inputs: BuildInputs, speculation: list[str]) -> list[str]:
    """SGLang's server (through the engine's launcher) over ``target`` with these speculative flags, the layout and
    the metrics on."""
    return [
        "python",
        LAUNCHER,
        "--model-path",
        "target",
        *speculation,
        "--tp-size",
        str(inputs.tp),
        "--pp-size",
        str(inputs.pp),
        "--dtype",
        inputs.dtype,
        "--enable-metrics",
        "--host",
        "0.0.0.0",
        "--port",
        "${PORT:-30000}",
    ]


def sglang_shape(module, tree: DynamicTreeConfig) -> tuple[int, int, int]:
    """SGLang's (num_steps, eagle_topk, num_draft_tokens): the dynamic tree's, or for a DFlash block draft (one draft
    forward, a chain) SGLang's DFLASH shape: one step, top-1, the verify window = the block the head was trained on
    (root and masked slots; SGLang requires the two equal)."""
    block = getattr(module, "block_size", None)
    if block is not None:
        return 1, 1, int(block)
    return tree.depth + 1, tree.top_k, tree.total_tokens


def build_sglang(staging: Path, inputs: BuildInputs, target: TargetModel, module, tree, step) -> dict[str, Any]:
    kind = inputs.draft
    form = engine_form(kind, "sglang")
    if not isinstance(tree, DynamicTreeConfig):
        raise BuildError(
            "SGLang drafts EAGLE-style dynamic trees only (steps / top-k / draft tokens); use --tree dynamic"
        )
    step("writing the draft in SGLang's layout")
    write_target(staging, target, inputs, step)
    state = draft_state(module, target.dtype)
    draft_dir = staging / "sglang" / "draft"
    cfg = draft_kind(kind).family.config_dict(module)
    cfg.update(architectures=[form.architecture], torch_dtype=inputs.dtype)
    weight_map = None
    if not form.official_layout:
        weight_map = checked_weight_map(module, kind, state, "SGLang")
    elif "eagle_config" in cfg:  # SGLang's EAGLE-3 class names layer outputs (DFlash's target_layer_ids already do)
        cfg["eagle_config"] = dict(
            cfg["eagle_config"], eagle_aux_hidden_state_layer_ids=captured_layer_outputs(module, "SGLang")
        )
    trt.write_json(draft_dir / "config.json", cfg)
    save_safetensors(state, draft_dir / "model.safetensors")
    if weight_map is not None:
        (draft_dir / "weight_map.json").write_text(json.dumps({k: list(v) for k, v in weight_map.items()}, indent=1))
    env = {}
    if form.plugin:
        shutil.copytree(
            PLUGINS / "sglang" / SGLANG_PLUGIN,
            staging / "sglang" / "plugin" / SGLANG_PLUGIN,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        env = {"SGLANG_EXTERNAL_MODEL_PACKAGE": SGLANG_PLUGIN, "PYTHONPATH": "sglang/plugin${PYTHONPATH:+:$PYTHONPATH}"}
    algorithm = form.method
    steps, top_k, draft_tokens = sglang_shape(module, tree)
    speculation = [
        "--speculative-algorithm",
        algorithm,
        "--speculative-draft-model-path",
        "sglang/draft",
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(top_k),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]
    command = launch_command(inputs, speculation)
    write_launcher(staging)
    serve = serve_script(staging / "sglang" / "serve.sh", command, env)
    artifacts = {
        "target": "target",
        "sglang_draft": "sglang/draft/model.safetensors",
        "sglang_serve": "sglang/serve.sh",
        "sglang_launcher": LAUNCHER,
    }
    if form.plugin:
        artifacts["sglang_plugin"] = f"sglang/plugin/{SGLANG_PLUGIN}/griffin_llama.py"
    return {
        "artifacts": artifacts,
        "serve": {
            "commands": {"serve": serve},
            "notes": [
                "SGLang's server needs a CUDA GPU; run sglang/serve.sh there (the kit must be installed "
                "beside SGLang for the GRIFFIN plugin)"
                if form.plugin
                else "SGLang's server needs a CUDA GPU; run sglang/serve.sh there"
            ],
        },
        "sglang": {
            "architecture": form.architecture,
            "speculative_algorithm": algorithm,
            "speculative_num_steps": steps,
            "speculative_eagle_topk": top_k,
            "speculative_num_draft_tokens": draft_tokens,
            "weight_map_checked": weight_map is not None,
        },
    }
