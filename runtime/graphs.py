"""The graph form of every step: past keys/values in, present out, explicit mask over past + new keys.

The runtime's own modules run unchanged inside these wrappers over a ``GraphCache`` (a ``LayerCache`` whose past
slots are graph inputs and whose new keys/values are graph outputs). ``GraphPlan``s say what each engine graph is
(role, module, example inputs, dynamic axes); ``export/onnx_graphs.py`` writes them as ONNX, and
``runtime/ort_backend.py`` feeds the resulting sessions from the runtime's ``KVCache`` under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec_kit.runtime.drafts.eagle3 import Eagle3Draft
from specdec_kit.runtime.drafts.layers import FeatureDraft
from specdec_kit.runtime.drafts.medusa import MedusaHeads
from specdec_kit.runtime.drafts.moa import MoADraft
from specdec_kit.runtime.moa_drafting import moa_hidden
from specdec_kit.runtime.target import TargetModel


class GraphCache:
    """``LayerCache`` for export. It has no committed slots: its P - Q past slots are all pending ones, visible
    per the mask [B, Q, P] a graph takes as input, so the runtime's modules attend over it unchanged."""

    def __init__(self, past_keys: torch.Tensor, past_values: torch.Tensor, first_layer: int = 0):
        self.past_keys, self.past_values = past_keys, past_values  # [L, B, H, P - Q, D] (layers from first_layer on)
        self.first_layer = first_layer
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def window(self, pending_mask: torch.Tensor) -> "GraphWindow":
        return GraphWindow(self, pending_mask[:, None])

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.new_keys), torch.stack(self.new_values)


@dataclass
class GraphWindow:
    """``AttentionWindow`` of a ``GraphCache``: keeps each layer's new keys/values and returns past + new."""

    cache: GraphCache
    mask: torch.Tensor

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        c.new_keys.append(keys)
        c.new_values.append(values)
        i = layer - c.first_layer
        return torch.cat([c.past_keys[i], keys], dim=2), torch.cat([c.past_values[i], values], dim=2)


class TargetStepGraph(nn.Module):
    """(ids, positions, mask, logits_index, past K/V) -> (logits, features, present K/V)."""

    def __init__(self, target: TargetModel):
        super().__init__()
        self.target = target

    def forward(self, input_ids, position_ids, attention_mask, logits_index, past_keys, past_values):
        cache = GraphCache(past_keys, past_values)
        out = self.target.cached_step(input_ids, position_ids, attention_mask, cache, logits_index)
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
        cache = GraphCache(past_keys, past_values)
        pred, reg = self.draft.cached_step(hidden_states, input_ids, position_ids, attention_mask, cache)
        selected = torch.gather(pred, 1, logits_index[..., None].expand(-1, -1, pred.shape[-1]))
        present_keys, present_values = cache.present()
        return self.lm_head(selected), reg, present_keys, present_values


class FuseGraph(nn.Module):
    """An EAGLE-3 draft's ``fc`` alone: the target's tapped layers [B, Q, k x d_target] -> the step's input [B, Q, d]
    (the draft step graph then takes d-wide features on every step)."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, hidden_states):
        return self.draft.fc(hidden_states)


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
        cache = GraphCache(past_keys, past_values)
        o_hat = moa_hidden(self.draft, input_ids, position_ids, attention_mask, cache, memory_keys, memory_values,
                           memory_mask)
        present_keys, present_values = cache.present()
        return o_hat, present_keys, present_values


class TargetTailGraph(nn.Module):
    """The target's last ``layers`` layers, final norm and LM head over a cache (a MoA draft's TLI)."""

    def __init__(self, target: TargetModel, layers: int):
        super().__init__()
        self.target, self.first = target, target.num_layers - layers

    def forward(self, hidden_states, position_ids, attention_mask, logits_index, past_keys, past_values):
        cache = GraphCache(past_keys, past_values, first_layer=self.first)
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
FUSE_SPEC = GraphSpec("draft_fuse", ("hidden_states",), ("fused",))
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


@dataclass
class GraphPlan:
    """One engine graph to export: its role (file stem and manifest artifact), module, example inputs, axes."""

    spec: GraphSpec
    module: nn.Module
    args: tuple
    dims: dict

    @property
    def role(self) -> str:
        return self.spec.name


def _big(name: str) -> torch.export.Dim:
    return torch.export.Dim(name, min=1, max=1 << 16)


def target_plan(target: TargetModel) -> GraphPlan:
    ex = _cached_example(target.num_layers, target.num_kv_heads, target.head_dim, target.dtype, target.device)
    return GraphPlan(TARGET_SPEC, TargetStepGraph(target), ex, _cache_dims())


def feature_draft_plans(draft: FeatureDraft, head: nn.Module) -> list[GraphPlan]:
    """The draft step: d-wide features in, ``head`` (the target's LM head, or an EAGLE-3 draft's own head placed on
    the target's vocabulary) folded in."""
    layers, heads, dim = draft.attention_shape
    weight = draft.embed_tokens.weight
    ids, pos, mask, index, pk, pv = _cached_example(layers, heads, dim, weight.dtype, weight.device)
    feats = torch.zeros(ids.shape[0], ids.shape[1], draft.config.hidden_size, dtype=weight.dtype, device=weight.device)
    return [GraphPlan(DRAFT_SPEC, FeatureDraftStepGraph(draft, head), (ids, feats, pos, mask, index, pk, pv),
                      _cache_dims())]


def fuse_plan(draft: Eagle3Draft) -> GraphPlan:
    """An EAGLE-3 draft's ``fc`` over the target's tapped layers, a graph of its own."""
    weight = draft.fc.weight
    wide = torch.zeros(2, 3, draft.fc.in_features, dtype=weight.dtype, device=weight.device)
    return GraphPlan(FUSE_SPEC, FuseGraph(draft), (wide,), {"hidden_states": {0: _big("batch"), 1: _big("tokens")}})


def medusa_plans(heads: MedusaHeads, target: TargetModel) -> list[GraphPlan]:
    weight = heads.medusa_head[0][-1].weight
    feats = torch.zeros(2, heads.hidden_size, dtype=weight.dtype, device=weight.device)
    return [GraphPlan(MEDUSA_SPEC, MedusaHeadsGraph(heads), (feats,), {"hidden_states": {0: _big("batch")}})]


def moa_plans(draft: MoADraft, target: TargetModel) -> list[GraphPlan]:
    """LSA memory update, the draft step, and its finish (the target's last TLI layers, or the LM head alone for
    TLI = 0)."""
    w = draft.embed_tokens.weight
    dev, dtype = w.device, w.dtype
    bsz, q, past, mem = 2, 3, 5, 4
    batch, width, memory = _big("batch"), _big("width"), _big("memory_len")
    kv = torch.zeros(bsz, q, target.num_layers, draft.target_kv_dim, dtype=dtype, device=dev)
    pos = torch.arange(q, device=dev).expand(bsz, q).contiguous()
    plans = [GraphPlan(MOA_MEMORY_SPEC, MoAMemoryGraph(draft), (kv, pos),
                       {"target_kv": {0: batch, 1: width}, "position_ids": {0: batch, 1: width}})]
    _, heads, dim = draft.attention_shape
    ids, pos, mask, index, pk, pv = _cached_example(1, heads, dim, dtype, dev, bsz, q, past)
    mk = torch.zeros(bsz, heads, mem, dim, dtype=dtype, device=dev)
    mmask = torch.ones(bsz, mem, dtype=torch.bool, device=dev)
    dims = _cache_dims()
    dims.update(memory_keys={0: dims["input_ids"][0], 2: memory}, memory_values={0: dims["input_ids"][0], 2: memory},
                memory_mask={0: dims["input_ids"][0], 1: memory})
    plans.append(GraphPlan(MOA_STEP_SPEC, MoAStepGraph(draft), (ids, pos, mask, pk, pv, mk, mk.clone(), mmask), dims))
    hidden = torch.zeros(bsz, q, target.hidden_size, dtype=dtype, device=dev)
    if draft.tli == 0:
        dims = {"hidden_states": {0: batch, 1: width}, "logits_index": {0: batch, 1: _big("selected")}}
        plans.append(GraphPlan(LM_HEAD_SPEC, LMHeadGraph(target.lm_head), (hidden, index), dims))
    else:
        ids, pos, mask, index, pk, pv = _cached_example(draft.tli, target.num_kv_heads, target.head_dim, dtype, dev, bsz, q, past)
        plans.append(GraphPlan(TAIL_SPEC, TargetTailGraph(target, draft.tli), (hidden, pos, mask, index, pk, pv),
                               _cache_dims()))
    return plans
