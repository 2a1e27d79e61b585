"""Llama-family attention over a cache window with tree masks; shared by the target and the drafts.

The projection modules are the checkpoint's own ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (so
Qwen2's q/k/v biases come for free); only the cache handling and the mask are the runtime's.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec_kit.runtime.core.contract import AttentionWindow


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, Q, D]; cos/sin [B, Q, D] as returned by transformers' rotary embedding modules."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def cached_attention(
    attn: nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    window: AttentionWindow,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """One attention block: project, rotate, let the window store the new K/V of ``layer`` and attend (the
    runtime's cache and an export's graph inputs attend differently), project out."""
    bsz, q_len, _ = hidden.shape
    q = attn.q_proj(hidden).view(bsz, q_len, num_heads, head_dim).transpose(1, 2)
    k = attn.k_proj(hidden).view(bsz, q_len, num_kv_heads, head_dim).transpose(1, 2)
    v = attn.v_proj(hidden).view(bsz, q_len, num_kv_heads, head_dim).transpose(1, 2)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    out = window.attend(layer, q, k, v)
    out = out.transpose(1, 2).reshape(bsz, q_len, num_heads * head_dim)
    return attn.o_proj(out)
