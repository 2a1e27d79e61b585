"""Drafting with a Mixture-of-Attentions draft over the same tree search as EAGLE/GRIFFIN.

``MoATreeDrafter`` reuses ``FeatureTreeDrafter``'s static and dynamic trees; what differs is the
draft's state. Per cycle it (1) runs LSA once over the target's K/V of the newly verified positions and
appends the results to the CA memory, (2) runs the context tokens through SA and CA, and (3) for TLI = N
finishes each prediction with the target's last N layers over the target's own KV cache. Draft-time
target entries go to pending slots past the committed prefix (the root's at offset 0, tree level n's
after it), which verification overwrites, so the target's cache is never corrupted; losslessness does
not depend on the draft at all.

Slot conventions: the target holds positions [0, Lt) and the root sits at Lt; the SA cache's slot s
holds the token at target position s + 1, so after the context step both caches have length Lt and a
tree node at depth k has SA position Lt + k - 1 and target position Lt + k.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specdec_kit.runtime.core.contract import LayerCache
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.drafting import Drafter, DraftTree, FeatureTreeDrafter, last_real
from specdec_kit.runtime.drafts.moa import MoADraft


def moa_hidden(
    draft: MoADraft, tokens, positions, sa_pending: torch.Tensor, cache: LayerCache, mem_keys, mem_values, mem_visible
) -> torch.Tensor:
    """The draft body: SA over the tokens (``cache`` holds the earlier ones, ``sa_pending`` [B, Q, P] as in
    ``runtime/core/contract.py``), then CA to the memory keys/values [B, H, M, D] where ``mem_visible`` [B, M]; the
    runtime and the ONNX export share it."""
    emb = draft.embed_tokens(tokens)
    cos, sin = draft.rotary_emb(emb, positions)
    h = draft.sa(emb, cos, sin, cache.window(sa_pending))
    h = draft.ca(h, cos, sin, mem_keys, mem_values, mem_visible[:, None, None, :])
    return draft.output(h)


def verified_kv(cache: KVCache, counts: torch.Tensor, first_layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed K/V of each row's ``counts`` newest positions at layers ``first_layer``.. as
    [B, W, layers, heads * 2 * head_dim] (per head: key then value), with their positions [B, W]
    (W = the largest count; shorter rows are padded with repeats)."""
    keys, values = cache.keys[first_layer:], cache.values[first_layer:]
    layers, bsz, heads, _, dim = keys.shape
    width = int(counts.max().item())
    rel = torch.arange(width, device=counts.device)
    pos = (cache.lengths[:, None] - counts[:, None] + rel[None, :]).clamp(min=0)  # [B, W]
    idx = pos[None, :, None, :, None].expand(layers, bsz, heads, width, dim)
    kv = torch.cat([torch.gather(keys, 3, idx), torch.gather(values, 3, idx)], dim=-1)  # [L, B, H, W, 2D]
    return kv.permute(1, 3, 0, 2, 4).reshape(bsz, width, layers, heads * 2 * dim), pos


class MoAStep(ABC):
    """A Mixture-of-Attentions draft step (``TokenStep``): tokens through SA and CA (and TLI) to logits.

    Its state is the CA memory (keys/values of every verified position, one row per sequence) and the target
    cache its TLI layers write draft-time entries into (``bind_target``). Backends implement the four parts:
    the LSA memory update, the SA + CA body, the finish to logits, and the SA cache."""

    def __init__(self) -> None:
        self.memory: KVCache | None = None
        self.target_cache: KVCache | None = None

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @abstractmethod
    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A one-layer cache: the SA's keys/values, or (a second one) the CA memory."""

    @abstractmethod
    def memory_update(self, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """LSA over [B, W, L, kv_dim] target K/V at ``positions`` [B, W] -> CA memory keys/values [B, H, W, D]."""

    @abstractmethod
    def hidden(
        self, tokens: torch.Tensor, positions: torch.Tensor, pending_mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """SA over the token stream (cache + pending), then CA over all verified memory -> o_hat [B, Q, d]."""

    @abstractmethod
    def logits(self, o_hat: torch.Tensor, target_positions: torch.Tensor, target_pending: torch.Tensor) -> torch.Tensor:
        """o_hat -> logits: through the target's last TLI layers over ``target_cache`` (draft-time entries in its
        pending slots per ``target_pending``), then the LM head."""

    def bind_target(self, cache: KVCache) -> None:
        self.target_cache = cache

    def reset_memory(self, batch: int, capacity: int) -> None:
        self.memory = self.new_cache(batch, capacity)

    def memory_cache(self) -> KVCache:
        """The cross-attention memory, which ``reset_memory`` makes."""
        if self.memory is None:
            raise RuntimeError("the MoA draft's memory was read before reset_memory made it")
        return self.memory

    def bound_target_cache(self) -> KVCache:
        """The target's cache, which ``bind_target`` hands over (the TLI layers attend over it)."""
        if self.target_cache is None:
            raise RuntimeError("the MoA draft ran target layers before bind_target gave it the target's cache")
        return self.target_cache

    def memory_visible(self, device: torch.device) -> tuple[int, torch.Tensor]:
        """The memory width to read and which of its slots each row has filled ([B, M])."""
        lengths = self.memory_cache().lengths
        m_len = max(int(lengths.max().item()), 1)
        return m_len, torch.arange(m_len, device=device)[None, :] < lengths[:, None]

    def __call__(self, tokens, positions, pending_mask, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree level: in the target cache its entries sit after the root's, which every node sees."""
        o_hat = self.hidden(tokens, positions, pending_mask, cache)
        bsz, q_len = tokens.shape
        root = torch.ones(bsz, q_len, 1, dtype=torch.bool, device=tokens.device)
        return self.logits(o_hat, positions + 1, torch.cat([root, pending_mask], dim=2)), o_hat


class TorchMoAStep(MoAStep):
    """The PyTorch Mixture-of-Attentions step over a ``MoADraft`` and the target (or a client's target tail)."""

    def __init__(self, draft: MoADraft, target):
        super().__init__()
        self.draft, self.target = draft, target

    @property
    def dtype(self) -> torch.dtype:
        return self.draft.embed_tokens.weight.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return self.draft.new_cache(batch, capacity)

    def memory_update(self, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.project_memory(self.draft.lsa_memory(kv.to(self.dtype)), positions)

    def project_memory(self, memory: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """LSA outputs [B, W, d] at ``positions`` -> CA memory keys/values (client-server drafting receives
        the LSA outputs from the server and projects them here)."""
        cos, sin = self.draft.rotary_emb(memory, positions)
        return self.draft.ca.memory_kv(memory.to(self.dtype), cos, sin)

    def hidden(self, tokens, positions, pending_mask, cache: KVCache) -> torch.Tensor:
        m_len, visible = self.memory_visible(tokens.device)
        keys, values = self.memory_cache().view(0, m_len)
        return moa_hidden(self.draft, tokens, positions, pending_mask, cache, keys, values, visible)

    def logits(self, o_hat: torch.Tensor, target_positions: torch.Tensor, target_pending: torch.Tensor) -> torch.Tensor:
        d, t = self.draft, self.target
        feats = o_hat
        if d.tli:
            feats = t.run_layers(
                o_hat.to(t.dtype), target_positions, target_pending, self.bound_target_cache(), t.num_layers - d.tli
            )
        return t.lm_head(feats.to(t.dtype))


class MoATreeDrafter(FeatureTreeDrafter):
    """The tree search of ``FeatureTreeDrafter`` over a ``MoAStep``. ``lsa_from_target`` (in-process drafting)
    runs LSA over the bound target cache each cycle; a client-server client gets its memory from the server
    instead (``append_memory``)."""

    def __init__(self, step: MoAStep, tree: StaticTree | DynamicTreeConfig, lsa_from_target: bool = True):
        super().__init__(step, tree)
        self.lsa_from_target = lsa_from_target

    def reset(self, batch: int, capacity: int) -> None:
        super().reset(batch, capacity)
        self.step.reset_memory(batch, capacity)

    def bind(self, target_cache: KVCache) -> None:
        self.step.bind_target(target_cache)

    def owned_caches(self) -> list[KVCache]:
        return [self.cache, self.step.memory]

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.step.memory.select_rows(rows)

    def add_rows(self, count: int, capacity: int) -> None:
        super().add_rows(count, capacity)
        self.step.memory = KVCache.with_rows(self.step.memory, self.step.new_cache(count, capacity))

    def join(self, features, tokens, counts, capacity, prefix=None) -> bool:
        """The joining rows' context is read with the next draft: MoA's context step also reads the CA memory,
        which the target's verified K/V fills at that draft."""
        return Drafter.join(self, features, tokens, counts, capacity, prefix)

    def update_memory(self, counts: torch.Tensor) -> None:
        """LSA over the target K/V of each row's ``counts`` newest verified positions, into the CA memory."""
        kv, pos = verified_kv(self.step.target_cache, counts)
        self.append_memory(*self.step.memory_update(kv, pos), counts)

    def append_memory(self, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit CA memory keys/values [B, H, W, D] of each row's ``counts`` newest verified positions."""
        mem, width = self.step.memory, keys.shape[2]
        mem.ensure_capacity(int(mem.lengths.max().item()) + width)
        mem.write(0, keys, values, mem.slots(width))
        mem.commit(torch.arange(width, device=counts.device).expand(len(counts), width), counts)

    def _run_step(self, feats, tokens, positions, pending):
        """A MoA step reads tokens alone: the parents' activations live in its caches and memory."""
        return self.step(tokens, positions, pending, self.cache)

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> DraftTree:
        if self.lsa_from_target:
            self.update_memory(counts)
        return super().draft(features, tokens, counts)

    @torch.inference_mode()
    def context_step(self, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor):
        """SA over the context tokens (into the SA cache), CA over the memory, and the tail at the root's target
        position (its entry in the root's pending slot) -> the root's log-probs and predicted activation."""
        step, cache = self.step, self.cache
        bsz, q_len = tokens.shape
        ar = torch.arange(q_len, device=tokens.device)
        causal = (ar[None, :] <= ar[:, None]).expand(bsz, q_len, q_len)
        o_hat = step.hidden(tokens, cache.lengths[:, None] + ar[None, :], causal, cache)
        cache.commit(ar.expand(bsz, q_len), counts)
        root_o = last_real(o_hat, counts)[:, None]  # the root's prediction: the token after it
        root_pos = step.target_cache.lengths[:, None]
        alone = torch.ones(bsz, 1, 1, dtype=torch.bool, device=tokens.device)
        logits = step.logits(root_o, root_pos, alone)
        return self._logp(logits[:, 0]), root_o[:, 0]
