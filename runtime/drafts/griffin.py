"""GRIFFIN token-alignable draft: TGF before the decoder layer, TEH after it (reference ``cnets_griffin_1``).

TGF (``fc``): h = fc.fc([emb; F]); out = h + down(SiLU(up([norm(post_ln(h)); norm(emb)]))) where one
RMSNorm (``fc.mlp.input_layernorm``) normalises both halves and up/down go through the target's
intermediate size. TEH: the decoder layer's ``down_proj`` is [2d, I] and its residual is duplicated;
output[..., :d] is the prediction feature (to the LM head), output[..., d:] the regression feature
(the next draft step's feature input).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specdec_kit.runtime.drafts.layers import DraftDecoderLayer, FeatureDraft


class TokenGuidedFusionMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.input_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.up_proj = nn.Linear(2 * d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        fused = torch.cat((self.input_layernorm(x), self.input_layernorm(embeds)), dim=-1)
        return self.down_proj(self.act_fn(self.up_proj(fused)))


class TokenGuidedFusion(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d)  # the reference always has this bias
        self.mlp = TokenGuidedFusionMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.cat((embeds, features), dim=-1))
        return h + self.mlp(self.post_attention_layernorm(h), embeds)


class GriffinDraft(FeatureDraft):
    def __init__(self, config: LlamaConfig, qkv_bias: bool = False, draft_vocab_size: int | None = None):
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(
                f"GRIFFIN drafts have one decoder layer; config says num_hidden_layers={config.num_hidden_layers}"
            )
        self.config = config
        self.hidden_size = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = TokenGuidedFusion(config)
        self.layers = nn.ModuleList([DraftDecoderLayer(config, 0, qkv_bias=qkv_bias, widened=True)])
        self._init_rotary(config)
        self._init_draft_vocab(config, draft_vocab_size)

    def fuse(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return self.fc(features, embeds)

    def split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.hidden_size
        return hidden[..., :d], hidden[..., d:]
