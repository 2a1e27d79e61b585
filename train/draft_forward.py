"""Training-time forward of one-layer feature drafts (EAGLE/HASS, GRIFFIN) over whole sequences,
with the multi-pass alignment of HASS and GRIFFIN.

Pass 1 is plain EAGLE training: position i fuses the target feature F_i with the embedding of
x_{i+1} and attends causally. In pass j >= 2, position i's feature input is the draft's own output of
pass j-1 at position i-1 (detached), as at the j-th draft step of decoding; its attention sees the
pass-1 keys/values of positions <= i-j+1 (target features) and the pass-m keys/values of position
i-j+m for m = 2..j (its own chain of earlier predictions) — HASS's harmonized context alignment,
with masked slots excluded properly rather than multiplied by zero. Tokens stay ground truth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_kit.runtime.drafts.layers import FeatureDraft
from specdec_kit.runtime.models.attention import apply_rope


def alignment_mask(seq_len: int, pass_index: int, device) -> torch.Tensor:
    """[T, j*T] bool: which (pass m, position p) keys position i sees in pass j (1-based)."""
    i = torch.arange(seq_len, device=device)[:, None]
    p = torch.arange(seq_len, device=device)[None, :]
    blocks = [p <= i - pass_index + 1]
    for m in range(2, pass_index + 1):
        blocks.append(p == i - pass_index + m)
    return torch.cat(blocks, dim=1)


class PassRunner:
    """Runs passes 1..n of a draft over a batch, keeping each pass's fused inputs for the keys/values."""

    def __init__(self, draft: FeatureDraft, tokens_next: torch.Tensor, valid: torch.Tensor):
        if len(draft.layers) != 1:
            raise ValueError("training supports one-layer drafts (the EAGLE/HASS/GRIFFIN format)")
        self.draft = draft
        self.embeds = draft.embed_tokens(tokens_next).detach()
        self.valid = valid  # [B, T] positions that exist (not padding)
        bsz, seq = tokens_next.shape
        positions = torch.arange(seq, device=tokens_next.device).expand(bsz, seq)
        self.cos, self.sin = draft.rotary_emb(self.embeds, positions)
        self.fused: list[torch.Tensor] = []

    def run(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One more pass with ``features`` [B, T, d] as feature inputs; returns (prediction, regression)."""
        draft, layer = self.draft, self.draft.layers[0]
        attn = layer.self_attn
        h = draft.fuse(features, self.embeds.to(features.dtype))
        self.fused.append(h)
        j = len(self.fused)
        bsz, seq, _ = h.shape
        q = attn.q_proj(h).view(bsz, seq, attn.num_heads, attn.head_dim).transpose(1, 2)
        q = apply_rope(q, self.cos, self.sin)
        keys, values = [], []
        for hm in self.fused:
            k = attn.k_proj(hm).view(bsz, seq, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(hm).view(bsz, seq, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            keys.append(apply_rope(k, self.cos, self.sin))
            values.append(v)
        k_all, v_all = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        # every position sees itself (the last block's diagonal), so no row is empty
        mask = alignment_mask(seq, j, h.device)[None, None] & self.valid.repeat(1, j)[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, enable_gqa=attn.num_heads != attn.num_kv_heads
        )
        out = attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
        hidden = h + out
        residual = torch.cat((hidden, hidden), dim=-1) if layer.widened else hidden
        hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return draft.split(hidden)


def next_pass_features(first: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Feature inputs of the next pass: position 0 keeps the target's, position i takes output[i-1]."""
    return torch.cat([first[:, :1], output[:, :-1].detach()], dim=1)
