"""TensorRT-LLM export: a sharded checkpoint for the legacy engine flow, and the configuration files.

Checkpoint layout (``docs/source/legacy/architecture/checkpoint.md``; LLaMA names from
``tensorrt_llm/models/llama/convert.py``): ``config.json`` + ``rank{N}.safetensors``. Linear weights
are (out, in); column-parallel layers (fused ``qkv``, ``mlp.fc`` = gate_proj, ``mlp.gate`` = up_proj,
``lm_head``) split on dim 0, row-parallel layers (``attention.dense``, ``mlp.proj``) on dim 1; each
rank's fused QKV is ``[q_r; k_r; v_r]``, KV heads are duplicated up to TP when there are fewer.
EAGLE adds ``eagle_nets.{i}.drafter.*`` (one copy per EagleNet, as the converter writes them) and
``eagle_nets.{i}.lm_head.weight``; Medusa adds ``medusa_heads.{h}.medusa_layers.{l}.linear.*`` and
``medusa_heads.{h}.lm_head.weight``.

Nothing here imports TensorRT-LLM: the files are right by construction and by test
(``tests/test_export_trtllm.py``), and ``build.sh`` runs ``trtllm-build`` on a machine that has it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree

# TensorRT-LLM's limits (examples/eagle/README.md, builder.py): asserted again by its converter.
MAX_DRAFT_LEN = 256
MAX_BATCH_SIZE = 512


class TrtllmExportError(ValueError):
    """An input TensorRT-LLM cannot take; the message says which limit and the values."""


def split(w: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    if w.shape[dim] % tp:
        raise TrtllmExportError(f"cannot split a tensor of shape {list(w.shape)} on dim {dim} into {tp} shards")
    return torch.chunk(w, tp, dim=dim)[rank].contiguous()


def dup_kv(w: torch.Tensor, kv_heads: int, head_dim: int, tp: int) -> torch.Tensor:
    """Repeat KV heads so each of ``tp`` ranks owns one copy (TensorRT-LLM's ``dup_kv_weight``)."""
    if kv_heads >= tp:
        return w
    if tp % kv_heads:
        raise TrtllmExportError(f"num_key_value_heads = {kv_heads} does not divide --tp {tp}")
    rep = tp // kv_heads
    return (
        w.reshape(kv_heads, head_dim, *w.shape[1:])
        .repeat_interleave(rep, dim=0)
        .reshape(kv_heads * rep * head_dim, *w.shape[1:])
    )


def pad_vocab(w: torch.Tensor, tp: int) -> torch.Tensor:
    """Pad the vocabulary rows to a multiple of TP (``pad_vocab_size``); padded logits are zero rows."""
    extra = (-w.shape[0]) % tp
    return torch.cat([w, w.new_zeros(extra, *w.shape[1:])]) if extra else w


def _qkv(q, k, v, kv_heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    k, v = dup_kv(k, kv_heads, head_dim, tp), dup_kv(v, kv_heads, head_dim, tp)
    return torch.cat([split(q, tp, rank), split(k, tp, rank), split(v, tp, rank)])


def convert_decoder_layer(
    hf: dict[str, torch.Tensor], src: str, dst: str, kv_heads: int, head_dim: int, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """One Llama decoder layer: HF names under ``src`` to TensorRT-LLM names under ``dst``."""
    out = {
        dst + "attention.qkv.weight": _qkv(
            hf[src + "self_attn.q_proj.weight"],
            hf[src + "self_attn.k_proj.weight"],
            hf[src + "self_attn.v_proj.weight"],
            kv_heads,
            head_dim,
            tp,
            rank,
        )
    }
    if src + "self_attn.q_proj.bias" in hf:
        out[dst + "attention.qkv.bias"] = _qkv(
            hf[src + "self_attn.q_proj.bias"],
            hf[src + "self_attn.k_proj.bias"],
            hf[src + "self_attn.v_proj.bias"],
            kv_heads,
            head_dim,
            tp,
            rank,
        )
    out[dst + "attention.dense.weight"] = split(hf[src + "self_attn.o_proj.weight"], tp, rank, dim=1)
    out[dst + "mlp.fc.weight"] = split(hf[src + "mlp.gate_proj.weight"], tp, rank)  # TensorRT-LLM's fc is gate_proj
    out[dst + "mlp.gate.weight"] = split(hf[src + "mlp.up_proj.weight"], tp, rank)  # and its gate is up_proj
    out[dst + "mlp.proj.weight"] = split(hf[src + "mlp.down_proj.weight"], tp, rank, dim=1)
    out[dst + "post_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
    if src + "input_layernorm.weight" in hf:
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
    return out


def convert_target(
    hf: dict[str, torch.Tensor], cfg: dict[str, Any], tp: int, pp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The base Llama model's shard for ``rank`` (= pp_rank * tp + tp_rank)."""
    tp_rank, pp_rank = rank % tp, rank // tp
    layers = cfg["num_hidden_layers"]
    per_stage = layers // pp
    out = {}
    for local, layer in enumerate(range(pp_rank * per_stage, (pp_rank + 1) * per_stage)):
        out.update(
            convert_decoder_layer(
                hf,
                f"model.layers.{layer}.",
                f"transformer.layers.{local}.",
                cfg["num_key_value_heads"],
                cfg["head_dim"],
                tp,
                tp_rank,
            )
        )
    if pp_rank == 0:
        out["transformer.vocab_embedding.weight"] = hf["model.embed_tokens.weight"]
    if pp_rank == pp - 1:
        head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])  # tied embeddings share the table
        out["lm_head.weight"] = split(pad_vocab(head, tp), tp, tp_rank)
        out["transformer.ln_f.weight"] = hf["model.norm.weight"]
    return out


def convert_eagle(
    draft: dict[str, torch.Tensor],
    hf_target: dict[str, torch.Tensor],
    draft_cfg: dict[str, Any],
    num_eagle_layers: int,
    tp: int,
    rank: int,
) -> dict[str, torch.Tensor]:
    """EAGLE/HASS draft weights, one copy per EagleNet (TensorRT-LLM runs ``num_eagle_layers`` of them)."""
    net: dict[str, torch.Tensor] = {"drafter.fc.weight": split(draft["fc.weight"], tp, rank)}
    if "fc.bias" in draft:
        net["drafter.fc.bias"] = split(draft["fc.bias"], tp, rank)
    net["drafter.vocab_embedding.weight"] = draft["embed_tokens.weight"]
    for i in range(draft_cfg["num_hidden_layers"]):
        net.update(
            convert_decoder_layer(
                draft,
                f"layers.{i}.",
                f"drafter.layers.{i}.",
                draft_cfg["num_key_value_heads"],
                draft_cfg["head_dim"],
                tp,
                rank,
            )
        )
    head = hf_target.get("lm_head.weight", hf_target["model.embed_tokens.weight"])
    net["lm_head.weight"] = split(pad_vocab(head, tp), tp, rank)
    return {f"eagle_nets.{i}.{k}": v.clone() for i in range(num_eagle_layers) for k, v in net.items()}


def convert_medusa(
    heads: dict[str, torch.Tensor], num_heads: int, num_layers: int, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """Medusa heads from the kit's ``medusa_head.{h}.{l}`` keys (the official layout)."""
    out = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            src, dst = f"medusa_head.{h}.{layer}.linear.", f"medusa_heads.{h}.medusa_layers.{layer}.linear."
            out[dst + "weight"] = split(heads[src + "weight"], tp, rank)
            out[dst + "bias"] = split(heads[src + "bias"], tp, rank)
        out[f"medusa_heads.{h}.lm_head.weight"] = split(
            pad_vocab(heads[f"medusa_head.{h}.{num_layers}.weight"], tp), tp, rank
        )
    return out


# -- trees ------------------------------------------------------------------------------------
def non_leaves_per_level(choices: list[list[int]]) -> list[int]:
    """How many nodes at each depth have children (TensorRT-LLM's ``maxNonLeafNodesPerLayer`` count)."""
    paths = {tuple(c) for c in choices}
    parents = {p[:-1] for p in paths if len(p) > 1}
    depth = max(len(p) for p in paths)
    counts = [0] * depth
    counts[0] = 1  # the root (depth 0) always has children
    for p in parents:
        counts[len(p)] += 1
    return counts


def tree_settings(tree: StaticTree | DynamicTreeConfig) -> dict[str, Any]:
    """``max_draft_len``, ``num_eagle_layers``, ``max_non_leaves_per_layer`` and the tree itself."""
    if isinstance(tree, StaticTree):
        choices = [list(c) for c in tree.choices]
        return {
            "max_draft_len": len(choices),
            "num_eagle_layers": max(len(c) for c in choices),
            "max_non_leaves_per_layer": max(non_leaves_per_level(choices)),
            "choices": choices,
            "dynamic": None,
        }
    levels = tree.depth + 1
    return {
        "max_draft_len": tree.total_tokens - 1,
        "num_eagle_layers": levels,
        "max_non_leaves_per_layer": tree.top_k,
        "choices": None,
        "dynamic": {"use_dynamic_tree": True, "dynamic_tree_max_topK": tree.top_k},
    }


def check_tree(settings: dict[str, Any]) -> None:
    """TensorRT-LLM's constraints: draft length within 256, every path no deeper than ``num_eagle_layers``
    and the deepest exactly that deep, non-leaves per level within the maximum, EAGLE-2's node count."""
    n, layers, max_nl = settings["max_draft_len"], settings["num_eagle_layers"], settings["max_non_leaves_per_layer"]
    if not 1 <= n <= MAX_DRAFT_LEN:
        raise TrtllmExportError(f"max_draft_len = {n}; TensorRT-LLM needs 1..{MAX_DRAFT_LEN}")
    if settings["choices"] is not None:
        depths = [len(c) for c in settings["choices"]]
        if max(depths) != layers:
            raise TrtllmExportError(f"deepest choice path has depth {max(depths)}, num_eagle_layers = {layers}")
        counts = non_leaves_per_level(settings["choices"])
        if max(counts) > max_nl:
            raise TrtllmExportError(
                f"{max(counts)} non-leaf nodes at depth {counts.index(max(counts))}, "
                f"more than max_non_leaves_per_layer = {max_nl}"
            )
    else:
        k = settings["dynamic"]["dynamic_tree_max_topK"]
        bound = k + k * k * (layers - 1)
        if n > bound:
            raise TrtllmExportError(
                f"max_draft_len = {n} exceeds the {bound} nodes EAGLE-2 produces with top-k {k} over {layers} layers"
            )


# -- configs ----------------------------------------------------------------------------------
def llama_fields(cfg: dict[str, Any], dtype: str, tp: int, pp: int) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "logits_dtype": "float32",
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_size": cfg["head_dim"],
        "vocab_size": cfg["vocab_size"],
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": cfg["max_position_embeddings"],
        "hidden_act": cfg.get("hidden_act", "silu"),
        "rotary_base": cfg.get("rope_theta", 10000.0),
        "rotary_scaling": cfg.get("rope_scaling"),
        "norm_epsilon": cfg["rms_norm_eps"],
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
    }


def checkpoint_config(
    medusa: bool, target_cfg: dict, draft_cfg: dict, settings: dict, dtype: str, tp: int, pp: int
) -> dict:
    """The checkpoint's config.json: a Medusa model (``medusa``) or an EAGLE one."""
    config = llama_fields(target_cfg, dtype, tp, pp)
    if medusa:
        config.update(
            architecture="MedusaForCausalLM",
            num_medusa_heads=draft_cfg["medusa_num_heads"],
            num_medusa_layers=draft_cfg["medusa_num_layers"],
            medusa_hidden_act="silu",
            max_draft_len=settings["max_draft_len"],
        )
        return config
    eagle_net = llama_fields(
        {
            **draft_cfg,
            "vocab_size": target_cfg["vocab_size"],
            "max_position_embeddings": target_cfg["max_position_embeddings"],
            "rms_norm_eps": target_cfg["rms_norm_eps"],
            "rope_theta": target_cfg.get("rope_theta", 10000.0),
            "rope_scaling": target_cfg.get("rope_scaling"),
        },
        dtype,
        tp,
        1,
    )
    eagle_net["architecture"] = "LlamaForCausalLM"
    config.update(
        architecture="EagleForCausalLM",
        max_draft_len=settings["max_draft_len"],
        num_eagle_layers=settings["num_eagle_layers"],
        max_non_leaves_per_layer=settings["max_non_leaves_per_layer"],
        eagle_net_config=eagle_net,
    )
    return config


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
