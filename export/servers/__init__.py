"""Engines that run in another server: TensorRT-LLM (``trtllm-serve``; its PyTorch backend in
``export/trtllm_pytorch.py``, the legacy engine checkpoint in ``export/trtllm_export.py``), SGLang
(``sglang.launch_server``) and vLLM (``servers/vllm.py``).

Each gets the target as a Hugging Face checkpoint (``target/``, with its tokenizer), the draft in the
layout the server reads, the files that configure it, and ``serve.sh``, which starts the server from
the engine directory wherever it is mounted. The runtime does not run these engines; the chart and
the server launcher (``--backend``) do, on GPU machines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.export.servers.lookup import build_lookup_export, trtllm_enhancer
from specdec_kit.export.servers.sglang import build_sglang
from specdec_kit.export.servers.trtllm import build_trtllm
from specdec_kit.export.servers.vllm import build_vllm
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import draft_kind


def build_server_export(
    staging: Path, inputs: BuildInputs, target: TargetModel, module, tree, step, lookup_settings=None
) -> dict[str, Any]:
    """``module``: the head (a model-free kind: its settings); ``lookup_settings``: a hybrid's model-free settings."""
    if draft_kind(inputs.draft).model_free:
        return build_lookup_export(staging, inputs, target, module, tree, step)
    form = draft_kind(inputs.draft).engines.get(inputs.backend)
    reads_vocab = form is not None and form.official_layout and not form.target_head_only
    if form is not None and not reads_vocab and getattr(module, "d2t", None) is not None:
        drafter = f"the kit's {inputs.backend}" if not form.official_layout else f"{inputs.backend}'s own {form.method}"
        raise BuildError(
            f"{inputs.draft_path}: this {inputs.draft} head proposes a reduced vocabulary "
            f"({module.draft_vocab_size} of {module.config.vocab_size} tokens, draft_vocab_size in its "
            f"config), which {drafter} drafter does not read: it scores the target's "
            "whole vocabulary with the target's LM head; build it with --backend onnxruntime or torch, "
            "or train a head without --draft-vocab"
        )
    if inputs.backend == "vllm":
        return build_vllm(staging, inputs, target, module, tree, step)
    if inputs.backend == "tensorrt-llm":
        return build_trtllm(staging, inputs, target, module, tree, step, trtllm_enhancer(inputs, lookup_settings))
    return build_sglang(staging, inputs, target, module, tree, step)
