"""The backend contract: what the generation loop, the drafters and the model layers ask of a target step, a
draft step and a cache.

Every backend implements these: the PyTorch modules (``TargetModel``, ``TorchFeatureStep``, ``TorchMoAStep``,
``MedusaHeads``) and the ONNX Runtime graphs (``runtime/ort/backend.py``); the ONNX export runs the PyTorch
modules over a ``GraphCache`` (``runtime/ort/graphs.py``), which implements ``LayerCache`` with the past keys and
values as graph inputs. A new backend implements the protocols below and registers its drafters in
``runtime/registry.py``; nothing else in the loop, the server or the client-server code changes.

Shapes: B rows, Q new tokens per row, P pending slots a new token may see (the earlier levels of a draft tree
plus the Q new tokens themselves, so the new tokens' own slots start at ``P - Q`` past each row's committed
length), K key slots attended to, d model width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from specdec_kit.runtime.core.coupling import DrawCoupling
    from specdec_kit.runtime.core.kv_cache import KVCache
    from specdec_kit.runtime.drafts.layers import PromptVocab


class AttentionWindow(Protocol):
    """One forward's view of a cache, as attention layers use it: the mask, and where each layer's new keys and
    values go and what they attend to."""

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' keys/values [B, H_kv, Q, D] of ``layer`` and attend their queries [B, H, Q, D] to
        every key they may see (grouped-query when H > H_kv); returns [B, H, Q, D]."""
        ...


@runtime_checkable
class LayerCache(Protocol):
    """Anything model layers can attend over: the runtime's ``KVCache`` or an export's ``GraphCache``."""

    def window(self, pending_mask: torch.Tensor) -> AttentionWindow:
        """The window of one forward of Q new tokens; ``pending_mask`` [B, Q, P] says which of the P pending slots
        each new token sees (the last Q are the new tokens themselves); committed slots are always visible."""
        ...


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, Q', V] (Q' = Q, or the number of positions asked for)
    features: torch.Tensor  # [B, Q, F]: F = d (last layer), or k x d (k tapped layers, EAGLE-3)


@runtime_checkable
class TargetStep(Protocol):
    """The target as the loop drives it: one tree-verification forward over the runtime's ``KVCache``."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int
    feature_size: int  # the width F of the features a forward returns
    # torch's intra-op threads while the loop drives this target (None: leave them): a target whose compute runs in
    # pools of its own (ONNX Runtime on CPU) sets 1, so that torch's workers, spinning after the loop's small ops,
    # do not take the cores from those pools' next call
    glue_threads: int | None

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def eos_token_ids(self) -> list[int]: ...

    def new_cache(self, batch: int, capacity: int) -> KVCache: ...

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: KVCache,
        logits_at: torch.Tensor | None = None,
    ) -> TargetOutput:
        """tokens, positions [B, Q]; pending_mask [B, Q, Q]; new K/V land in the pending slots ``lengths + [0, Q)``
        (``cache.commit`` keeps the accepted ones); ``logits_at`` [B, Q'] selects the positions that need logits."""
        ...


@runtime_checkable
class FeatureStep(Protocol):
    """One cached step of an EAGLE/HASS/GRIFFIN draft, ending in logits (the target's LM head included)."""

    @property
    def dtype(self) -> torch.dtype: ...

    def new_cache(self, batch: int, capacity: int) -> KVCache: ...

    def __call__(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: KVCache,
        logits_at: torch.Tensor | None = None,
        vocab: PromptVocab | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, Q, F] paired with the tokens [B, Q] after them -> (logits [B, Q' or Q, V], the regression
        features [B, Q, d] the next step takes as its feature input). F is the target's feature width on a context
        step and the draft's own d on later steps (they differ for EAGLE-3, which fuses k target layers). ``vocab``:
        tokens that join a reduced draft vocabulary, per row (only a drafter whose head has one passes it)."""
        ...


@runtime_checkable
class BlockStep(Protocol):
    """A DFlash draft: the context's keys and values come from the target's states alone (no attention), and one
    block of tokens attends over them and over itself."""

    @property
    def dtype(self) -> torch.dtype: ...

    def new_cache(self, batch: int, capacity: int) -> KVCache: ...

    def context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        """features [B, W, F] (the target's tapped layers) at ``positions`` [B, W] -> their keys/values written to
        the cache's first W pending slots (the caller commits them)."""
        ...

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: KVCache,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block's tokens [B, Q] -> logits [B, Q' or Q, V] (the target's LM head), seeing the committed context
        and the pending slots ``pending_mask`` [B, Q, Q] allows."""
        ...


@runtime_checkable
class WholeTreeStep(Protocol):
    """A ``FeatureStep`` that can also run a draft's whole cycle in one call for some trees: the context step and the
    dynamic tree search (an ONNX Runtime engine's ``draft_tree`` graph). Per-call overhead, not arithmetic, dominates
    small draft steps on a CPU; one call per cycle removes all but one."""

    def drafts_whole(self, tree: object) -> bool:
        """Whether ``whole_tree`` drafts ``tree`` (a graph is exported for one tree)."""
        ...

    def whole_tree(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pending_mask: torch.Tensor,
        cache: KVCache,
        root_index: torch.Tensor,
        coupling: DrawCoupling | None = None,
        vocab: PromptVocab | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The context pairs as for ``__call__`` (their keys/values written to the cache's pending slots), and from each
        row's root pair (``root_index`` [B]) the tree -> (node tokens [B, N], node parents [B, N], node path scores
        [B, N] as ``scored_tree_search`` gives them, node 0 the root); sampled rows' children ranked by their draws
        where a ``coupling`` is given and the step can read it."""
        ...


@runtime_checkable
class TokenStep(Protocol):
    """One cached step of a draft that reads tokens only (Mixture of Attentions: its memory of the target's K/V
    is the step's own state, updated once per cycle)."""

    @property
    def dtype(self) -> torch.dtype: ...

    def new_cache(self, batch: int, capacity: int) -> KVCache: ...

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, pending_mask: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [B, Q, V], the predicted activations [B, Q, d] of the step)."""
        ...


@runtime_checkable
class MedusaStep(Protocol):
    """Medusa heads: the last verified feature [B, d] -> logits of every head [B, heads, V]."""

    num_heads: int

    def __call__(self, features: torch.Tensor) -> torch.Tensor: ...
