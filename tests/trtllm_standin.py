"""A CPU stand-in for the TensorRT-LLM pieces the kit's drafter package imports (TensorRT-LLM cannot be
installed here: its PyPI name is a placeholder and its wheels need CUDA).

Each piece does what the upstream one does for one unsharded sequence, in plain PyTorch:

* ``modules.linear.Linear``: a linear layer whose ``load_weights`` takes the list of checkpoint tensors the
  upstream loader hands it (one, or the q/k/v resp. gate/up parts of a fused layer, concatenated on dim 0);
  the TP modes are accepted and ignored (TP = 1).
* ``modules.rms_norm.RMSNorm``, ``modules.decoder_layer.DecoderLayer``: RMSNorm and a plain module.
* ``models.modeling_llama.LlamaAttention``: fused ``qkv_proj`` and ``o_proj``, neox RoPE from the config,
  causal attention over the tokens of the call (no paged KV cache, no ``attn_metadata``).
* ``models.modeling_utils``: ``DecoderModel``, ``DecoderModelForCausalLM`` (its ``lm_head``,
  ``logits_processor`` and the generic ``load_weights`` that fills each module from checkpoint names, fusing
  q/k/v and gate/up as upstream's ``params_map`` does, and failing on a missing tensor), and
  ``register_draft_model`` with its registry.
* ``models.modeling_speculative._build_eagle3_one_model_draft``: records that the built-in builder was asked.
* ``speculative.interface.SpeculativeDecodingMode``: the mode names.
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

BUILTIN_CALLS: list[Any] = []
DRAFT_BUILDERS: dict[Any, Any] = {}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class SpeculativeDecodingMode(enum.Enum):
    EAGLE3 = "eagle3"
    EAGLE3_ONE_MODEL = "eagle3_one_model"
    MTP = "mtp"


class TensorParallelMode(enum.Enum):
    COLUMN = "column"
    ROW = "row"


class WeightMode(enum.Enum):
    VANILLA = "vanilla"
    FUSED_GATE_UP_LINEAR = "fused_gate_up_linear"
    FUSED_QKV_LINEAR = "fused_qkv_linear"


class WeightsLoadingConfig:
    def __init__(self, weight_mode: WeightMode = WeightMode.VANILLA):
        self.weight_mode = weight_mode


class Linear(nn.Linear):
    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        dtype=None,
        mapping=None,
        tensor_parallel_mode=None,
        weights_loading_config=None,
        **kwargs,
    ):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.weights_loading_config = weights_loading_config or WeightsLoadingConfig()

    @torch.no_grad()
    def load_weights(self, weights: list[dict[str, torch.Tensor]]) -> None:
        self.weight.copy_(torch.cat([w["weight"] for w in weights]))
        if self.bias is not None:
            self.bias.copy_(torch.cat([w["bias"] for w in weights]))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6, dtype=None, **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class DecoderLayer(nn.Module):
    pass


class LlamaAttention(nn.Module):
    def __init__(self, model_config, layer_idx: int):
        super().__init__()
        config = model_config.pretrained_config
        self.layer_idx = layer_idx
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = Linear(
            config.hidden_size,
            (self.heads + 2 * self.kv_heads) * self.head_dim,
            bias=bias,
            weights_loading_config=WeightsLoadingConfig(WeightMode.FUSED_QKV_LINEAR),
        )
        self.o_proj = Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.rotary = LlamaRotaryEmbedding(config=config)

    def forward(self, position_ids, hidden_states, attn_metadata=None, **kwargs) -> torch.Tensor:
        tokens = hidden_states.shape[0]  # TensorRT-LLM passes the batch's tokens flattened: [tokens, d]
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q, k, v = (t.view(1, tokens, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = self.rotary(v, position_ids.view(1, tokens))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(tokens, -1))


class DecoderModel(nn.Module):
    def __init__(self, model_config):
        super().__init__()
        self.model_config = model_config


class DecoderModelForCausalLM(nn.Module):
    def __init__(self, model, config, hidden_size: int, vocab_size: int):
        super().__init__()
        self.model = model
        self.model_config = config
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def logits_processor(self, hidden, lm_head, attn_metadata=None, return_context_logits=False):
        return lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: dict, weight_mapper=None, skip_modules=(), **kwargs) -> None:
        for name, module in self.named_modules():
            if not name or any(name.split(".")[0] == s or name.startswith(s + ".") for s in skip_modules):
                continue
            if isinstance(module, Linear):
                last = name.rsplit(".", 1)[-1]
                parts = [name[: -len(last)] + p for p in FUSED.get(last, (last,))]
                module.load_weights(
                    [{k: weights[f"{p}.{k}"] for k in ("weight", "bias") if f"{p}.{k}" in weights} for p in parts]
                )
                continue
            for pname, param in module.named_parameters(recurse=False):
                param.copy_(weights[f"{name}.{pname}"])  # KeyError names a tensor the checkpoint lacks


def register_draft_model(mode):
    def decorate(builder):
        DRAFT_BUILDERS[mode] = builder
        return builder

    return decorate


def _build_eagle3_one_model_draft(model_config, draft_config, lm_head, model):
    BUILTIN_CALLS.append(draft_config)
    return "tensorrt-llm's Eagle3ForCausalLM"


def install() -> None:
    """Put the stand-in modules in ``sys.modules`` under TensorRT-LLM's names."""
    contents = {
        "tensorrt_llm": {},
        "tensorrt_llm._torch": {},
        "tensorrt_llm._torch.models": {},
        "tensorrt_llm._torch.models.modeling_llama": {"LlamaAttention": LlamaAttention},
        "tensorrt_llm._torch.models.modeling_utils": {
            "DecoderModel": DecoderModel,
            "DecoderModelForCausalLM": DecoderModelForCausalLM,
            "register_draft_model": register_draft_model,
        },
        "tensorrt_llm._torch.models.modeling_speculative": {
            "_build_eagle3_one_model_draft": _build_eagle3_one_model_draft
        },
        "tensorrt_llm._torch.modules": {},
        "tensorrt_llm._torch.modules.decoder_layer": {"DecoderLayer": DecoderLayer},
        "tensorrt_llm._torch.modules.linear": {
            "Linear": Linear,
            "TensorParallelMode": TensorParallelMode,
            "WeightMode": WeightMode,
            "WeightsLoadingConfig": WeightsLoadingConfig,
        },
        "tensorrt_llm._torch.modules.rms_norm": {"RMSNorm": RMSNorm},
        "tensorrt_llm._torch.speculative": {},
        "tensorrt_llm._torch.speculative.interface": {"SpeculativeDecodingMode": SpeculativeDecodingMode},
    }
    for name, attrs in contents.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def uninstall() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]
    DRAFT_BUILDERS.clear()
    BUILTIN_CALLS.clear()
