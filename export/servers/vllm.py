"""vLLM engines: the target as a Hugging Face checkpoint, the draft in the kit's own layout, the kit's vLLM model
plugin, and ``vllm/serve.sh`` (vLLM's OpenAI server with ``--speculative-config``).

vLLM proposes chains, not trees: its EAGLE proposer drafts ``num_speculative_tokens`` tokens, each the top-1 of
the step before. The kit's tree maps to the chain its longest path allows (dynamic: ``depth + 1`` draft tokens;
static: the deepest choice); its width (top-k, node budget) has no vLLM counterpart.

The EAGLE-1/2, HASS and GRIFFIN heads run through the plugin's architectures (``specdec_vllm``), not vLLM's
``EagleLlamaForCausalLM``: that class drops ``fc.bias`` and reads the EAGLE config's ``bias`` as an attention bias,
and no vLLM class is GRIFFIN. EAGLE-3 heads run in vLLM's own ``Eagle3LlamaForCausalLM`` (``"method": "eagle3"``),
which reads the official layout as the kit writes it (``midlayer.*``, ``d2t``; the target layers it taps from
``eagle_config.eagle_aux_hidden_state_layer_ids``); P-EAGLE heads run in the same class with ``"parallel_drafting":
true`` (it loads ``mask_hidden`` and reads ``mask_token_id`` from the config), proposing the chain in one forward. The plugin is registered through a ``vllm.general_plugins``
entry point declared by a ``.dist-info`` directory beside it, so putting ``vllm/plugin`` on ``PYTHONPATH``
(``serve.sh`` does) registers it in every vLLM process without installing anything. DFlash heads run in vLLM's
``DFlashQwen3ForCausalLM`` (``"method": "dflash"``). With ``--draft-format speculators`` an EAGLE-3, P-EAGLE or DFlash
draft is written in the speculators format instead (``export/speculators.py``), which vLLM converts to the same
official config itself; the speculative config keeps its explicit method.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from specdec_kit import __version__
from specdec_kit.export.inputs import BuildInputs
from specdec_kit.export.servers.common import (
    PLUGINS,
    checked_weight_map,
    draft_biases,
    draft_state,
    engine_form,
    save_safetensors,
    serve_script,
    write_target,
)
from specdec_kit.export.speculators import speculators_config, write_speculators_files
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import EngineForm, draft_kind

PLUGIN = "specdec_vllm"
PLUGIN_SOURCE = PLUGINS / "vllm" / PLUGIN
# vLLM's `vllm serve`, through the plugin's module (``specdec_vllm.serve``: the `vllm` command fails on vLLM's CPU build)
SERVER_MODULE = f"{PLUGIN}.serve"
SERVE_ENV = {"PYTHONPATH": "vllm/plugin${PYTHONPATH:+:$PYTHONPATH}"}  # vLLM loads the plugin (and its launcher) there


def chain_length(tree: StaticTree | DynamicTreeConfig) -> int:
    """The draft tokens on the tree's longest path: the chain vLLM proposes instead."""
    return tree.depth + 1 if isinstance(tree, DynamicTreeConfig) else tree.buffers.max_depth


def proposal_text(tree: StaticTree | DynamicTreeConfig) -> str:
    k = chain_length(tree)
    shape = (
        f"dynamic tree (total_tokens={tree.total_tokens}, depth={tree.depth}, top_k={tree.top_k})"
        if isinstance(tree, DynamicTreeConfig)
        else f"static tree of {tree.buffers.num_nodes} nodes"
    )
    return (
        f"vLLM proposes a chain, not a tree: the kit's {shape} maps to num_speculative_tokens={k} "
        f"(its longest path), each draft token the top-1 of the step before; the tree's width has no vLLM "
        f"counterpart"
    )


def write_plugin(plugin_dir: Path) -> None:
    """The plugin package and a ``.dist-info`` that declares its entry point to ``importlib.metadata``."""
    shutil.copytree(PLUGIN_SOURCE, plugin_dir / PLUGIN, ignore=shutil.ignore_patterns("__pycache__"))
    info = plugin_dir / f"{PLUGIN}-{__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: {__version__}\n"
        "Summary: specdec-kit draft heads as vLLM architectures\n"
    )
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = {PLUGIN}:register\n")
    (info / "top_level.txt").write_text(PLUGIN + "\n")


def _draft_config(module, kind: str, form: EngineForm, dtype: str) -> dict[str, Any]:
    cfg = draft_kind(kind).family.config_dict(module)
    if form.official_layout:  # vLLM names the class itself (Eagle3 + the config's "LlamaForCausalLM")
        return dict(cfg, torch_dtype=dtype)
    # vLLM's Llama layers read ``bias`` as an attention bias; the plugin reads its own keys instead
    cfg.pop("bias", None)
    cfg.pop("qkv_bias", None)
    fc_bias, qkv_bias = draft_biases(module, kind)
    cfg.update(
        architectures=[form.architecture],
        torch_dtype=dtype,
        specdec_kind=kind,
        specdec_fc_bias=fc_bias,
        specdec_qkv_bias=qkv_bias,
    )
    return cfg


def speculative_config(
    tree: StaticTree | DynamicTreeConfig, form: EngineForm, most: int | None = None
) -> dict[str, Any]:
    """The chain for ``tree``, at most ``most`` tokens (a parallel draft's proposals per forward)."""
    tokens = chain_length(tree) if most is None else min(chain_length(tree), most)
    return {"method": form.method, "model": "vllm/draft", "num_speculative_tokens": tokens, **form.options}


def serve_command(spec: dict[str, Any], inputs: BuildInputs) -> list[str]:
    """vLLM's OpenAI server over ``target`` with this speculative config, through the plugin's launcher."""
    return [
        "${SPECDEC_VLLM_PYTHON:-python}",
        "-m",
        SERVER_MODULE,
        "target",
        "--speculative-config",
        json.dumps(spec, separators=(",", ":")),
        "--dtype",
        inputs.dtype,
        "--tensor-parallel-size",
        str(inputs.tp),
        "--pipeline-parallel-size",
        str(inputs.pp),
        "--host",
        "0.0.0.0",
        "--port",
        "${PORT:-8000}",
    ]


def build_vllm(
    staging: Path, inputs: BuildInputs, target: TargetModel, module, tree, step: Callable[[str], None]
) -> dict[str, Any]:
    kind = inputs.draft
    form = engine_form(kind, "vllm")
    step("writing the target and the draft for vLLM")
    write_target(staging, target, inputs, step)
    state = draft_state(module, target.dtype)
    if not form.official_layout:
        checked_weight_map(module, kind, state, "vLLM")
    draft_dir = staging / "vllm" / "draft"
    config = _draft_config(module, kind, form, inputs.dtype)
    spec = speculative_config(tree, form, getattr(module, "parallel_tokens", None))
    if inputs.draft_format == "speculators":  # vLLM converts the config itself; the method stays explicit
        architecture = (target.config.architectures or ["LlamaForCausalLM"])[0]
        config = speculators_config(config, spec["num_speculative_tokens"], "target", architecture)
        write_speculators_files(draft_dir, config, state)
    else:
        draft_dir.mkdir(parents=True)
        (draft_dir / "config.json").write_text(json.dumps(config, indent=2))
        save_safetensors(state, draft_dir / "model.safetensors")
    write_plugin(staging / "vllm" / "plugin")
    serve = serve_script(staging / "vllm" / "serve.sh", serve_command(spec, inputs), SERVE_ENV)
    proposal = proposal_text(tree)
    step(proposal)
    return {
        "artifacts": {
            "target": "target",
            "vllm_draft": "vllm/draft/model.safetensors",
            "vllm_plugin": f"vllm/plugin/{PLUGIN}/drafts.py",
            "vllm_serve": "vllm/serve.sh",
        },
        "serve": {
            "commands": {"serve": serve},
            "notes": [
                proposal,
                "serve it with specdec-serve --engine (it sizes vLLM-CPU's KV cache from the engine); run "
                "vllm/serve.sh where vLLM is installed (SPECDEC_VLLM_PYTHON names its interpreter), on a CPU with "
                "VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes and --max-model-len",
            ],
        },
        "vllm": {
            "architecture": form.architecture,
            "speculative_config": spec,
            "proposal": "chain",
            "plugin": PLUGIN,
            "weight_map_checked": not form.official_layout,
            "draft_format": inputs.draft_format,
        },
    }
