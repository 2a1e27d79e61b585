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
from specdec_kit.runtime.drafts.moa import MoADraft
from specdec_kit.runtime.moa_drafting import moa_hidden
from specdec_kit.runtime.target import TargetModel

OPSET = 18


class GraphCache:
    """Duck-typed ``KVCache`` for export: past from inputs, present collected as outputs."""

    def __init__(self, past_keys: torch.Tensor, past_values: torch.Tensor, mask: torch.Tensor, first_layer: int = 0):
        self.past_keys, self.past_values = past_keys, past_values  # [L, B, H, P, D] (layers from first_layer on)
        self.mask = mask[:, None]  # [B, 1, Q, P + Q]
        self.first_layer = first_layer
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
        i = layer - self.first_layer
        keys = torch.cat([self.past_keys[i], self.new_keys[i]], dim=2)
        values = torch.cat([self.past_values[i], self.new_values[i]], dim=2)
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


class MoAMemoryGraph(nn.Module):
    """(target K/V per position and layer, positions) -> CA memory keys/values (LSA, once per cycle)."""

    def __init__(self, draft: MoADraft):
        super().__init__()
        self.draft = draft

    def forward(self, target_kv, position_ids):
        memory = self.draft.lsa_memory(target_kv)
        cos, sin = self.draft.rotary_emb(memory, position_ids)
        return self.draft.ca.memory_kv(memory, cos, sin)


class MoAStepGraph(nn.Module):
    """(ids, positions, SA mask, SA past K/V, memory K/V and mask) -> (o_hat, SA present K/V)."""

    def __init__(self, draft: MoADraft):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids, position_ids, attention_mask, past_keys, past_values, memory_keys, memory_values,
                memory_mask):
        cache = GraphCache(past_keys, past_values, attention_mask)
        o_hat = moa_hidden(self.draft, input_ids, position_ids, cache.mask, cache, None, -1, memory_keys, memory_values,
                           memory_mask)
        present_keys, present_values = cache.present()
        return o_hat, present_keys, present_values


class TargetTailGraph(nn.Module):
    """The target's last ``layers`` layers, final norm and LM head over a cache (a MoA draft's TLI)."""

    def __init__(self, target: TargetModel, layers: int):
        super().__init__()
        self.target, self.first = target, target.num_layers - layers

    def forward(self, hidden_states, position_ids, attention_mask, logits_index, past_keys, past_values):
        cache = GraphCache(past_keys, past_values, attention_mask, first_layer=self.first)
        feats = self.target.run_layers(hidden_states, position_ids, attention_mask, cache, self.first)
        selected = torch.gather(feats, 1, logits_index[..., None].expand(-1, -1, feats.shape[-1]))
        present_keys, present_values = cache.present()
        return self.target.lm_head(selected), present_keys, present_values


class LMHeadGraph(nn.Module):
    def __init__(self, lm_head: nn.Linear):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden_states, logits_index):
        return self.lm_head(torch.gather(hidden_states, 1, logits_index[..., None].expand(-1, -1, hidden_states.shape[-1])))


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
MOA_MEMORY_SPEC = GraphSpec("moa_memory", ("target_kv", "position_ids"), ("memory_keys", "memory_values"))
MOA_STEP_SPEC = GraphSpec(
    "moa_step",
    ("input_ids", "position_ids", "attention_mask", "past_keys", "past_values", "memory_keys", "memory_values",
     "memory_mask"),
    ("o_hat", "present_keys", "present_values"),
)
TAIL_SPEC = GraphSpec("target_tail", ("hidden_states", "position_ids", "attention_mask", "logits_index", "past_keys",
                                      "past_values"), ("logits", "present_keys", "present_values"))
LM_HEAD_SPEC = GraphSpec("lm_head", ("hidden_states", "logits_index"), ("logits",))


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


def export_moa(draft: MoADraft, target: TargetModel, graphs: Path) -> dict[str, Path]:
    """The Mixture-of-Attentions graphs: LSA memory update, the draft step, and its finish (the target's last
    TLI layers, or the LM head alone for TLI = 0)."""
    w = draft.embed_tokens.weight
    dev, dtype = w.device, w.dtype
    bsz, q, past, mem = 2, 3, 5, 4
    big = lambda name: torch.export.Dim(name, min=1, max=1 << 16)  # noqa: E731
    batch, width, memory = big("batch"), big("width"), big("memory_len")
    kv = torch.zeros(bsz, q, target.num_layers, draft.target_kv_dim, dtype=dtype, device=dev)
    pos = torch.arange(q, device=dev).expand(bsz, q).contiguous()
    out = {"moa_memory": _export(MoAMemoryGraph(draft), (kv, pos), MOA_MEMORY_SPEC,
                                 {"target_kv": {0: batch, 1: width}, "position_ids": {0: batch, 1: width}},
                                 graphs / "moa_memory.onnx")}
    _, heads, dim = draft.attention_shape
    ids, pos, mask, index, pk, pv = _cached_example(1, heads, dim, dtype, dev, bsz, q, past)
    mk = torch.zeros(bsz, heads, mem, dim, dtype=dtype, device=dev)
    mmask = torch.ones(bsz, mem, dtype=torch.bool, device=dev)
    dims = _cache_dims()
    dims.update(memory_keys={0: dims["input_ids"][0], 2: memory}, memory_values={0: dims["input_ids"][0], 2: memory},
                memory_mask={0: dims["input_ids"][0], 1: memory})
    out["moa_step"] = _export(MoAStepGraph(draft), (ids, pos, mask, pk, pv, mk, mk.clone(), mmask), MOA_STEP_SPEC, dims,
                              graphs / "moa_step.onnx")
    hidden = torch.zeros(bsz, q, target.hidden_size, dtype=dtype, device=dev)
    if draft.tli == 0:
        dims = {"hidden_states": {0: batch, 1: width}, "logits_index": {0: batch, 1: big("selected")}}
        out["lm_head"] = _export(LMHeadGraph(target.lm_head), (hidden, index), LM_HEAD_SPEC, dims, graphs / "lm_head.onnx")
    else:
        ids, pos, mask, index, pk, pv = _cached_example(draft.tli, target.num_kv_heads, target.head_dim, dtype, dev, bsz, q, past)
        dims = _cache_dims()
        out["target_tail"] = _export(TargetTailGraph(target, draft.tli), (hidden, pos, mask, index, pk, pv), TAIL_SPEC, dims,
                                     graphs / "target_tail.onnx")
    return out
