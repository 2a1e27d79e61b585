"""The graph form of every step: each layer's cache buffer in, the new keys/values out, an explicit mask over the
buffer's slots + the new keys.

The runtime's own modules run unchanged inside these wrappers over a ``GraphCache`` (a ``LayerCache`` whose
per-layer buffers are graph inputs and whose new keys/values are graph outputs). The runtime binds each layer's
whole ``KVCache`` buffer as that layer's input, in place: nothing copies the past. So attention reads the buffer
and the new keys separately (one softmax over both), and grouped-query heads share a key head by reshaping the
queries rather than repeating the keys. ``GraphPlan``s say what each engine graph is (role, module, example
inputs, dynamic axes); ``export/onnx_graphs.py`` writes them as ONNX, and ``runtime/ort/backend.py`` feeds the
resulting sessions from the runtime's ``KVCache`` under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from specdec_kit.runtime.core.coupling import DrawCoupling
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.drafting import log_probs, scored_tree_search
from specdec_kit.runtime.decoding.joined_vocab import joins_request_tokens
from specdec_kit.runtime.decoding.moa_drafting import moa_hidden
from specdec_kit.runtime.drafts.dflash import DFlashDraft
from specdec_kit.runtime.drafts.eagle3 import Eagle3Draft
from specdec_kit.runtime.drafts.layers import FeatureDraft, OnTargetVocab, PromptVocab
from specdec_kit.runtime.drafts.medusa import MedusaHeads
from specdec_kit.runtime.drafts.moa import MoADraft
from specdec_kit.runtime.models.target import TargetModel


def past_names(layers: int) -> tuple[str, ...]:
    """The per-layer cache inputs of a graph over ``layers`` layers, in argument order: keys, then values."""
    return tuple(f"past_key_{i}" for i in range(layers)) + tuple(f"past_value_{i}" for i in range(layers))


def cache_names(layers: int) -> tuple[str, ...]:
    """The target step's per-layer outputs: each buffer written (bound to its ``past_names`` input's memory)."""
    return tuple(f"cache_key_{i}" for i in range(layers)) + tuple(f"cache_value_{i}" for i in range(layers))


class GraphCache:
    """``LayerCache`` for export. It has no committed slots: each layer's buffer of C slots is visible per the
    mask [B, Q, C + Q] a graph takes as input (its last Q columns for the new tokens), so the runtime's modules
    attend over it unchanged."""

    def __init__(self, past_keys: Sequence[torch.Tensor], past_values: Sequence[torch.Tensor], first_layer: int = 0):
        self.past_keys, self.past_values = past_keys, past_values  # per layer [B, H_kv, C, D], from first_layer on
        self.first_layer = first_layer
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def window(self, pending_mask: torch.Tensor) -> "GraphWindow":
        return GraphWindow(self, pending_mask[:, None])

    @classmethod
    def of(cls, past: Sequence[torch.Tensor], first_layer: int = 0) -> "GraphCache":
        """From a graph's per-layer inputs in ``past_names`` order (every key buffer, then every value buffer)."""
        half = len(past) // 2
        return cls(past[:half], past[half:], first_layer)

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.new_keys), torch.stack(self.new_values)


@dataclass
class GraphWindow:
    """``AttentionWindow`` of a ``GraphCache``: keeps each layer's new keys/values and attends over the layer's
    buffer and the new keys without joining them (joining would copy the buffer on every call)."""

    cache: GraphCache
    mask: torch.Tensor  # [B, 1, Q, C + Q]

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        c = self.cache
        c.new_keys.append(keys)
        c.new_values.append(values)
        i = layer - c.first_layer
        slots = c.past_keys[i].shape[2]
        visible = self.mask[:, :, None]  # [B, 1, 1, Q, C + Q]: one mask for every head of a group
        past = (c.past_keys[i], c.past_values[i], visible[..., :slots])
        return segment_attention(queries, [past, (keys, values, visible[..., slots:])])


Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # keys, values, visibility


def segment_attention(queries: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
    """Grouped-query attention over key/value segments [B, H_kv, S_i, D] read where they lie (nothing joins the
    keys), each with its visibility [B, 1, 1, Q or 1, S_i]; one softmax over all of them."""
    bsz, heads, q_len, dim = queries.shape
    kv_heads = segments[0][0].shape[1]
    group = heads // kv_heads  # query heads g * j .. g * j + g - 1 share key head j
    grouped = queries.reshape(bsz, kv_heads, group * q_len, dim) * dim**-0.5
    floor = torch.finfo(queries.dtype).min
    scores = [
        (grouped @ keys.transpose(-1, -2)).view(bsz, kv_heads, group, q_len, -1).masked_fill(~seen, floor)
        for keys, _, seen in segments
    ]
    weights = torch.cat(scores, dim=-1).softmax(dim=-1).view(bsz, kv_heads, group * q_len, -1)
    out, start = None, 0
    for keys, values, _ in segments:
        part = weights[..., start : start + keys.shape[2]] @ values
        out = part if out is None else out + part
        start += keys.shape[2]
    return out.view(bsz, heads, q_len, dim)


class SlotCache:
    """``LayerCache`` for the target's export: each layer's new keys/values are written into its buffer at the
    row's first free slot (ONNX ``TensorScatter``; in place where the runtime binds the output to the input's
    memory) and attention reads the whole buffer under a slot mask [B, Q, C] (ONNX ``Attention``, grouped-query
    heads native). Attention runs as one kernel per layer instead of the score, mask, softmax and value products
    of ``GraphWindow``, and a one-token step no longer scores the slots past a row's end one by one with masks.
    Export-only: the two ONNX ops have no eager meaning here."""

    def __init__(self, past_keys: Sequence[torch.Tensor], past_values: Sequence[torch.Tensor], write_index):
        self.past_keys, self.past_values = past_keys, past_values  # per layer [B, H_kv, C, D]
        self.write_index = write_index  # [B]: the slot of each row's first new token
        self.keys_out: list[torch.Tensor] = []
        self.values_out: list[torch.Tensor] = []

    def window(self, slot_mask: torch.Tensor) -> "SlotWindow":
        return SlotWindow(self, slot_mask[:, None])

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every layer's written key buffer, then every value buffer (``cache_names`` order)."""
        return (*self.keys_out, *self.values_out)


def _written(buffer: torch.Tensor, new: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """ONNX ``TensorScatter`` (opset 24): ``buffer`` with ``new`` [B, H, Q, D] at slots ``index[b] + [0, Q)``."""
    return torch.onnx.ops.symbolic(
        "TensorScatter", (buffer, new, index), {"axis": 2}, dtype=buffer.dtype, shape=buffer.shape, version=24
    )


@dataclass
class SlotWindow:
    """``AttentionWindow`` of a ``SlotCache``."""

    cache: SlotCache
    mask: torch.Tensor  # [B, 1, Q, C]

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        c = self.cache
        all_keys = _written(c.past_keys[layer], keys, c.write_index)
        all_values = _written(c.past_values[layer], values, c.write_index)
        c.keys_out.append(all_keys)
        c.values_out.append(all_values)
        out, *_ = torch.onnx.ops.attention(queries, all_keys, all_values, attn_mask=self.mask)
        return out


class TreeLevelCache:
    """``LayerCache`` of one level of a tree search inside a graph: each layer attends over the engine cache's
    buffer and the context step's new keys as the root sees them (``root_visible`` [B, C + Q]), then over the earlier
    levels' keys and the level's own as the ``pending_mask`` [B, k, S] of its ``window`` says (own slots last)."""

    def __init__(self, context: GraphCache, root_visible: torch.Tensor):
        self.context, self.root_visible = context, root_visible
        self.level_keys: dict[int, torch.Tensor] = {}
        self.level_values: dict[int, torch.Tensor] = {}

    def window(self, pending_mask: torch.Tensor) -> "TreeLevelWindow":
        return TreeLevelWindow(self, pending_mask[:, None, None])


@dataclass
class TreeLevelWindow:
    cache: TreeLevelCache
    mask: torch.Tensor  # [B, 1, 1, k, S]

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        c = self.cache
        i = layer - c.context.first_layer
        past_keys, past_values = c.context.past_keys[i], c.context.past_values[i]
        seen = c.root_visible[:, None, None, None, :]
        slots, own = past_keys.shape[2], keys.shape[2]
        segments = [
            (past_keys, past_values, seen[..., :slots]),
            (c.context.new_keys[i], c.context.new_values[i], seen[..., slots:]),
        ]
        if i in c.level_keys:
            segments.append((c.level_keys[i], c.level_values[i], self.mask[..., :-own]))
            c.level_keys[i] = torch.cat([c.level_keys[i], keys], dim=2)
            c.level_values[i] = torch.cat([c.level_values[i], values], dim=2)
        else:
            c.level_keys[i], c.level_values[i] = keys, values
        segments.append((keys, values, self.mask[..., -own:]))
        return segment_attention(queries, segments)


class TargetStepGraph(nn.Module):
    """(ids, positions, slot mask [B, Q, C], write index [B], logits_index, each layer's K/V buffer) -> (logits,
    features, each layer's buffer with the new K/V written in): see ``SlotCache``."""

    def __init__(self, target: TargetModel):
        super().__init__()
        self.target = target

    def forward(self, input_ids, position_ids, attention_mask, write_index, logits_index, *past):
        half = len(past) // 2
        cache = SlotCache(past[:half], past[half:], write_index)
        out = self.target.cached_step(input_ids, position_ids, attention_mask, cache, logits_index)
        return out.logits, out.features, *cache.buffers()


def _split_vocab(joins: bool, rest: tuple) -> tuple[PromptVocab | None, tuple]:
    """A draft graph's inputs after its fixed ones: (``vocab_ids``, ``vocab_rows``, if it takes them), then the
    per-layer buffers."""
    return (PromptVocab(rest[0], rest[1]), rest[2:]) if joins else (None, rest)


class FeatureDraftStepGraph(nn.Module):
    """(ids, features, positions, mask, logits_index[, vocab ids, vocab rows], each layer's K/V buffer) -> (logits,
    regression feature, present K/V).

    The target's LM head is part of the graph so a draft step is one session call; ``logits_index``
    keeps it to the positions that need logits (one per row when the context is long). A reduced vocabulary over the
    target's rows also ranks each row's joined tokens (``PromptVocab``)."""

    def __init__(self, draft: FeatureDraft, lm_head: nn.Linear):
        super().__init__()
        self.draft, self.lm_head = draft, lm_head
        self.joins = joins_request_tokens(lm_head)

    def forward(self, input_ids, hidden_states, position_ids, attention_mask, logits_index, *rest):
        vocab, past = _split_vocab(self.joins, rest)
        cache = GraphCache.of(past)
        pred, reg = self.draft.cached_step(hidden_states, input_ids, position_ids, attention_mask, cache)
        selected = torch.gather(pred, 1, logits_index[..., None].expand(-1, -1, pred.shape[-1]))
        present_keys, present_values = cache.present()
        if vocab is not None:
            logits = self.lm_head.place_with(self.lm_head.own_with(selected, vocab), vocab)
        else:
            logits = self.lm_head(selected)
        return logits, reg, present_keys, present_values


class DraftTreeGraph(nn.Module):
    """(ids, features, positions, mask, root_index, draw noise, inverse temperatures, each layer's K/V buffer) ->
    (tree tokens, tree parents, the nodes' path scores, the context's present K/V): a feature draft's whole cycle as
    one session call. The context step reads the new pairs (as ``FeatureDraftStepGraph`` does); from each row's root
    pair (``root_index``) the dynamic tree search of ``tree`` runs its levels inside the graph (``scored_tree_search``,
    the runtime's own), sampled rows ranking children by their draws (``DrawCoupling``; rows of inverse temperature 0
    by the draft alone). The scores are the search's own (a hybrid ranks the head's nodes by them in its merged
    tree). Only the context's keys and values come out: the levels' are scratch, as in the runtime's stepwise
    search. A head over a draft vocabulary (``OnTargetVocab``) ranks over that vocabulary alone, its ids mapped to the
    target's as they are chosen: the trees of ranking over the target's vocabulary with the rest at -inf (their scores
    to float rounding), without the passes over it (on SmolLM2 0.9 of a 6 ms draft call went to ops over 49,152-wide
    tensors)."""

    def __init__(self, draft: FeatureDraft, lm_head: nn.Module, tree: DynamicTreeConfig):
        super().__init__()
        self.draft, self.lm_head, self.tree = draft, lm_head, tree
        self.reduced = isinstance(lm_head, OnTargetVocab)
        self.joins = joins_request_tokens(lm_head)

    def logp(self, prediction: torch.Tensor, vocab: PromptVocab | None = None) -> torch.Tensor:
        if vocab is not None:
            logits = self.lm_head.own_with(prediction, vocab)
            return log_probs(logits if self.reduced else self.lm_head.place_with(logits, vocab))
        return log_probs(self.lm_head.own(prediction) if self.reduced else self.lm_head(prediction))

    def forward(
        self,
        input_ids,
        hidden_states,
        position_ids,
        attention_mask,
        root_index,
        draw_noise,
        draw_inv_temperature,
        *rest,
    ):
        vocab, past = _split_vocab(self.joins, rest)
        cache = GraphCache.of(past)
        pred, reg = self.draft.cached_step(hidden_states, input_ids, position_ids, attention_mask, cache)
        present_keys, present_values = cache.present()
        at = root_index[:, None]
        root_pred = torch.gather(pred, 1, at[..., None].expand(-1, -1, pred.shape[-1]))[:, 0]
        root_reg = torch.gather(reg, 1, at[..., None].expand(-1, -1, reg.shape[-1]))[:, 0]
        root_visible = torch.gather(attention_mask, 1, at[..., None].expand(-1, -1, attention_mask.shape[-1]))[:, 0]
        first_level = torch.gather(position_ids, 1, at) + 1
        levels = TreeLevelCache(cache, root_visible)

        def step(feats, toks, level, visible):
            p, r = self.draft.cached_step(feats, toks, (first_level + level).expand_as(toks), visible, levels)
            return self.logp(p, vocab), r

        coupling = DrawCoupling(draw_noise, draw_inv_temperature)
        vocab_ids = None  # ranked over the target's vocabulary
        if self.reduced:
            vocab_ids = self.lm_head.ids if vocab is None else self.lm_head.ids_with(vocab)
        tokens, parents, scores = scored_tree_search(
            torch.gather(input_ids, 1, at)[:, 0],
            self.logp(root_pred, vocab),
            root_reg,
            self.tree,
            step,
            coupling,
            vocab_ids,
        )
        return tokens, parents, scores.float(), present_keys, present_values


class FuseGraph(nn.Module):
    """An EAGLE-3 draft's ``fc`` alone: the target's tapped layers [B, Q, k x d_target] -> the step's input [B, Q, d]
    (the draft step graph then takes d-wide features on every step)."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, hidden_states):
        return self.draft.fc(hidden_states)


class DFlashContextGraph(nn.Module):
    """A DFlash draft's context: the target's tapped layers and their positions -> every draft layer's keys and values
    of them [L, B, H_kv, W, D] (``DFlashDraft.context_keys_values``), which the runtime writes into its cache."""

    def __init__(self, draft: DFlashDraft):
        super().__init__()
        self.draft = draft

    def forward(self, hidden_states, position_ids):
        return self.draft.context_keys_values(hidden_states, position_ids)


class DFlashBlockGraph(nn.Module):
    """(block ids, positions, mask, logits_index, each layer's K/V buffer) -> (logits, present K/V): a DFlash
    block with the target's embedding and LM head folded in, one session call a cycle."""

    def __init__(self, draft: DFlashDraft, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.draft, self.embed_tokens, self.lm_head = draft, embed_tokens, lm_head

    def forward(self, input_ids, position_ids, attention_mask, logits_index, *past):
        cache = GraphCache.of(past)
        embeds = self.embed_tokens(input_ids).to(self.draft.fc.weight.dtype)
        out = self.draft.block(embeds, position_ids, cache.window(attention_mask))
        selected = torch.gather(out, 1, logits_index[..., None].expand(-1, -1, out.shape[-1]))
        present_keys, present_values = cache.present()
        return self.lm_head(selected), present_keys, present_values


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
    """(ids, positions, SA mask, memory K/V and mask, SA K/V buffer) -> (o_hat, SA present K/V)."""

    def __init__(self, draft: MoADraft):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids, position_ids, attention_mask, memory_keys, memory_values, memory_mask, *past):
        cache = GraphCache.of(past)
        o_hat = moa_hidden(
            self.draft, input_ids, position_ids, attention_mask, cache, memory_keys, memory_values, memory_mask
        )
        present_keys, present_values = cache.present()
        return o_hat, present_keys, present_values


class TargetTailGraph(nn.Module):
    """The target's last ``layers`` layers, final norm and LM head over a cache (a MoA draft's TLI)."""

    def __init__(self, target: TargetModel, layers: int):
        super().__init__()
        self.target, self.first = target, target.num_layers - layers

    def forward(self, hidden_states, position_ids, attention_mask, logits_index, *past):
        cache = GraphCache.of(past, first_layer=self.first)
        feats = self.target.run_layers(hidden_states, position_ids, attention_mask, cache, self.first)
        selected = torch.gather(feats, 1, logits_index[..., None].expand(-1, -1, feats.shape[-1]))
        present_keys, present_values = cache.present()
        return self.target.lm_head(selected), present_keys, present_values


class LMHeadGraph(nn.Module):
    def __init__(self, lm_head: nn.Linear):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden_states, logits_index):
        return self.lm_head(
            torch.gather(hidden_states, 1, logits_index[..., None].expand(-1, -1, hidden_states.shape[-1]))
        )


@dataclass
class GraphSpec:
    """What one exported graph is: its file and its I/O names (a cached graph's per-layer buffers come last)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def with_layers(self, layers: int) -> "GraphSpec":
        """This spec with one key and one value buffer input per layer appended."""
        return GraphSpec(self.name, self.inputs + past_names(layers), self.outputs)


TARGET_SPEC = GraphSpec(
    "target_step",
    ("input_ids", "position_ids", "attention_mask", "write_index", "logits_index"),
    ("logits", "features"),
)
DRAFT_SPEC = GraphSpec(
    "draft_step",
    ("input_ids", "hidden_states", "position_ids", "attention_mask", "logits_index"),
    ("logits", "hidden_states_out", "present_keys", "present_values"),
)
DRAFT_TREE_SPEC = GraphSpec(
    "draft_tree",
    (
        "input_ids",
        "hidden_states",
        "position_ids",
        "attention_mask",
        "root_index",
        "draw_noise",
        "draw_inv_temperature",
    ),
    ("tree_tokens", "tree_parents", "tree_scores", "present_keys", "present_values"),
)
FUSE_SPEC = GraphSpec("draft_fuse", ("hidden_states",), ("fused",))
DFLASH_CONTEXT_SPEC = GraphSpec("dflash_context", ("hidden_states", "position_ids"), ("context_keys", "context_values"))
DFLASH_BLOCK_SPEC = GraphSpec(
    "dflash_block",
    ("input_ids", "position_ids", "attention_mask", "logits_index"),
    ("logits", "present_keys", "present_values"),
)
MEDUSA_SPEC = GraphSpec("medusa_heads", ("hidden_states",), ("logits",))
MOA_MEMORY_SPEC = GraphSpec("moa_memory", ("target_kv", "position_ids"), ("memory_keys", "memory_values"))
MOA_STEP_SPEC = GraphSpec(
    "moa_step",
    ("input_ids", "position_ids", "attention_mask", "memory_keys", "memory_values", "memory_mask"),
    ("o_hat", "present_keys", "present_values"),
)
TAIL_SPEC = GraphSpec(
    "target_tail",
    ("hidden_states", "position_ids", "attention_mask", "logits_index"),
    ("logits", "present_keys", "present_values"),
)
LM_HEAD_SPEC = GraphSpec("lm_head", ("hidden_states", "logits_index"), ("logits",))


def _cached_example(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, batch=2, q=3, past=5):
    """(ids, positions, mask, logits_index), and every layer's key buffer then every value buffer."""
    ids = torch.zeros(batch, q, dtype=torch.long, device=device)
    pos = torch.arange(past, past + q, device=device).expand(batch, q).contiguous()
    mask = torch.ones(batch, q, past + q, dtype=torch.bool, device=device)
    index = torch.arange(q, device=device).expand(batch, q).contiguous()
    buffers = tuple(
        torch.zeros(batch, kv_heads, past, head_dim, dtype=dtype, device=device) for _ in range(2 * num_layers)
    )
    return (ids, pos, mask, index), buffers


def _cache_dims(layers: int) -> dict[str, dict[int, torch.export.Dim]]:
    batch, q, past, sel = (torch.export.Dim(n, min=1, max=1 << 16) for n in ("batch", "tokens", "past_len", "selected"))
    total = torch.export.Dim.AUTO  # = past_len + tokens, which export derives from the mask's two parts
    return {
        "input_ids": {0: batch, 1: q},
        "position_ids": {0: batch, 1: q},
        "attention_mask": {0: batch, 1: q, 2: total},
        "logits_index": {0: batch, 1: sel},
        "hidden_states": {0: batch, 1: q},
        **{name: {0: batch, 2: past} for name in past_names(layers)},
    }


@dataclass
class GraphPlan:
    """One engine graph to export: its role (file stem and manifest artifact), module, example inputs, axes."""

    spec: GraphSpec
    module: nn.Module
    args: tuple
    dims: dict
    opset: int = 18  # the target step's in-place attention needs 24 (TensorScatter); the drafts stay at 18

    @property
    def role(self) -> str:
        return self.spec.name


def _big(name: str) -> torch.export.Dim:
    return torch.export.Dim(name, min=1, max=1 << 16)


def target_plan(target: TargetModel) -> GraphPlan:
    """The target step over slot masks (``SlotCache``): the mask spans the buffers' C slots, the new tokens' own
    among them from ``write_index`` on."""
    layers = target.num_layers
    (ids, pos, _, index), buffers = _cached_example(
        layers, target.num_kv_heads, target.head_dim, target.dtype, target.device, past=8
    )
    batch, q = ids.shape
    mask = torch.ones(batch, q, buffers[0].shape[2], dtype=torch.bool, device=ids.device)
    write_index = torch.tensor([5, 3], device=ids.device)[:batch]
    dims = _cache_dims(layers)
    dims["attention_mask"] = {0: dims["input_ids"][0], 1: dims["input_ids"][1], 2: dims["past_key_0"][2]}
    dims["write_index"] = {0: dims["input_ids"][0]}
    spec = TARGET_SPEC.with_layers(layers)
    spec = GraphSpec(spec.name, spec.inputs, spec.outputs + cache_names(layers))
    args = (ids, pos, mask, write_index, index, *buffers)
    return GraphPlan(spec, TargetStepGraph(target), args, dims, opset=24)


def feature_draft_plans(draft: FeatureDraft, head: nn.Module) -> list[GraphPlan]:
    """The draft step: d-wide features in, ``head`` (the target's LM head, or an EAGLE-3 draft's own head placed on
    the target's vocabulary) folded in."""
    layers, heads, dim = draft.attention_shape
    weight = draft.embed_tokens.weight
    (ids, pos, mask, index), buffers = _cached_example(layers, heads, dim, weight.dtype, weight.device)
    feats = torch.zeros(ids.shape[0], ids.shape[1], draft.config.hidden_size, dtype=weight.dtype, device=weight.device)
    dims = _cache_dims(layers)
    vocab_names, vocab_args = _vocab_inputs(head, feats, dims)
    return [
        GraphPlan(
            _with_vocab(DRAFT_SPEC, vocab_names).with_layers(layers),
            FeatureDraftStepGraph(draft, head),
            (ids, feats, pos, mask, index, *vocab_args, *buffers),
            dims,
        )
    ]


VOCAB_INPUTS = ("vocab_ids", "vocab_rows")  # a graph's joined tokens (``PromptVocab``), after its fixed inputs


def _vocab_inputs(head: nn.Module, feats: torch.Tensor, dims: dict) -> tuple[tuple[str, ...], tuple]:
    """The joined-token inputs a draft graph over ``head`` takes (none unless ``joins_request_tokens``): names and
    example values (a row with a padding slot), their axes added to ``dims``."""
    if not joins_request_tokens(head):
        return (), ()
    batch, extra = dims["input_ids"][0], _big("joined")
    dims.update(vocab_ids={0: batch, 1: extra}, vocab_rows={0: batch, 1: extra})
    ids = torch.tensor([[3, 5, -1], [7, 2, 4]], device=feats.device)[: feats.shape[0]]
    rows = torch.zeros(ids.shape[0], ids.shape[1], head.rows.shape[1], dtype=head.rows.dtype, device=feats.device)
    return VOCAB_INPUTS, (ids, rows)


def _with_vocab(spec: GraphSpec, names: tuple[str, ...], role: str | None = None) -> GraphSpec:
    return GraphSpec(role or spec.name, spec.inputs + names, spec.outputs)


def extra_tree_role(tree: DynamicTreeConfig) -> str:
    """The graph (file stem, manifest artifact) that drafts the whole cycle of a tree an engine carries beside its own
    (whose graph is ``draft_tree``)."""
    return f"{DRAFT_TREE_SPEC.name}_{tree.total_tokens}_{tree.depth}_{tree.top_k}"


def draft_tree_plan(
    draft: FeatureDraft, head: nn.Module, tree: DynamicTreeConfig, role: str = DRAFT_TREE_SPEC.name
) -> GraphPlan:
    """A feature draft's whole cycle (context step and dynamic tree search, ``DraftTreeGraph``) for one tree, as the
    graph ``role``."""
    layers, heads, dim = draft.attention_shape
    weight = draft.embed_tokens.weight
    (ids, pos, mask, _), buffers = _cached_example(layers, heads, dim, weight.dtype, weight.device)
    feats = torch.zeros(ids.shape[0], ids.shape[1], draft.config.hidden_size, dtype=weight.dtype, device=weight.device)
    root = torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.long, device=ids.device)
    noise = torch.zeros(ids.shape[0], tree.depth + 1, draft.config.vocab_size, device=ids.device)
    inv_temperature = torch.tensor([0.0, 1.0], device=ids.device)  # a greedy row and a sampled one
    dims = _cache_dims(layers)
    for name in ("root_index", "draw_noise", "draw_inv_temperature"):
        dims[name] = {0: dims["input_ids"][0]}
    del dims["logits_index"]
    vocab_names, vocab_args = _vocab_inputs(head, feats, dims)
    return GraphPlan(
        _with_vocab(DRAFT_TREE_SPEC, vocab_names, role).with_layers(layers),
        DraftTreeGraph(draft, head, tree),
        (ids, feats, pos, mask, root, noise, inv_temperature, *vocab_args, *buffers),
        dims,
    )


def fuse_plan(draft: Eagle3Draft) -> GraphPlan:
    """An EAGLE-3 draft's ``fc`` over the target's tapped layers, a graph of its own."""
    weight = draft.fc.weight
    wide = torch.zeros(2, 3, draft.fc.in_features, dtype=weight.dtype, device=weight.device)
    return GraphPlan(FUSE_SPEC, FuseGraph(draft), (wide,), {"hidden_states": {0: _big("batch"), 1: _big("tokens")}})


def dflash_plans(draft: DFlashDraft, embed_tokens: nn.Module, lm_head: nn.Module) -> list[GraphPlan]:
    """A DFlash draft's context projection and its block (the target's embedding and LM head folded in)."""
    layers, heads, dim = draft.attention_shape
    weight = draft.fc.weight
    (ids, pos, mask, index), buffers = _cached_example(layers, heads, dim, weight.dtype, weight.device)
    wide = torch.zeros(2, 3, draft.fc.in_features, dtype=weight.dtype, device=weight.device)
    batch, width = _big("batch"), _big("width")
    context = GraphPlan(
        DFLASH_CONTEXT_SPEC,
        DFlashContextGraph(draft),
        (wide, torch.arange(3, device=weight.device).expand(2, 3).contiguous()),
        {"hidden_states": {0: batch, 1: width}, "position_ids": {0: batch, 1: width}},
    )
    dims = _cache_dims(layers)
    del dims["hidden_states"]
    block = GraphPlan(
        DFLASH_BLOCK_SPEC.with_layers(layers),
        DFlashBlockGraph(draft, embed_tokens, lm_head),
        (ids, pos, mask, index, *buffers),
        dims,
    )
    return [context, block]


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
    plans = [
        GraphPlan(
            MOA_MEMORY_SPEC,
            MoAMemoryGraph(draft),
            (kv, pos),
            {"target_kv": {0: batch, 1: width}, "position_ids": {0: batch, 1: width}},
        )
    ]
    _, heads, dim = draft.attention_shape
    (ids, pos, mask, index), buffers = _cached_example(1, heads, dim, dtype, dev, bsz, q, past)
    mk = torch.zeros(bsz, heads, mem, dim, dtype=dtype, device=dev)
    mmask = torch.ones(bsz, mem, dtype=torch.bool, device=dev)
    dims = _cache_dims(1)
    dims.update(
        memory_keys={0: dims["input_ids"][0], 2: memory},
        memory_values={0: dims["input_ids"][0], 2: memory},
        memory_mask={0: dims["input_ids"][0], 1: memory},
    )
    plans.append(
        GraphPlan(
            MOA_STEP_SPEC.with_layers(1), MoAStepGraph(draft), (ids, pos, mask, mk, mk.clone(), mmask, *buffers), dims
        )
    )
    hidden = torch.zeros(bsz, q, target.hidden_size, dtype=dtype, device=dev)
    if draft.tli == 0:
        dims = {"hidden_states": {0: batch, 1: width}, "logits_index": {0: batch, 1: _big("selected")}}
        plans.append(GraphPlan(LM_HEAD_SPEC, LMHeadGraph(target.lm_head), (hidden, index), dims))
    else:
        (_, pos, mask, index), buffers = _cached_example(
            draft.tli, target.num_kv_heads, target.head_dim, dtype, dev, bsz, q, past
        )
        plans.append(
            GraphPlan(
                TAIL_SPEC.with_layers(draft.tli),
                TargetTailGraph(target, draft.tli),
                (hidden, pos, mask, index, *buffers),
                _cache_dims(draft.tli),
            )
        )
    return plans
