"""TensorRT-LLM's PyTorch backend (its only backend since the TensorRT engine backend was removed after 1.2).

Every EAGLE-family kind runs in TensorRT-LLM's one-model EAGLE3 worker: ``trtllm-serve target --backend pytorch
--config trtllm/serve.yaml``, where the YAML (``extra_llm_api_options``) holds the ``speculative_config``. EAGLE-3
heads load as TensorRT-LLM's own ``Eagle3ForCausalLM`` from the official layout; EAGLE-1/EAGLE-2/HASS and GRIFFIN
heads load through the kit's drafter package (``trtllm/specdec_trtllm``, imported with ``--custom_module_dirs``),
which registers the draft builder of that mode. The keys written here are the ones recorded from TensorRT-LLM's
``tensorrt_llm/llmapi/llm_args.py`` (``tests/upstream/tensorrt_llm_llm_args.json``, with the commit read).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Callable

from torch import nn

from specdec_kit.export.inputs import BuildError
from specdec_kit.export.servers.common import engine_form
from specdec_kit.export.trtllm_export import write_json
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.registry import EngineForm, draft_kind, kinds_for_engine

PLUGIN_DIR = Path(__file__).resolve().parent / "plugins" / "trtllm"
DRAFTER_PACKAGE = "specdec_trtllm"
LEGACY = "tensorrt-llm-legacy"  # the registry's name for the legacy engine route's forms
# What serving needs to see the engine: iteration statistics (queue depth, KV-cache use, draft and accepted tokens,
# acceptance length) and trtllm-serve's Prometheus endpoint (/prometheus/metrics), which it mounts only with
# return_perf_metrics; the chart's probes, autoscaling, endpoint picker and `helm test` read them.
METRICS_OPTIONS = {"enable_iter_perf_stats": True, "return_perf_metrics": True}
REMOVAL = (
    "TensorRT-LLM removed trtllm-build and its TensorRT engine backend after release 1.2 (PRs #15763, #15767; "
    "migration guide docs/source/legacy/tensorrt-backend-removal.md)"
)


def check_legacy_release(release: str | None, draft: str, backend: str) -> None:
    """``--trtllm-legacy-engine RELEASE`` names a release that still has the TensorRT engine route (<= 1.2)."""
    if release is None:
        return
    if backend != "tensorrt-llm":
        raise BuildError(f"--trtllm-legacy-engine {release}: applies to --backend tensorrt-llm only (found {backend})")
    match = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?(?:[.\w]*)", release)
    if not match:
        raise BuildError(f"--trtllm-legacy-engine {release!r}: expected a TensorRT-LLM release such as 1.2.1")
    if (int(match.group(1)), int(match.group(2))) > (1, 2):
        raise BuildError(
            f"--trtllm-legacy-engine {release}: {REMOVAL}, so {release} cannot run a legacy engine; "
            "drop the option to write the PyTorch-backend export that release runs"
        )
    if draft not in kinds_for_engine(LEGACY):
        raise BuildError(
            f"--trtllm-legacy-engine {release}: the legacy engine route builds {', '.join(kinds_for_engine(LEGACY))}; "
            f"--draft {draft} runs on the PyTorch backend (drop the option)"
        )


def speculative_config(
    tree: StaticTree | DynamicTreeConfig, layers_to_capture: list[int], form: EngineForm
) -> dict[str, Any]:
    """``speculative_config`` for the one-model EAGLE3 worker: a dynamic tree, a chain, or a static tree."""
    spec: dict[str, Any] = {
        "decoding_type": form.method,
        "speculative_model": "trtllm/draft",
        "eagle3_layers_to_capture": sorted(layers_to_capture),
    }
    if isinstance(tree, DynamicTreeConfig):
        levels, total = tree.depth + 1, tree.total_tokens - 1
        if not levels <= total <= tree.top_k * levels:  # TensorRT-LLM's EagleDecodingConfig check
            raise BuildError(
                f"tree dynamic:{tree.total_tokens}:{tree.depth}:{tree.top_k}: TensorRT-LLM needs "
                f"max_draft_len ({levels}) <= max_total_draft_tokens ({total}) <= dynamic_tree_max_topK "
                f"* max_draft_len ({tree.top_k * levels}); choose --total-tokens within that"
            )
        return {
            **spec,
            "max_draft_len": levels,
            "max_total_draft_tokens": total,
            "use_dynamic_tree": True,
            "dynamic_tree_max_topK": tree.top_k,
        }
    choices = [list(c) for c in tree.choices]
    depth = max(len(c) for c in choices)
    if len(choices) == depth:  # a chain: the linear path
        return {**spec, "max_draft_len": depth}
    return {**spec, "max_draft_len": depth, "eagle_choices": choices}


def write_draft_dir(
    draft_dir: Path,
    kind: str,
    form: EngineForm,
    module: nn.Module,
    dtype_name: str,
    state_writer: Callable[[Path], None],
) -> None:
    """The draft as TensorRT-LLM's ``ModelConfig.from_pretrained`` and the drafter read it."""
    cfg = draft_kind(kind).family.config_dict(module)
    if not form.official_layout:
        if cfg.get("qkv_bias"):
            raise BuildError(
                "this draft has q/k/v biases; TensorRT-LLM's LlamaAttention (which the kit's drafter "
                "uses) ties them to an o_proj bias the draft lacks (attention_bias)"
            )
        cfg.update(architectures=[form.architecture], draft_vocab_size=cfg["vocab_size"])
    cfg["torch_dtype"] = dtype_name
    write_json(draft_dir / "config.json", cfg)
    state_writer(draft_dir / "model.safetensors")


def pytorch_route(
    staging: Path,
    kind: str,
    module: nn.Module,
    tree: StaticTree | DynamicTreeConfig,
    tp: int,
    pp: int,
    dtype_name: str,
    layers_to_capture: list[int],
    state_writer: Callable[[Path], None],
    enhancer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Draft directory, drafter package (kit kinds) and the serve command; returns what ``build_trtllm`` records.
    ``enhancer``: the suffix automaton beside the head (``sa_config``)."""
    form = engine_form(kind, "tensorrt-llm")
    write_draft_dir(staging / "trtllm" / "draft", kind, form, module, dtype_name, state_writer)
    spec = speculative_config(tree, layers_to_capture, form)
    if enhancer is not None:
        spec["sa_config"] = enhancer
    # trtllm-serve names the model after its directory: specdec-serve points SPECDEC_MODEL_DIR at a link named as the
    # served model
    serve = ["trtllm-serve", "${SPECDEC_MODEL_DIR:-target}", "--backend", "pytorch", "--config", "trtllm/serve.yaml"]
    artifacts = {"trtllm_draft": "trtllm/draft/model.safetensors"}
    if form.plugin:
        shutil.copytree(
            PLUGIN_DIR / DRAFTER_PACKAGE,
            staging / "trtllm" / DRAFTER_PACKAGE,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        serve += ["--custom_module_dirs", f"trtllm/{DRAFTER_PACKAGE}"]
        artifacts["trtllm_drafter_package"] = f"trtllm/{DRAFTER_PACKAGE}/drafter.py"
    serve += ["--tp_size", str(tp), "--pp_size", str(pp), "--host", "0.0.0.0", "--port", "${PORT:-8000}"]
    notes = []
    if "eagle_choices" in spec:
        notes.append(
            "eagle_choices (a static tree) is deprecated in TensorRT-LLM and slated for removal in 1.4; "
            "a dynamic tree or a chain keeps working"
        )
    return {
        "build": None,
        "serve_config": {"speculative_config": spec, **METRICS_OPTIONS},
        "serve": serve,
        "artifacts": artifacts,
        "notes": notes,
        "plugin": form.plugin,
    }
