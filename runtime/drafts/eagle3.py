"""EAGLE-3 draft (reference ``eagle/model/cnets.py::Model`` on SafeAILab/EAGLE ``main``).

Inputs: the target's hidden states entering three of its decoder layers (by default {2, L//2, L-3}),
concatenated (3 x d_target) and fused by ``fc`` (no bias) into d; on later draft steps the draft's own output
(already d wide) is fed back and ``fc`` is skipped, as the reference does when the width is d. One decoder layer
(``midlayer``) attends over ``cat(input_layernorm(emb), hidden_norm(h))`` (q/k/v take 2d) with ``h`` as the
residual; its output goes through ``norm`` and the draft's own ``lm_head`` over a reduced draft vocabulary, whose
ids map to the target's as ``id + d2t[id]`` (``t2d`` marks the target ids the draft can propose).

Keys (16 tensors): ``d2t`` [draft_V] int64, ``t2d`` [V] bool, ``embed_tokens.weight``, ``lm_head.weight``,
``norm.weight``, ``fc.weight`` [d, 3 d_target], ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specdec_kit.runtime.core.contract import AttentionWindow, LayerCache
from specdec_kit.runtime.drafts.layers import DraftAttention, DraftMLP, FeatureDraft
from specdec_kit.runtime.models.attention import cached_attention


def default_feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The reference's layers: the hidden states entering decoder layers 2, L//2 and L-3 (distinct for L >= 7)."""
    layers = (2, num_target_layers // 2, num_target_layers - 3)
    if len(set(layers)) != 3 or min(layers) < 0:
        raise ValueError(
            f"EAGLE-3 reads the hidden states entering layers {layers} of the target; a target with "
            f"{num_target_layers} layers gives no three distinct ones (it needs at least 7)"
        )
    return layers


class Eagle3DecoderLayer(nn.Module):
    """The reference's ``LlamaDecoderLayeremb``: attention over the normed embedding and feature side by side."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d = config.hidden_size
        self.hidden_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, qkv_bias=False, in_features=2 * d)
        self.mlp = DraftMLP(config, d)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, embeds, hidden, cos, sin, window: AttentionWindow) -> torch.Tensor:
        attn = self.self_attn
        joined = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        hidden = hidden + cached_attention(
            attn, joined, cos, sin, window, 0, attn.num_heads, attn.num_kv_heads, attn.head_dim
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(FeatureDraft):
    def __init__(
        self, config: LlamaConfig, target_hidden_size: int, draft_vocab_size: int, feature_layers: tuple[int, int, int]
    ):
        super().__init__()
        self.config = config
        self.feature_layers = tuple(feature_layers)  # the target layers whose entering hidden states fc fuses
        self.target_hidden_size = target_hidden_size
        d = config.hidden_size
        self.hidden_size = d
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.fc = nn.Linear(len(self.feature_layers) * target_hidden_size, d, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # persistent, as the reference
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self._init_rotary(config)

    @property
    def attention_shape(self) -> tuple[int, int, int]:
        attn = self.midlayer.self_attn
        return 1, attn.num_kv_heads, attn.head_dim

    def cached_step(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``FeatureDraft.cached_step``; ``features`` are the target's three layers (3 x d_target wide) or the
        draft's own output (d wide). Returns (output, output): the draft's logits come from ``logits(output)``."""
        window = cache.window(pending_mask)
        hidden = features if features.shape[-1] == self.hidden_size else self.fc(features)
        embeds = self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        out = self.midlayer(embeds, hidden, cos, sin, window)
        return out, out

    def logits(self, prediction: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (index i is target token ``i + d2t[i]``)."""
        return self.lm_head(self.norm(prediction))
