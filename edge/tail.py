"""The part of the target a drafting client holds: its last N decoder layers, final norm and LM head.

A Mixture-of-Attentions draft with TLI = N finishes each prediction with the target's last N layers, and
every draft ends in the target's LM head, so the client needs those weights and nothing else. They are
read tensor by tensor from the checkpoint's safetensors files (``safe_open``), renumbered as layers
0..N-1 of a Llama model of depth N, so a client never loads the full target into memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdec_kit.runtime.core.device import resolve_device, resolve_dtype
from specdec_kit.runtime.models.target import SUPPORTED_ARCHITECTURES, TargetLoadError, TargetModel


def _safetensors_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from ``model.safetensors`` or a sharded checkpoint's index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise TargetLoadError(f"{index}: unreadable or without 'weight_map' ({exc})") from exc
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise TargetLoadError(f"{path}: a client tail needs safetensors weights (model.safetensors or an index)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def tail_source_name(name: str, first_layer: int) -> str | None:
    """Tail parameter name -> the full checkpoint's name (None: not stored, e.g. the unused embedding)."""
    if name.startswith("model.layers."):
        rest = name[len("model.layers.") :]
        index, _, suffix = rest.partition(".")
        return f"model.layers.{int(index) + first_layer}.{suffix}"
    if name == "model.embed_tokens.weight":
        return None
    return name


def load_target_tail(
    path: str | Path, num_layers: int, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
) -> TargetModel:
    """A ``TargetModel`` of the checkpoint's last ``num_layers`` layers (0 for the LM head alone)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise TargetLoadError(f"{path / 'config.json'}: missing; a Hugging Face checkpoint directory needs config.json")
    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise TargetLoadError(
            f"{path / 'config.json'}: key 'architectures' is {archs}; expected one of {list(SUPPORTED_ARCHITECTURES)}"
        )
    total = config.num_hidden_layers
    if not 0 <= num_layers <= total:
        raise TargetLoadError(f"{path}: a tail of {num_layers} layers, but the target has {total}")
    if getattr(config, "tie_word_embeddings", False):
        raise TargetLoadError(
            f"{path / 'config.json'}: tie_word_embeddings is true; a client tail needs its own lm_head"
        )
    config.num_hidden_layers = num_layers
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.model.embed_tokens = nn.Embedding(1, config.hidden_size)  # drafts embed tokens themselves
    files = _safetensors_files(path)
    wanted: dict[Path, dict[str, str]] = {}  # file -> {checkpoint name: tail name}
    for name in model.state_dict():
        source = tail_source_name(name, total - num_layers)
        if source is None:
            continue
        if source not in files:
            raise TargetLoadError(f"{path}: tensor {source!r} is missing from the checkpoint")
        wanted.setdefault(files[source], {})[source] = name
    state = {}
    for file, names in wanted.items():  # each shard opened once
        with safe_open(str(file), framework="pt") as f:
            for source, name in names.items():
                state[name] = f.get_tensor(source).to(torch_dtype)
    state["model.embed_tokens.weight"] = torch.zeros(1, config.hidden_size, dtype=torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # buffers are not in the state dict
    return TargetModel(model.to(dev).eval())
