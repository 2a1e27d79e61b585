"""The single Llama decoder layer that EAGLE/HASS and GRIFFIN drafts share, and the step they share.

Layer 0 has no ``input_layernorm`` (the fused input goes straight into attention), exactly as in the
reference ``cnets`` modules; ``widened=True`` gives GRIFFIN's TEH, whose ``down_proj`` is [2d, I] and
whose residual is duplicated so that the output carries two features side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from specdec_kit.runtime.core.contract import AttentionWindow, LayerCache
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.models.attention import cached_attention


class DraftAttention(nn.Module):
    """Llama attention projections; ``in_features`` is wider than d where the input is a concatenation (EAGLE-3)."""

    def __init__(self, config: LlamaConfig, qkv_bias: bool, in_features: int | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        d = config.hidden_size
        width = in_features or d
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)


class DraftMLP(nn.Module):
    def __init__(self, config: LlamaConfig, out_features: int):
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, out_features, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, index: int, qkv_bias: bool = False, widened: bool = False):
        super().__init__()
        self.index = index
        self.widened = widened
        if index != 0:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, qkv_bias)
        out = config.hidden_size * (2 if widened else 1)
        self.mlp = DraftMLP(config, out)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, cos, sin, window: AttentionWindow) -> torch.Tensor:
        residual = hidden
        if self.index != 0:
            hidden = self.input_layernorm(hidden)
        attn = self.self_attn
        hidden = residual + cached_attention(
            attn, hidden, cos, sin, window, self.index, attn.num_heads, attn.num_kv_heads, attn.head_dim
        )
        residual = torch.cat((hidden, hidden), dim=-1) if self.widened else hidden
        return residual + self.mlp(self.post_attention_layernorm(hidden))


class DraftVocab:
    """A reduced draft vocabulary: the draft proposes only some target tokens. Stored as EAGLE-3 stores its own:
    ``d2t`` (draft id i is target id i + d2t[i]) and ``t2d`` (which target ids are in it)."""

    def _init_draft_vocab(self, config: LlamaConfig, draft_vocab_size: int | None) -> None:
        """The vocabulary maps of a draft of ``draft_vocab_size`` tokens (none where that is the whole vocabulary)."""
        if draft_vocab_size is not None and draft_vocab_size < config.vocab_size:
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def draft_vocab_size(self) -> int:
        d2t = getattr(self, "d2t", None)
        return self.config.vocab_size if d2t is None else d2t.shape[0]

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids (the identity without a reduced vocabulary)."""
        d2t = getattr(self, "d2t", None)
        return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


class FeatureDraft(DraftVocab, nn.Module):
    """Common body of feature-level drafts (EAGLE/HASS, GRIFFIN): fuse, run the layers, split.

    Subclasses define ``fuse(features, embeds)`` and ``split(hidden) -> (prediction, regression)``:
    the prediction feature goes through the target's LM head, the regression feature is the next
    draft step's feature input (the same tensor for EAGLE). With a reduced vocabulary (``DraftVocab``) the target's
    LM-head rows of that vocabulary score it (``TargetRowsHead``).
    """

    config: LlamaConfig
    layers: nn.ModuleList
    embed_tokens: nn.Embedding

    def _init_rotary(self, config: LlamaConfig) -> None:
        # Non-persistent buffers only: not part of the checkpoint's keys.
        self.rotary_emb = LlamaRotaryEmbedding(config=config)

    @property
    def attention_shape(self) -> tuple[int, int, int]:
        attn = self.layers[0].self_attn
        return len(self.layers), attn.num_kv_heads, attn.head_dim

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        layers, heads, dim = self.attention_shape
        weight = self.embed_tokens.weight
        return KVCache.allocate(layers, batch, heads, dim, capacity, weight.dtype, weight.device)

    def fuse(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @torch.inference_mode()
    def step(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached decoding step -> (prediction, regression) features; see ``cached_step``."""
        return self.cached_step(features, tokens, positions, pending_mask, cache)

    def cached_step(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached step outside ``inference_mode`` (what the ONNX export traces; training runs its own
        full-sequence forward) -> (prediction, regression) features.

        features [B, Q, d] paired with the tokens [B, Q] that follow them; ``pending_mask`` [B, Q, P] picks the
        visible pending slots, the new tokens' own being the last Q (see ``runtime/core/contract.py``)."""
        window = cache.window(pending_mask)
        hidden = self.fuse(features, self.embed_tokens(tokens).to(features.dtype))
        cos, sin = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, window)
        return self.split(hidden)


class OnTargetVocab(nn.Module):
    """Logits over a draft vocabulary placed on the target's: draft id i at target id ``i + d2t[i]``, every other
    target id at -inf, so trees, verification and sampling run unchanged and never propose a token outside the draft
    vocabulary (vLLM maps EAGLE-3's the same way)."""

    def __init__(self, draft: DraftVocab):
        super().__init__()
        self.vocab_size = draft.config.vocab_size
        self.register_buffer(
            "ids", draft.target_ids(torch.arange(draft.draft_vocab_size, device=draft.d2t.device)), persistent=False
        )

    def place(self, logits: torch.Tensor) -> torch.Tensor:
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.scatter(-1, self.ids.expand(logits.shape), logits)

    def own(self, prediction: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary alone (index i is target id ``ids[i]``): what ranks a tree's children
        without a pass over the target's whole vocabulary (on SmolLM2, 8,192 of 49,152 ids)."""
        raise NotImplementedError

    def forward(self, prediction: torch.Tensor) -> torch.Tensor:
        return self.place(self.own(prediction))


class DraftVocabHead(OnTargetVocab):
    """A draft's logits from its own LM head over its draft vocabulary (``draft.logits``: EAGLE-3's, P-EAGLE's, a
    reduced-vocabulary DFlash's) placed on the target's vocabulary."""

    def __init__(self, draft: DraftVocab):
        super().__init__(draft)
        self.draft = draft

    def own(self, prediction: torch.Tensor) -> torch.Tensor:
        return self.draft.logits(prediction)


class TargetRowsHead(OnTargetVocab):
    """An EAGLE/HASS/GRIFFIN draft with a reduced vocabulary: the target's LM head over that vocabulary's rows only
    (a draft step computes draft-vocabulary x d products instead of the target's vocabulary x d), placed on the
    target's vocabulary."""

    def __init__(self, lm_head: nn.Linear, draft: FeatureDraft):
        super().__init__(draft)
        if lm_head.bias is not None:
            raise ValueError("a reduced draft vocabulary reads the target's LM head rows; this head has a bias")
        self.register_buffer("rows", lm_head.weight.detach()[self.ids].clone(), persistent=False)
        self.target_rows = lm_head.weight.detach()  # every row (not a buffer: the graphs take joined rows as inputs)

    def own(self, prediction: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(prediction, self.rows.to(prediction.dtype))

    def own_with(self, prediction: torch.Tensor, vocab: PromptVocab) -> torch.Tensor:
        """Logits over the draft vocabulary, then over each row's joined tokens (``PromptVocab``; a padding slot at
        -inf): prediction [B, ..., d] -> [B, ..., V' + E]."""
        extra = torch.einsum("b...d,bed->b...e", prediction, vocab.rows.to(prediction.dtype))
        valid = (vocab.ids >= 0).view(vocab.ids.shape[0], *([1] * (prediction.dim() - 2)), -1)
        return torch.cat([self.own(prediction), extra.masked_fill(~valid, float("-inf"))], dim=-1)

    def ids_with(self, vocab: PromptVocab) -> torch.Tensor:
        """Each row's target id of every index of ``own_with``'s logits [B, V' + E] (padding slots as id 0: their
        logits are -inf, so they are never chosen)."""
        return torch.cat([self.ids.expand(vocab.ids.shape[0], -1), vocab.ids.clamp(min=0)], dim=1)

    def place_with(self, logits: torch.Tensor, vocab: PromptVocab) -> torch.Tensor:
        """``own_with``'s logits placed on the target's vocabulary, every other id at -inf."""
        full = logits.new_full((*logits.shape[:-1], self.vocab_size + 1), float("-inf"))
        spare = torch.where(vocab.ids >= 0, vocab.ids, self.vocab_size)  # padding slots land past the end
        where = torch.cat([self.ids.expand(vocab.ids.shape[0], -1), spare], dim=1)
        where = where.view(where.shape[0], *([1] * (logits.dim() - 2)), -1).expand(logits.shape)
        return full.scatter(-1, where, logits)[..., : self.vocab_size]


@dataclass
class PromptVocab:
    """Tokens that join a reduced draft vocabulary for some requests: per row, the target ids [B, E] (-1: padding)
    and their LM head rows [B, E, d]. A request's prompt holds the names, numbers and words its answer copies, many of
    them outside a vocabulary of the training answers' most frequent tokens, which the draft could never propose."""

    ids: torch.Tensor
    rows: torch.Tensor
