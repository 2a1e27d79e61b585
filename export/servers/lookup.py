"""Model-free drafts (prompt lookup, suffix trees) in the server engines: no draft weights, the engine's own method.

Each engine has its own take on drafting from the text, and none is exactly the kit's, so each mapping keeps the
kit's settings where the engine has them and says where it differs:

- vLLM: ``ngram`` (prompt lookup over the request, ``prompt_lookup_min``/``max``; always the n-gram's oldest
  occurrence, the kit's ``use_oldest``) and ``suffix`` (Arctic Inference's
  SuffixDecoding, with the same four settings the kit names). Both propose a chain of ``num_speculative_tokens``: the
  tree's longest path. ``suffix`` needs the ``arctic-inference`` package beside vLLM.
- SGLang (0.5.23): one algorithm, ``NGRAM``, a trie of earlier tokens shared by all requests that proposes a tree of
  ``--speculative-num-draft-tokens`` nodes. ``ngram`` maps to its breadth-first matching, ``suffix`` to its
  frequency-ranked matching (``PROB``) with the suffix tree's depth.
- TensorRT-LLM (PyTorch backend): ``ngram`` to ``NGram`` (a chain; the kit's prompt lookup is per request, so
  ``is_public_pool`` is off, and ``is_use_oldest`` follows ``use_oldest``), ``suffix`` to ``SA`` (a suffix
  automaton: the longest match; the shared pool when the kit keeps earlier responses). A hybrid head + suffix maps
  to the head's ``Eagle3`` config with ``sa_config``: TensorRT-LLM lets a long enough suffix match replace the head's
  chain, where the kit merges both into one tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.export.servers.common import engine_form, serve_script, write_target
from specdec_kit.export.servers.vllm import PLUGIN, SERVE_ENV, chain_length, serve_command, write_plugin
from specdec_kit.runtime.core.lookup import NgramSettings, SuffixSettings
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.models.target import TargetModel

# TensorRT-LLM's SAEnhancerConfig: the suffix match length from which the suffix automaton's chain replaces the head's
SA_THRESHOLD = 4


def vllm_config(settings: NgramSettings | SuffixSettings, tree: DynamicTreeConfig) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for a model-free kind."""
    if isinstance(settings, NgramSettings):
        return {
            "method": "ngram",
            "num_speculative_tokens": chain_length(tree),
            "prompt_lookup_max": settings.prompt_lookup_max,
            "prompt_lookup_min": settings.prompt_lookup_min,
        }
    return {
        "method": "suffix",
        "num_speculative_tokens": chain_length(tree),
        "suffix_decoding_max_tree_depth": settings.max_tree_depth,
        "suffix_decoding_max_cached_requests": settings.max_cached_requests,
        "suffix_decoding_max_spec_factor": settings.max_spec_factor,
        "suffix_decoding_min_token_prob": settings.min_token_prob,
    }


def sglang_flags(settings: NgramSettings | SuffixSettings, tree: DynamicTreeConfig) -> dict[str, str]:
    """SGLang's NGRAM flags for a model-free kind (the tree's node budget and breadth; the trie's depth holds a match
    and its continuation)."""
    if isinstance(settings, NgramSettings):
        match, depth = "BFS", settings.prompt_lookup_max + chain_length(tree)
    else:
        match, depth = "PROB", settings.max_tree_depth
    return {
        "--speculative-num-draft-tokens": str(tree.total_tokens),
        "--speculative-ngram-min-bfs-breadth": "1",
        "--speculative-ngram-max-bfs-breadth": str(tree.top_k),
        "--speculative-ngram-match-type": match,
        "--speculative-ngram-max-trie-depth": str(depth),
    }


def trtllm_config(settings: NgramSettings | SuffixSettings, tree: DynamicTreeConfig) -> dict[str, Any]:
    """TensorRT-LLM's ``speculative_config`` for a model-free kind (both propose chains)."""
    if isinstance(settings, NgramSettings):
        return {
            "decoding_type": "NGram",
            "max_draft_len": chain_length(tree),
            "max_matching_ngram_size": settings.prompt_lookup_max,
            "is_keep_all": True,
            "is_use_oldest": settings.use_oldest,
            "is_public_pool": False,
        }
    return {
        "decoding_type": "SA",
        "max_draft_len": chain_length(tree),
        "max_matching_ngram_size": -1,
        "enable_global_pool": settings.max_cached_requests > 0,
    }


def trtllm_enhancer(inputs: BuildInputs, settings: SuffixSettings | None) -> dict[str, Any] | None:
    """A hybrid's ``sa_config`` on TensorRT-LLM's EAGLE-3 config (None for a head alone; the engine rules leave only
    head + suffix hybrids to TensorRT-LLM)."""
    if inputs.lookup is None or settings is None:
        return None
    if inputs.trtllm_legacy_engine is not None:
        raise BuildError("--trtllm-legacy-engine: the legacy engine route has no suffix automaton; drop the option")
    return {"threshold": SA_THRESHOLD, "enable_global_pool": settings.max_cached_requests > 0}


def build_lookup_export(
    staging: Path, inputs: BuildInputs, target: TargetModel, settings, tree, step
) -> dict[str, Any]:
    """The target and the engine's launch files for a model-free kind."""
    form = engine_form(inputs.draft, inputs.backend)
    if not isinstance(tree, DynamicTreeConfig):
        raise BuildError(f"--draft {inputs.draft}: model-free drafts take a dynamic tree (its node budget and depth)")
    if inputs.trtllm_legacy_engine is not None:
        raise BuildError(
            f"--trtllm-legacy-engine: --draft {inputs.draft} runs on the PyTorch backend (drop the option)"
        )
    step(f"writing the target and the {inputs.backend} launch files ({form.method}, no draft weights)")
    write_target(staging, target, inputs, step)
    if inputs.backend == "vllm":
        return _vllm(staging, inputs, settings, vllm_config(settings, tree), tree)
    if inputs.backend == "sglang":
        return _sglang(staging, inputs, form.method, sglang_flags(settings, tree))
    return _trtllm(staging, inputs, trtllm_config(settings, tree))


def _vllm(
    staging: Path, inputs: BuildInputs, settings, spec: dict[str, Any], tree: DynamicTreeConfig
) -> dict[str, Any]:
    write_plugin(staging / "vllm" / "plugin")  # its launcher runs `vllm serve` on vLLM's CPU build too
    serve = serve_script(staging / "vllm" / "serve.sh", serve_command(spec, inputs), SERVE_ENV)
    notes = [
        f"vLLM proposes a chain, not a tree: its {spec['method']} proposer drafts "
        f"num_speculative_tokens={spec['num_speculative_tokens']} (the longest path of the kit's tree of "
        f"{tree.total_tokens} nodes)",
        "run vllm/serve.sh where vLLM is installed (SPECDEC_VLLM_PYTHON names its interpreter)",
    ]
    if spec["method"] == "ngram" and not settings.use_oldest:
        notes.append(
            "vLLM continues the n-gram's oldest occurrence, the kit its latest (use_oldest: true matches them)"
        )
    if spec["method"] == "suffix":
        notes.append("vLLM's suffix method needs the arctic-inference package in vLLM's environment")
    if settings.size_by_cost:
        notes.append("vLLM verifies every token it proposes; the kit cuts proposals by cost (size_by_cost), vLLM not")
    return {
        "artifacts": {"target": "target", "vllm_serve": "vllm/serve.sh"},
        "serve": {"commands": {"serve": serve}, "notes": notes},
        "vllm": {"architecture": None, "speculative_config": spec, "proposal": "chain", "plugin": PLUGIN},
    }


def _sglang(staging: Path, inputs: BuildInputs, algorithm: str, flags: dict[str, str]) -> dict[str, Any]:
    from specdec_kit.export.servers.sglang import LAUNCHER, launch_command, write_launcher

    command = launch_command(inputs, ["--speculative-algorithm", algorithm, *[x for kv in flags.items() for x in kv]])
    write_launcher(staging)
    serve = serve_script(staging / "sglang" / "serve.sh", command)
    return {
        "artifacts": {"target": "target", "sglang_serve": "sglang/serve.sh", "sglang_launcher": LAUNCHER},
        "serve": {
            "commands": {"serve": serve},
            "notes": ["SGLang's server needs a CUDA GPU; run sglang/serve.sh there"],
        },
        "sglang": {
            "architecture": None,
            "speculative_algorithm": algorithm,
            "speculative_num_draft_tokens": int(flags["--speculative-num-draft-tokens"]),
            "ngram": {k.removeprefix("--speculative-ngram-").replace("-", "_"): v for k, v in flags.items()},
        },
    }


def _trtllm(staging: Path, inputs: BuildInputs, spec: dict[str, Any]) -> dict[str, Any]:
    from specdec_kit.export.trtllm_pytorch import METRICS_OPTIONS

    serve_config = {"speculative_config": spec, **METRICS_OPTIONS}
    (staging / "trtllm").mkdir(parents=True, exist_ok=True)
    (staging / "trtllm" / "serve.yaml").write_text(yaml.safe_dump(serve_config, sort_keys=False))
    command = ["trtllm-serve", "${SPECDEC_MODEL_DIR:-target}", "--backend", "pytorch", "--config", "trtllm/serve.yaml"]
    command += [
        "--tp_size",
        str(inputs.tp),
        "--pp_size",
        str(inputs.pp),
        "--host",
        "0.0.0.0",
        "--port",
        "${PORT:-8000}",
    ]
    serve = serve_script(staging / "trtllm" / "serve.sh", command)
    return {
        "artifacts": {"target": "target", "trtllm_serve_config": "trtllm/serve.yaml"},
        "serve": {
            "commands": {"serve": serve},
            "notes": [
                f"serving needs a GPU machine with TensorRT-LLM; run trtllm/serve.sh there ({spec['decoding_type']})"
            ],
        },
        "tensorrt_llm": {"route": "pytorch", "engine_built": False, "serve_config": serve_config},
    }
