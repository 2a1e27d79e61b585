"""DFlash draft (block diffusion drafting; the official ``DFlashDraftModel``, which vLLM loads as
``DFlashQwen3ForCausalLM`` and SGLang as its DFLASH draft).

The draft never sees tokens one at a time. The target's hidden states at the layers ``target_layer_ids`` (each
layer's *output*: the kit's tapped layer ``id + 1``) are concatenated and fused by ``fc`` into one context state per
committed position, normed by ``hidden_norm``. Every draft layer projects those states straight into its keys and
values (``k_proj``/``v_proj``, ``k_norm`` on the keys, rotary at the context's positions): the draft's cache holds
them, one slot per committed position, and nothing else. A cycle's query block is the verified root token followed
by ``block_size - 1`` copies of ``mask_token_id`` at the next positions, embedded by the *target's* embedding; the
draft's Qwen3 layers (per-head ``q_norm``/``k_norm``) let every block slot attend to the whole context and to every
slot of the block (no causal mask inside it), and slot k's output, through the final ``norm`` and the *target's*
LM head, is the draft's distribution of the token at the root's position + k. One forward proposes the block.

Keys (per layer i): ``layers.i.self_attn.{q,k,v,o}_proj.weight`` (and ``.bias`` with ``attention_bias``),
``layers.i.self_attn.{q,k}_norm.weight``, ``layers.i.mlp.{gate,up,down}_proj.weight``,
``layers.i.{input_layernorm,post_attention_layernorm}.weight``; then ``fc.weight`` [d, n x d_target],
``hidden_norm.weight``, ``norm.weight``. No embedding and no LM head: both are the target's. A head over a reduced
draft vocabulary (``draft_vocab_size`` in its config, as speculators trains DFlash by default) scores the block with an
LM head of its own, ``lm_head.weight`` [draft_V, d], whose draft id i is target id ``i + d2t[i]`` (``d2t``
[draft_V] int64; ``t2d`` [V] bool marks those target ids), as EAGLE-3's and vLLM's ``DFlashQwen3ForCausalLM``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from specdec_kit.runtime.core.contract import AttentionWindow
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.drafts.layers import DraftMLP, DraftVocab, DraftVocabHead
from specdec_kit.runtime.models.attention import apply_rope


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The official choice: the middle layer for a one-layer draft, else ``num_draft_layers`` layers spread evenly
    from layer 1 to layer L - 3 (outputs of the target's decoder layers, 0-based)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = (end - start) / (num_draft_layers - 1)
    return [int(start + i * span) for i in range(num_draft_layers)]


def dflash_feature_layers(num_target_layers: int, count: int = 3) -> tuple[int, ...]:
    """The kit's default tapped layers (entering decoder layers) for a draft of a target ``num_target_layers`` deep:
    ``count`` layers spread as the official choice spreads them, fewer where the target is too shallow."""
    if num_target_layers < 2:
        raise ValueError(f"a DFlash draft taps layers 1..L-1 of its target; this target has {num_target_layers}")
    if num_target_layers < count + 4:
        return tuple(range(1, num_target_layers))[:count]
    return tuple(i + 1 for i in default_target_layer_ids(num_target_layers, count))


class DFlashAttention(nn.Module):
    """Qwen3 attention projections with per-head RMS norms of the queries and keys."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        d, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[B, Q, heads x D] -> [B, heads, Q, D]."""
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def keys_values(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated, normed keys and the values [B, H_kv, Q, D] of ``states`` [B, Q, d] (normed already)."""
        keys = apply_rope(self.k_norm(self._heads(self.k_proj(states), self.num_kv_heads)), cos, sin)
        return keys, self._heads(self.v_proj(states), self.num_kv_heads)

    def queries(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(self.q_norm(self._heads(self.q_proj(states), self.num_heads)), cos, sin)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config, config.hidden_size)

    def forward(self, hidden, cos, sin, window: AttentionWindow, layer: int) -> torch.Tensor:
        """The block's slots [B, Q, d]: attention through ``window`` (context slots and the block itself), MLP."""
        attn = self.self_attn
        normed = self.input_layernorm(hidden)
        keys, values = attn.keys_values(normed, cos, sin)
        out = window.attend(layer, attn.queries(normed, cos, sin), keys, values)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraft(DraftVocab, nn.Module):
    """See the module docstring. ``feature_layers`` are the kit's tapped layers (``target_layer_ids`` + 1: the
    hidden states entering those decoder layers); ``block_size`` is the root slot plus the masked slots;
    ``draft_vocab_size`` below the target's vocabulary gives the draft an LM head of its own over that many tokens."""

    def __init__(
        self,
        config: Qwen3Config,
        target_hidden_size: int,
        feature_layers: tuple[int, ...],
        mask_token_id: int,
        block_size: int,
        draft_vocab_size: int | None = None,
    ):
        super().__init__()
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the vocabulary 0..{config.vocab_size - 1}")
        if block_size < 2:
            raise ValueError(f"a DFlash block holds the root and at least one masked slot: block_size {block_size}")
        self.config = config
        self.target_hidden_size = target_hidden_size
        self.feature_layers = tuple(feature_layers)
        self.mask_token_id, self.block_size = int(mask_token_id), int(block_size)
        d = config.hidden_size
        self.hidden_size = d
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.feature_layers) * target_hidden_size, d, bias=False)
        self.hidden_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)  # non-persistent buffers: no checkpoint keys
        self.num_target_layers: int | None = None  # the target's depth where known (the official config records it)
        self._init_draft_vocab(config, draft_vocab_size)
        if self.has_own_head:
            self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over its own draft vocabulary (index i is target token ``i + d2t[i]``); a reduced head's only."""
        return self.lm_head(hidden)

    @property
    def has_own_head(self) -> bool:
        """Whether the draft scores with an LM head of its own (a reduced vocabulary), not the target's."""
        return getattr(self, "d2t", None) is not None

    @property
    def target_layer_ids(self) -> list[int]:
        """The layers as the official config names them (decoder layer outputs)."""
        return [layer - 1 for layer in self.feature_layers]

    @property
    def parallel_tokens(self) -> int:
        """Tokens one forward proposes: the block's masked slots."""
        return self.block_size - 1

    @property
    def attention_shape(self) -> tuple[int, int, int]:
        attn = self.layers[0].self_attn
        return len(self.layers), attn.num_kv_heads, attn.head_dim

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        layers, heads, dim = self.attention_shape
        weight = self.fc.weight
        return KVCache.allocate(layers, batch, heads, dim, capacity, weight.dtype, weight.device)

    def context_states(self, features: torch.Tensor) -> torch.Tensor:
        """The target's tapped layers [B, W, n x d_target] -> the normed context states [B, W, d]."""
        return self.hidden_norm(self.fc(features))

    def context_keys_values(self, features: torch.Tensor, positions: torch.Tensor):
        """Every layer's keys and values of the context [L, B, H_kv, W, D] (what the draft's cache holds)."""
        states = self.context_states(features)
        cos, sin = self.rotary_emb(states, positions)
        pairs = [layer.self_attn.keys_values(states, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])

    def block(self, embeds: torch.Tensor, positions: torch.Tensor, window: AttentionWindow) -> torch.Tensor:
        """The query block's embeddings [B, Q, d] at ``positions`` -> its normed outputs [B, Q, d]; attention reads
        the context and the block's own slots through ``window``."""
        cos, sin = self.rotary_emb(embeds, positions)
        hidden = embeds
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, window, i)
        return self.norm(hidden)


def dflash_scoring_head(draft: DFlashDraft, target_lm_head: nn.Module) -> nn.Module:
    """What turns the block's outputs into logits over the target's vocabulary: the draft's own head where it has
    a reduced vocabulary, else the target's LM head."""
    return DraftVocabHead(draft) if draft.has_own_head else target_lm_head
