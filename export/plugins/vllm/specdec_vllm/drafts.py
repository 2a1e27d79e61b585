"""EAGLE-1/2/HASS (with or without ``fc.bias``) and GRIFFIN drafts for vLLM's EAGLE proposer.

The proposer calls ``forward(input_ids, positions, hidden_states)`` and expects ``(for_logits, next_hidden)``:
the first goes through ``compute_logits`` (the target's LM head, shared), the second is the next draft
step's feature input. For EAGLE both are the layer output; for GRIFFIN the TEH output is split into the
prediction feature (first half) and the regression feature (second half), exactly as in the kit.

Layer 0 has no input norm; the draft's attention layers are numbered after the target's so that vLLM gives
them KV cache of their own. Weights load strictly from the kit's export (see ``load_weights``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaAttention
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

from specdec_vllm.trace import DraftTrace
from specdec_vllm.weights import OPTIONAL, parameter_for


class GatedMLP(nn.Module):
    """SwiGLU MLP whose output may be wider than its input (GRIFFIN's TEH writes two features)."""

    def __init__(self, hidden: int, intermediate: int, out: int, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(intermediate, out, bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(x))
        return x


class DraftLayer(nn.Module):
    """One Llama decoder layer of a draft: no input norm at index 0; ``widened`` duplicates the residual and
    doubles the MLP's output (GRIFFIN's TEH)."""

    def __init__(self, vllm_config: VllmConfig, config, index: int, widened: bool, qkv_bias: bool, prefix: str):
        super().__init__()
        d = config.hidden_size
        self.index, self.widened = index, widened
        if index:
            self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config=config,
            hidden_size=d,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            quant_config=None,
            bias=qkv_bias,
            bias_o_proj=False,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.mlp = GatedMLP(d, config.intermediate_size, 2 * d if widened else d, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden
        if self.index:
            hidden = self.input_layernorm(hidden)
        hidden = residual + self.self_attn(positions=positions, hidden_states=hidden)
        residual = torch.cat((hidden, hidden), dim=-1) if self.widened else hidden
        return residual + self.mlp(self.post_attention_layernorm(hidden))


class TokenGuidedFusion(nn.Module):
    """GRIFFIN's TGF: h = fc([emb; F]); h + down(SiLU(up([norm(post_ln(h)); norm(emb)]))), one shared norm."""

    def __init__(self, config, prefix: str):
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.fc = ReplicatedLinear(2 * d, d, bias=True, prefix=f"{prefix}.fc", return_bias=False)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.mlp.up_proj = ColumnParallelLinear(2 * d, inter, bias=False, prefix=f"{prefix}.mlp.up_proj")
        self.mlp.down_proj = RowParallelLinear(inter, d, bias=False, prefix=f"{prefix}.mlp.down_proj")

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.cat((embeds, features), dim=-1))
        norm = self.mlp.input_layernorm
        up, _ = self.mlp.up_proj(torch.cat((norm(self.post_attention_layernorm(h)), norm(embeds)), dim=-1))
        down, _ = self.mlp.down_proj(nn.functional.silu(up))
        return h + down


class DraftModel(nn.Module):
    def __init__(self, vllm_config: VllmConfig, config, griffin: bool, prefix: str):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"draft hidden_act {config.hidden_act!r}: only silu is supported")
        d = config.hidden_size
        self.hidden_size, self.griffin = d, griffin
        # numbered after all the target's layers (not one pipeline stage's, which would collide with the target's)
        first = vllm_config.model_config.get_total_num_hidden_layers()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d, prefix=maybe_prefix(prefix, "embed_tokens"))
        qkv_bias = bool(getattr(config, "specdec_qkv_bias", False))
        if griffin:
            self.fc = TokenGuidedFusion(config, maybe_prefix(prefix, "fc"))
        else:
            self.fc = ReplicatedLinear(
                2 * d,
                d,
                bias=bool(getattr(config, "specdec_fc_bias", True)),
                prefix=maybe_prefix(prefix, "fc"),
                return_bias=False,
            )
        self.layers = nn.ModuleList(
            DraftLayer(vllm_config, config, i, griffin, qkv_bias, maybe_prefix(prefix, f"layers.{first + i}"))
            for i in range(config.num_hidden_layers)
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)
        if self.griffin:
            hidden = self.fc(embeds, hidden_states)
        else:
            hidden = self.fc(torch.cat((embeds, hidden_states), dim=-1))
        for layer in self.layers:
            hidden = layer(positions, hidden)
        if self.griffin:
            return hidden[..., : self.hidden_size], hidden[..., self.hidden_size :]
        return hidden, hidden


class _SpecdecDraftForCausalLM(EagleLlamaForCausalLM):
    """vLLM's EAGLE model interface (shared embeddings / LM head, ``compute_logits``) over the kit's draft."""

    griffin = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        self.config = config
        self.model = DraftModel(vllm_config, config, self.griffin, maybe_prefix(prefix, "model"))
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))
        self.trace = DraftTrace.from_env()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs_embeds is not None:
            raise NotImplementedError(f"{type(self).__name__} takes token ids, not input embeddings")
        for_logits, next_hidden = self.model(input_ids, positions, hidden_states)
        if self.trace:
            self.trace.remember(input_ids, positions, for_logits)
        return for_logits, next_hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if self.trace and logits is not None:
            self.trace.record(hidden_states, logits)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the kit's export strictly: every tensor in the checkpoint must land in a parameter and every
        parameter but the shared LM head (and the embedding, when absent) must be loaded."""
        params = dict(self.named_parameters())
        loaded, unexpected = set(), []
        for name, tensor in weights:
            target, shard = parameter_for(name)
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(target)
            if name.startswith("embed_tokens."):
                self.has_own_embed_tokens = True
        missing = sorted(set(params) - loaded - OPTIONAL)
        if unexpected or missing:
            raise ValueError(
                f"{type(self).__name__}: the draft checkpoint does not match the architecture; "
                f"unexpected tensors {unexpected}, missing parameters {missing}"
            )
        return loaded


class SpecdecEagleForCausalLM(_SpecdecDraftForCausalLM):
    """EAGLE-1/EAGLE-2/HASS: fc over [emb; F] (with its bias when the head has one), Llama layers."""


class SpecdecGriffinForCausalLM(_SpecdecDraftForCausalLM):
    """GRIFFIN: TGF before the decoder layer, TEH after it."""

    griffin = True
