"""Explicit weight maps from the kit's draft checkpoints to the serving engines' parameters.

SGLang's loaders skip keys they do not know without a word, and TensorRT-LLM's converters only read
what they look for; a silently dropped tensor gives a draft that runs and accepts nothing. So every
export goes through one table per engine, and ``check_coverage`` proves both directions: each
checkpoint key lands in a parameter, and each parameter is filled.

A map entry is ``checkpoint key -> (engine parameter, shard)``: ``shard`` names the slice of a fused
parameter the tensor fills (``q``/``k``/``v`` of ``qkv_proj``, ``0``/``1`` of ``gate_up_proj``) or is
None for a plain copy. ``fuse`` applies a map at TP = 1 so tests can load the fused parameters
back into the kit's modules and compare outputs.
"""

from __future__ import annotations

from typing import Iterable

import torch

Shard = str | int | None
WeightMap = dict[str, tuple[str, Shard]]

# The fused layouts SGLang and TensorRT-LLM's PyTorch backend build their layers with.
STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
SHARD_ORDER = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}


class WeightMapError(ValueError):
    """A checkpoint key with no destination, or a parameter nobody fills; names them."""


def _decoder_entry(key: str, prefix: str) -> tuple[str, Shard]:
    for src, dst, shard in STACKED:
        if f".{src}." in key:
            return prefix + key.replace(f".{src}.", f".{dst}."), shard
    return prefix + key, None


def fused_draft_weight_map(keys: Iterable[str], kind: str) -> WeightMap:
    """Engine draft parameters for the kit's EAGLE/HASS or GRIFFIN checkpoint keys, in the layout SGLang's
    ``LlamaForCausalLMEagle``, the kit's SGLang GRIFFIN plugin and the kit's vLLM plugin all build: ``model.``
    prefix, the decoder layers' q/k/v and gate/up fused, TGF's small layers (``fc.*``) unsharded."""
    out: WeightMap = {}
    for key in keys:
        if key.startswith("layers."):
            out[key] = _decoder_entry(key, "model.")
        elif key == "embed_tokens.weight" or key.startswith("fc."):
            out[key] = ("model." + key, None)
        else:
            raise WeightMapError(f"checkpoint key {key!r} has no place in the engine's {kind} draft")
    return out


def fused_draft_parameters(kind: str, num_layers: int, fc_bias: bool, qkv_bias: bool) -> set[str]:
    """The parameters those draft classes own (``lm_head`` comes from the target at run time)."""
    params = {"model.embed_tokens.weight"}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        params |= {
            p + "self_attn.qkv_proj.weight",
            p + "self_attn.o_proj.weight",
            p + "mlp.gate_up_proj.weight",
            p + "mlp.down_proj.weight",
            p + "post_attention_layernorm.weight",
        }
        if qkv_bias:
            params.add(p + "self_attn.qkv_proj.bias")
        if i > 0:
            params.add(p + "input_layernorm.weight")
    if kind == "griffin":
        params |= {
            "model.fc.fc.weight",
            "model.fc.fc.bias",
            "model.fc.mlp.input_layernorm.weight",
            "model.fc.mlp.up_proj.weight",
            "model.fc.mlp.down_proj.weight",
            "model.fc.post_attention_layernorm.weight",
        }
    else:
        params.add("model.fc.weight")
        if fc_bias:
            params.add("model.fc.bias")
    return params


def check_coverage(weight_map: WeightMap, checkpoint_keys: Iterable[str], parameters: set[str], what: str) -> None:
    """Every checkpoint key mapped, every parameter (and every shard of a fused one) filled."""
    keys = set(checkpoint_keys)
    unmapped = sorted(keys - set(weight_map))
    if unmapped:
        raise WeightMapError(
            f"{what}: checkpoint key {unmapped[0]!r} is not in the weight map ({len(unmapped)} unmapped)"
        )
    filled: dict[str, set] = {}
    for key in keys:
        param, shard = weight_map[key]
        if param not in parameters:
            raise WeightMapError(f"{what}: key {key!r} maps to {param!r}, which the engine's model does not have")
        filled.setdefault(param, set()).add(shard)
    for param in sorted(parameters):
        if param not in filled:
            raise WeightMapError(f"{what}: parameter {param!r} is filled by no checkpoint key")
        fused = param.rsplit(".", 2)[-2]
        if fused in SHARD_ORDER and filled[param] != set(SHARD_ORDER[fused]):
            missing = set(SHARD_ORDER[fused]) - filled[param]
            raise WeightMapError(f"{what}: parameter {param!r} lacks shard(s) {sorted(map(str, missing))}")


def fuse(state: dict[str, torch.Tensor], weight_map: WeightMap) -> dict[str, torch.Tensor]:
    """Apply a map at TP = 1: fused parameters are their shards concatenated in the engine's order."""
    parts: dict[str, dict[Shard, torch.Tensor]] = {}
    for key, tensor in state.items():
        param, shard = weight_map[key]
        parts.setdefault(param, {})[shard] = tensor
    out = {}
    for param, shards in parts.items():
        fused = param.rsplit(".", 2)[-2]
        out[param] = torch.cat([shards[s] for s in SHARD_ORDER[fused]]) if fused in SHARD_ORDER else shards[None]
    return out


def unfuse(
    params: dict[str, torch.Tensor], weight_map: WeightMap, qkv_sizes: tuple[int, int, int]
) -> dict[str, torch.Tensor]:
    """Inverse of ``fuse`` (TP = 1): split fused parameters back into the checkpoint's keys.
    ``qkv_sizes``: rows of q, k and v (heads x head_dim, kv_heads x head_dim twice); gate/up halve."""
    by_param: dict[str, dict[Shard, str]] = {}
    for key, (param, shard) in weight_map.items():
        by_param.setdefault(param, {})[shard] = key
    out = {}
    for param, keys in by_param.items():
        tensor = params[param]
        if None in keys:
            out[keys[None]] = tensor
            continue
        order = SHARD_ORDER[param.rsplit(".", 2)[-2]]
        sizes = (
            dict(zip(order, qkv_sizes))
            if order == ("q", "k", "v")
            else {0: tensor.shape[0] // 2, 1: tensor.shape[0] // 2}
        )
        start = 0
        for shard in order:
            out[keys[shard]] = tensor[start : start + sizes[shard]]
            start += sizes[shard]
    return out
