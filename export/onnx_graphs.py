"""The ONNX graphs of an engine: the target's tree-verification step and each draft's step.

The runtime's modules run unchanged inside the exported graphs: ``GraphCache`` stands in for the
``KVCache`` they normally write into, taking the past keys/values and the attention mask as graph
inputs and handing the new tokens' keys/values back as outputs. Every graph therefore has the same
cache contract (past in, present out, explicit boolean mask over past + new keys), which is what the
ONNX Runtime backend (``runtime/ort_backend.py``) feeds from the runtime's own ``KVCache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec_kit.runtime.drafts.layers import FeatureDraft
from specdec_kit.runtime.drafts.medusa import MedusaHeads
from specdec_kit.runtime.target import TargetModel

OPSET = 18


class GraphCache:
    """Duck-typed ``KVCache`` for export: past from inputs, present collected as outputs."""

    def __init__(self, past_keys: torch.Tensor, past_values: torch.Tensor, mask: torch.Tensor):
        self.past_keys, self.past_values = past_keys, past_values  # [L, B, H, P, D]
        self.mask = mask[:, None]  # [B, 1, Q, P + Q]
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def key_length(self, num_pending: int) -> int:
        return -1  # unused: the concatenation below fixes the key length

    def ensure_capacity(self, needed: int) -> None:
        pass

    def slots(self, num_new: int, offset: int = 0) -> None:
        return None

    def attention_mask(self, pending_mask: torch.Tensor, k_len: int) -> torch.Tensor:
        return self.mask

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, slots) -> None:
        self.new_keys.append(k_new)
        self.new_values.append(v_new)

    def view(self, layer: int, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat([self.past_keys[layer], self.new_keys[layer]], dim=2)
        values = torch.cat([self.past_values[layer], self.new_values[layer]], dim=2)
        return keys, values

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.new_keys), torch.stack(self.new_values)


class TargetStepGraph(nn.Module):
    """(ids, positions, mask, logits_index, past K/V) -> (logits, features, present K/V)."""

    def __init__(self, target: TargetModel):
        super().__init__()
        self.target = target

    def forward(self, input_ids, position_ids, attention_mask, logits_index, past_keys, past_values):
        cache = GraphCache(past_keys, past_values, attention_mask)
        out = TargetModel.forward.__wrapped__(self.target, input_ids, position_ids, attention_mask, cache, logits_index)
        present_keys, present_values = cache.present()
        return out.logits, out.features, present_keys, present_values


class FeatureDraftStepGraph(nn.Module):
    """(ids, features, positions, mask, logits_index, past K/V) -> (logits, regression feature, present K/V).

    The target's LM head is part of the graph so a draft step is one session call; ``logits_index``
    keeps it to the positions that need logits (one per row when the context is long)."""

    def __init__(self, draft: FeatureDraft, lm_head: nn.Linear):
        super().__init__()
        self.draft, self.lm_head = draft, lm_head

    def forward(self, input_ids, hidden_states, position_ids, attention_mask, logits_index, past_keys, past_values):
        cache = GraphCache(past_keys, past_values, attention_mask)
        pred, reg = FeatureDraft.step.__wrapped__(self.draft, hidden_states, input_ids, position_ids, attention_mask, cache)
        selected = torch.gather(pred, 1, logits_index[..., None].expand(-1, -1, pred.shape[-1]))
        present_keys, present_values = cache.present()
        return self.lm_head(selected), reg, present_keys, present_values


class MedusaHeadsGraph(nn.Module):
    def __init__(self, heads: MedusaHeads):
        super().__init__()
        self.heads = heads

    def forward(self, hidden_states):
        return self.heads(hidden_states)


@dataclass
class GraphSpec:
    """What one exported graph is: its file, its I/O names, and which axes are dynamic."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


TARGET_SPEC = GraphSpec(
    "target_step",
    ("input_ids", "position_ids", "attention_mask", "logits_index", "past_keys", "past_values"),
    ("logits", "features", "present_keys", "present_values"),
)
DRAFT_SPEC = GraphSpec(
    "draft_step",
    ("input_ids", "hidden_states", "position_ids", "attention_mask", "logits_index", "past_keys", "past_values"),
    ("logits", "hidden_states_out", "present_keys", "present_values"),
)
MEDUSA_SPEC = GraphSpec("medusa_heads", ("hidden_states",), ("logits",))


def _cached_example(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, batch=2, q=3, past=5):
    ids = torch.zeros(batch, q, dtype=torch.long, device=device)
    pos = torch.arange(past, past + q, device=device).expand(batch, q).contiguous()
    mask = torch.ones(batch, q, past + q, dtype=torch.bool, device=device)
    index = torch.arange(q, device=device).expand(batch, q).contiguous()
    kv = torch.zeros(num_layers, batch, kv_heads, past, head_dim, dtype=dtype, device=device)
    return ids, pos, mask, index, kv, kv.clone()


def _cache_dims() -> dict[str, dict[int, torch.export.Dim]]:
    batch, q, past, sel = (torch.export.Dim(n, min=1, max=1 << 16) for n in ("batch", "tokens", "past_len", "selected"))
    total = torch.export.Dim.AUTO  # = past_len + tokens, which export derives from the concatenation
    return {
        "input_ids": {0: batch, 1: q},
        "position_ids": {0: batch, 1: q},
        "attention_mask": {0: batch, 1: q, 2: total},
        "logits_index": {0: batch, 1: sel},
        "past_keys": {1: batch, 3: past},
        "past_values": {1: batch, 3: past},
        "hidden_states": {0: batch, 1: q},
    }


def _export(module: nn.Module, args: tuple, spec: GraphSpec, dims: dict, path: Path) -> Path:
    dynamic = {name: dims[name] for name in spec.inputs}
    program = torch.onnx.export(
        module.eval(), args, dynamo=True, input_names=list(spec.inputs), output_names=list(spec.outputs),
        dynamic_shapes=dynamic, opset_version=OPSET, optimize=True, verbose=False,
    )
    program.save(str(path), external_data=True)
    return path


def export_target(target: TargetModel, path: Path) -> Path:
    ex = _cached_example(target.num_layers, target.num_kv_heads, target.head_dim, target.dtype, target.device)
    return _export(TargetStepGraph(target), ex, TARGET_SPEC, _cache_dims(), path)


def export_feature_draft(draft: FeatureDraft, lm_head: nn.Linear, path: Path) -> Path:
    layers, heads, dim = draft.attention_shape
    weight = draft.embed_tokens.weight
    ids, pos, mask, index, pk, pv = _cached_example(layers, heads, dim, weight.dtype, weight.device)
    feats = torch.zeros(ids.shape[0], ids.shape[1], draft.config.hidden_size, dtype=weight.dtype, device=weight.device)
    args = (ids, feats, pos, mask, index, pk, pv)
    return _export(FeatureDraftStepGraph(draft, lm_head), args, DRAFT_SPEC, _cache_dims(), path)


def export_medusa(heads: MedusaHeads, path: Path) -> Path:
    weight = heads.medusa_head[0][-1].weight
    feats = torch.zeros(2, heads.hidden_size, dtype=weight.dtype, device=weight.device)
    dims = {"hidden_states": {0: torch.export.Dim("batch", min=1, max=1 << 16)}}
    return _export(MedusaHeadsGraph(heads), (feats,), MEDUSA_SPEC, dims, path)
