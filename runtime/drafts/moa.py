"""Mixture of Attentions draft (Zimmer et al., "Mixture of Attentions for Speculative Decoding"): LSA over the target's KV cache, SA over tokens,
CA from tokens to LSA memory, and Target Layer Inference.

* **LSA** (``LayerSelfAttention``): for each verified position, self-attention across the target's L
  layers of ``[k; v]`` (bidirectional), then the mean over layers: one memory vector per position,
  computed once per draft cycle for the newly verified positions.
* **SA** (``sa``): a causal self-attention block over the token embeddings (its own KV cache), so each
  query knows the tokens drafted before it.
* **CA** (``ca``): queries from SA, keys/values projected from the LSA memory of positions up to the last
  verified one; unmasked over that memory at inference, K-step bounded in training.
* **TLI = N**: the output ``o_hat`` is the predicted input of target layer L-N; the target's last N
  layers (frozen, over its own KV cache plus draft-time entries) finish it. With N = 0 the output is the
  predicted post-norm feature that goes straight to the LM head.

Keys: ``embed_tokens``, ``lsa.*``, ``sa.*``, ``ca.*``, ``norm``; config ``moa_tli``, ``moa_lsa_heads``
and the target's ``target_num_layers`` / ``target_kv_dim`` (2 x kv_heads x head_dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from specdec_kit.runtime.core.contract import AttentionWindow
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.drafts.layers import DraftAttention, DraftMLP
from specdec_kit.runtime.models.attention import apply_rope, cached_attention


class LayerSelfAttention(nn.Module):
    """[N, L, kv_dim] (one position's K/V at every target layer) -> [N, d]."""

    def __init__(self, num_layers: int, kv_dim: int, hidden: int, heads: int, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.in_proj = nn.Linear(kv_dim, hidden)
        self.layer_embed = nn.Parameter(torch.zeros(num_layers, hidden))  # which layer a vector came from
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, kv: torch.Tensor) -> torch.Tensor:
        n, layers, _ = kv.shape
        x = self.in_proj(kv) + self.layer_embed[None]
        q, k, v = self.qkv(self.norm(x)).view(n, layers, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)  # bidirectional over the layer axis
        x = x + self.o_proj(attn.transpose(1, 2).reshape(n, layers, -1))
        return x.mean(dim=1)


class TokenSelfAttention(nn.Module):
    """Causal self-attention block over token embeddings (pre-norm, RoPE, SwiGLU)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, qkv_bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config, d)

    def forward(self, hidden, cos, sin, window: AttentionWindow) -> torch.Tensor:
        a = self.self_attn
        hidden = hidden + cached_attention(
            a, self.input_layernorm(hidden), cos, sin, window, 0, a.num_heads, a.num_kv_heads, a.head_dim
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class CrossAttention(nn.Module):
    """Queries from the token stream, keys/values from LSA memory (RoPE at both positions)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d = config.hidden_size
        self.query_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.memory_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.attn = DraftAttention(config, qkv_bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config, d)

    def memory_kv(self, memory: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, d] LSA outputs -> keys/values [B, H, T, D] (what the memory cache stores)."""
        a = self.attn
        b, t, _ = memory.shape
        m = self.memory_layernorm(memory)
        k = a.k_proj(m).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(m).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, hidden, cos, sin, keys, values, mask) -> torch.Tensor:
        a = self.attn
        b, q_len, _ = hidden.shape
        q = a.q_proj(self.query_layernorm(hidden)).view(b, q_len, a.num_heads, a.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=a.num_heads != a.num_kv_heads)
        hidden = hidden + a.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MoADraft(nn.Module):
    def __init__(
        self, config: LlamaConfig, target_num_layers: int, target_kv_dim: int, tli: int = 0, lsa_heads: int = 4
    ):
        super().__init__()
        if not 0 <= tli <= target_num_layers:
            raise ValueError(f"moa_tli must be in [0, {target_num_layers}], got {tli}")
        self.config, self.tli = config, tli
        self.target_num_layers, self.target_kv_dim = target_num_layers, target_kv_dim
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.lsa = LayerSelfAttention(target_num_layers, target_kv_dim, d, lsa_heads, config.rms_norm_eps)
        self.sa = TokenSelfAttention(config)
        self.ca = CrossAttention(config)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)

    @property
    def attention_shape(self) -> tuple[int, int, int]:
        a = self.sa.self_attn
        return 1, a.num_kv_heads, a.head_dim

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A one-layer cache: the token SA's keys/values, or (a second one) the CA's memory keys/values."""
        _, heads, dim = self.attention_shape
        w = self.embed_tokens.weight
        return KVCache.allocate(1, batch, heads, dim, capacity, w.dtype, w.device)

    def lsa_memory(self, target_kv: torch.Tensor) -> torch.Tensor:
        """[B, T, L, kv_dim] target K/V per position and layer -> LSA memory [B, T, d]."""
        b, t = target_kv.shape[:2]
        return self.lsa(target_kv.reshape(b * t, *target_kv.shape[2:])).view(b, t, -1)

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The predicted activation: the post-norm feature (TLI = 0, straight to the LM head) or the
        residual-stream input of target layer L - TLI (no norm: it has the residual stream's scale)."""
        return self.norm(hidden) if self.tli == 0 else hidden
