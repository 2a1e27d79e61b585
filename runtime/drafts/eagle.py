"""EAGLE-1/EAGLE-2/HASS draft (one checkpoint format; reference ``cnets.py`` / ``cnets1.py``).

Keys: ``embed_tokens.weight``, ``fc.weight`` (+ ``fc.bias`` unless config ``bias`` is false),
``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ q/k/v biases with ``qkv_bias``),
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight`` and, for
i > 0, ``layers.{i}.input_layernorm.weight``. No LM head and no final norm: the target's head is used.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from specdec_kit.runtime.drafts.layers import DraftDecoderLayer, FeatureDraft


class EagleDraft(FeatureDraft):
    def __init__(
        self, config: LlamaConfig, fc_bias: bool = True, qkv_bias: bool = False, draft_vocab_size: int | None = None
    ):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.fc = nn.Linear(2 * d, d, bias=fc_bias)
        self.layers = nn.ModuleList(
            DraftDecoderLayer(config, i, qkv_bias=qkv_bias) for i in range(config.num_hidden_layers)
        )
        self._init_rotary(config)
        self._init_draft_vocab(config, draft_vocab_size)

    def fuse(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((embeds, features), dim=-1))

    def split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, hidden
