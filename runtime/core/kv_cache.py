"""Preallocated key/value cache shared by the target and the feature drafts.

Layout ``[layers, batch, kv_heads, capacity, head_dim]``; every row keeps its own committed length,
so a batch may hold sequences of different lengths without padding the prefix. New tokens are
written *after* a row's committed length (optionally past ``offset`` pending slots), may see any
committed slot plus the pending slots their mask allows, and only become part of the sequence when
``commit`` copies the accepted ones into place, which is the KV compaction of tree decoding.
A cache that graphs read in place (the ONNX Runtime engines bind each layer's whole buffer) grows in
``block``-slot steps instead of doubling, so the slots a graph reads beyond the longest row stay few.
The cache is an inference-only structure: every method that allocates or mutates runs in
``torch.inference_mode`` so callers need not remember to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec_kit.runtime.core.trees import walked_on_cpu


@dataclass
class KVCache:
    keys: torch.Tensor  # [L, B, H, S, D]
    values: torch.Tensor  # [L, B, H, S, D]
    lengths: torch.Tensor  # [B] int64, committed tokens per row
    block: int = 0  # grow to a multiple of this many slots (0: double)
    key_store: torch.Tensor | None = None  # [L, B' >= B, H, S, D] when ``keys`` is its first B rows (room to join)
    value_store: torch.Tensor | None = None

    @classmethod
    @torch.inference_mode()
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block: int = 0,
    ) -> "KVCache":
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        return cls(
            keys=torch.zeros(shape, dtype=dtype, device=device),
            values=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch, dtype=torch.long, device=device),
            block=block,
        )

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @torch.inference_mode()
    def ensure_capacity(self, needed: int) -> None:
        """Grow so that slot ``needed - 1`` exists: by doubling (rarely taken, amortised O(1)), or to the next
        multiple of ``block``."""
        if needed <= self.capacity:
            return
        new_cap = -(-needed // self.block) * self.block if self.block else max(needed, 2 * self.capacity)
        pad = new_cap - self.capacity
        shape = list(self.keys.shape)
        shape[3] = pad
        zeros = self.keys.new_zeros(shape)
        self.keys = torch.cat([self.keys, zeros], dim=3)
        self.values = torch.cat([self.values, zeros.clone()], dim=3)
        self.key_store = self.value_store = None  # the grown tensors are stores of their own rows

    def slots(self, num_new: int, offset: int = 0) -> torch.Tensor:
        """Absolute slot of each new token: ``lengths[b] + offset + i``; shape [B, num_new]."""
        ar = torch.arange(num_new, device=self.lengths.device)
        return self.lengths[:, None] + offset + ar[None, :]

    def _visible_slots(self, pending_mask: torch.Tensor, k_len: int, num_pending: int) -> torch.Tensor:
        """[B, Q, K] over slots ``[0, K)``: committed slots, plus the first ``num_pending`` pending slots
        ``lengths[b] + [0, num_pending)`` where ``pending_mask`` allows them."""
        bsz, q_len, _ = pending_mask.shape
        key_pos = torch.arange(k_len, device=pending_mask.device)
        rel = key_pos[None, :] - self.lengths[:, None]  # [B, K]
        visible = (rel < 0)[:, None, :].expand(bsz, q_len, k_len)
        if num_pending == 0:
            return visible
        in_pending = (rel >= 0) & (rel < num_pending)
        gathered = torch.gather(pending_mask, 2, rel.clamp(0, num_pending - 1)[:, None, :].expand(bsz, q_len, k_len))
        return visible | (in_pending[:, None, :] & gathered)

    def attention_mask(self, pending_mask: torch.Tensor, k_len: int) -> torch.Tensor | None:
        """Boolean mask [B, 1, Q, K] over slots ``[0, K)`` for Q new tokens (None: all visible).

        ``pending_mask`` [B, Q, P] says which of the P pending slots ``lengths[b] + [0, P)`` each new
        token sees (the new tokens themselves are the last Q of them); committed slots are always
        visible. ``k_len`` = K = ``key_length(P)``, computed once per forward by the caller.
        """
        bsz, q_len, p_len = pending_mask.shape
        if bsz == 1 and q_len == 1 and p_len == 1:  # one token of one sequence sees all: no mask needed
            return None
        return self._visible_slots(pending_mask, k_len, p_len)[:, None, :, :]

    def buffer_and_new_mask(self, pending_mask: torch.Tensor) -> torch.Tensor:
        """For graphs that read each layer's whole buffer in place and the new tokens' keys beside it (the ONNX
        engines): the mask [B, Q, capacity + Q], after growing the cache so the new tokens' slots exist. Slots
        past a row's length and its visible pending slots (stale or empty) are masked out.

        ``pending_mask`` [B, Q, offset + Q] as for ``attention_mask``; its last Q columns are the new
        tokens, the first ``offset`` the pending slots already written (earlier levels of a draft tree)."""
        q_len = pending_mask.shape[1]
        offset = pending_mask.shape[2] - q_len
        self.ensure_capacity(self.key_length(offset) + q_len)
        visible = self._visible_slots(pending_mask[..., :offset], self.capacity, offset)
        return torch.cat([visible, pending_mask[..., offset:]], dim=2)

    def slot_mask(self, pending_mask: torch.Tensor) -> torch.Tensor:
        """For graphs that write the new tokens into each layer's buffer themselves and attend over the whole buffer
        (the ONNX target step): the mask [B, Q, capacity] over slots, after growing the cache so the new tokens'
        slots exist. ``pending_mask`` [B, Q, offset + Q] as for ``attention_mask``."""
        p_len = pending_mask.shape[2]
        self.ensure_capacity(self.key_length(p_len))
        return self._visible_slots(pending_mask, self.capacity, p_len)

    def window(self, pending_mask: torch.Tensor) -> "CacheWindow":
        """One forward of Q new tokens (``LayerCache``): their pending slots start at ``lengths + P - Q``; the
        cache grows first if they would not fit."""
        q_len, p_len = pending_mask.shape[1], pending_mask.shape[2]
        k_len = self.key_length(p_len)  # one host sync per forward
        self.ensure_capacity(k_len)
        return CacheWindow(self, self.slots(q_len, p_len - q_len), self.attention_mask(pending_mask, k_len), k_len)

    def key_length(self, num_pending: int) -> int:
        """How many slots attention must read: up to the longest row's last pending slot."""
        return int(self.lengths.max().item()) + num_pending

    @torch.inference_mode()
    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter new keys/values [B, H, Q, D] into ``slots`` [B, Q]."""
        idx = slots[:, None, :, None].expand(-1, k_new.shape[1], -1, k_new.shape[3])
        self.keys[layer].scatter_(2, idx, k_new)
        self.values[layer].scatter_(2, idx, v_new)

    @torch.inference_mode()
    def write_all(self, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor, first_layer: int = 0) -> None:
        """Scatter new keys/values [n, B, H, Q, D] of layers ``first_layer`` .. + n into ``slots`` [B, Q] at once."""
        n = k_new.shape[0]
        idx = slots[None, :, None, :, None].expand(n, -1, k_new.shape[2], -1, k_new.shape[4])
        self.keys[first_layer : first_layer + n].scatter_(3, idx, k_new)
        self.values[first_layer : first_layer + n].scatter_(3, idx, v_new)

    def view(self, layer: int, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer, :, :, :k_len], self.values[layer, :, :, :k_len]

    @torch.inference_mode()
    def commit(self, pending_index: torch.Tensor, counts: torch.Tensor) -> None:
        """Make pending slots part of each row's sequence.

        ``pending_index`` [B, A]: for row b, its j-th newly committed token is the one in pending slot
        ``lengths[b] + pending_index[b, j]`` (j < counts[b]; the rest is ignored). The entries are
        copied to ``lengths[b] + j`` and ``lengths`` grows by ``counts``.
        """
        if pending_index.numel() == 0:
            return
        if walked_on_cpu(self.lengths, *pending_index.shape):
            self._move_listed(pending_index.tolist(), counts.tolist())
        else:
            self._move_gathered(pending_index, counts)
        self.lengths += counts

    def _move_gathered(self, pending_index: torch.Tensor, counts: torch.Tensor) -> None:
        """``commit``'s copies for every row at once, by gather and scatter (any device, any batch)."""
        ar = torch.arange(pending_index.shape[1], device=pending_index.device)
        valid = ar[None, :] < counts[:, None]
        src_rel = torch.where(valid, pending_index, ar[None, :])
        if bool((src_rel != ar[None, :]).any()):
            src = self.lengths[:, None] + src_rel
            dst = self.lengths[:, None] + ar[None, :]
            num_layers, _, heads, _, dim = self.keys.shape
            shape = (num_layers, -1, heads, src.shape[1], dim)
            src_idx = src[None, :, None, :, None].expand(shape)
            dst_idx = dst[None, :, None, :, None].expand(shape)
            for tensor in (self.keys, self.values):
                moved = torch.gather(tensor, 3, src_idx)
                tensor.scatter_(3, dst_idx, moved)

    def _move_listed(self, pending_index: list[list[int]], counts: list[int]) -> None:
        """``commit``'s copies for a few rows on the CPU, listed in Python: only the entries that move, each row's
        in one indexed copy (its sources read before any is written, as ``_move_gathered`` reads them), where the
        gathered form runs a dozen tensor operations whatever moves."""
        for b, (row, count, length) in enumerate(zip(pending_index, counts, self.lengths.tolist())):
            moved = [(length + j, length + src) for j, src in enumerate(row[:count]) if src != j]
            if moved:
                dst, src = (list(x) for x in zip(*moved))
                for tensor in (self.keys, self.values):
                    tensor[:, b, :, dst] = tensor[:, b, :, src]

    @torch.inference_mode()
    def advance(self, counts: torch.Tensor) -> None:
        """``commit`` of each row's first ``counts`` pending slots in order: they already hold the sequence's next
        entries, so nothing moves."""
        self.lengths += counts

    @torch.inference_mode()
    def extend_rows(self, other: "KVCache") -> None:
        """Append ``other``'s rows (requests joining a running batch); capacities are padded to the larger. The
        rows are written into room kept after the batch's (grown by doubling), not into a copy of the whole cache:
        at 16 rows a copy per join (and per leave) had cost more than a fifth of a cycle."""
        self.ensure_capacity(other.capacity)
        keys, values = other.keys, other.values
        if other.capacity < self.capacity:
            shape = list(keys.shape)
            shape[3] = self.capacity - other.capacity
            keys = torch.cat([keys, keys.new_zeros(shape)], dim=3)
            values = torch.cat([values, values.new_zeros(shape)], dim=3)
        rows, added = self.batch, other.batch
        key_store, value_store = self._stores_with_room(added)
        key_store[:, rows : rows + added] = keys
        value_store[:, rows : rows + added] = values
        self._use_rows(key_store, value_store, rows + added)
        self.lengths = torch.cat([self.lengths, other.lengths])

    def _stores_with_room(self, added: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensors whose first rows hold this batch's and that have room for ``added`` more."""
        key_store, value_store = self._stores()
        rows = self.batch
        if key_store.shape[1] >= rows + added:
            return key_store, value_store
        shape = list(self.keys.shape)
        shape[1] = max(rows + added, 2 * rows)
        grown_keys, grown_values = self.keys.new_zeros(shape), self.values.new_zeros(shape)
        grown_keys[:, :rows] = self.keys
        grown_values[:, :rows] = self.values
        return grown_keys, grown_values

    def _stores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors the batch's rows live in: the stores with room, or the keys and values themselves."""
        if self.key_store is None:
            return self.keys, self.values
        return self.key_store, self.value_store

    def _use_rows(self, key_store: torch.Tensor, value_store: torch.Tensor, rows: int) -> None:
        """The batch is the first ``rows`` rows of these stores (each layer's rows stay one contiguous block, which
        the graphs bind in place)."""
        self.key_store, self.value_store = key_store, value_store
        self.keys, self.values = key_store[:, :rows], value_store[:, :rows]

    @torch.inference_mode()
    def load_prefix(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row ``row``, empty so far, starts with these committed keys/values [L, H, n, D] (a cached prompt prefix)."""
        if int(self.lengths[row]):
            raise ValueError(f"load_prefix: row {row} already holds {int(self.lengths[row])} tokens")
        n = keys.shape[2]
        self.ensure_capacity(n)
        self.keys[:, row, :, :n] = keys
        self.values[:, row, :, :n] = values
        self.lengths[row] = n

    @staticmethod
    def with_rows(cache: "KVCache | None", fresh: "KVCache") -> "KVCache":
        """``cache`` with ``fresh``'s rows appended, or ``fresh`` itself when there is no cache yet."""
        if cache is None:
            return fresh
        cache.extend_rows(fresh)
        return cache

    @torch.inference_mode()
    def truncate(self, lengths: torch.Tensor | int) -> None:
        """Roll every row back to ``lengths`` committed tokens (a checkpoint taken earlier); the slots past it
        become pending again and are overwritten by the next forward."""
        new = torch.as_tensor(lengths, dtype=self.lengths.dtype, device=self.lengths.device).expand_as(self.lengths)
        if bool((new > self.lengths).any()):
            raise ValueError(f"truncate: lengths {new.tolist()} exceed the committed {self.lengths.tolist()}")
        self.lengths = new.clone()

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (e.g. drop finished sequences from the running batch), in that order: the rows that
        change place are moved in place, so an order that fills the leavers' places from the end moves only as
        many rows as left. A block-grown cache whose longest remaining row no longer needs its last slots is
        copied into a narrower one instead (the slots a graph reads stay few)."""
        self.lengths = self.lengths[rows].clone()
        keep = self.capacity
        if self.block and len(self.lengths):
            keep = min(keep, max(self.block, -(-int(self.lengths.max()) // self.block) * self.block))
        if keep < self.capacity or not len(rows):
            self.keys = self.keys[:, rows, :, :keep].contiguous()
            self.values = self.values[:, rows, :, :keep].contiguous()
            self.key_store = self.value_store = None
            return
        key_store, value_store = self._stores()
        places = torch.arange(len(rows), device=rows.device)
        moved = rows != places
        if bool(moved.any()):
            source, target = rows[moved], places[moved]
            key_store[:, target] = key_store[:, source]
            value_store[:, target] = value_store[:, source]
        self._use_rows(key_store, value_store, len(rows))


@dataclass
class CacheWindow:
    """``AttentionWindow`` over a ``KVCache``: new keys/values are scattered into their slots, attention reads the
    first ``k_len`` slots under ``mask``."""

    cache: KVCache
    slots: torch.Tensor  # [B, Q]
    mask: torch.Tensor | None
    k_len: int

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, keys, values, self.slots)
        past_keys, past_values = self.cache.view(layer, self.k_len)
        return F.scaled_dot_product_attention(
            queries, past_keys, past_values, attn_mask=self.mask, enable_gqa=queries.shape[1] != keys.shape[1]
        )
