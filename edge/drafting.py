"""Client-side drafters: the runtime's tree drafters fed by activations that arrive over the network.

Per verified position the server sends what the draft needs (``edge/activations.py``): EAGLE/HASS/GRIFFIN
the target's last-layer feature; a Mixture-of-Attentions draft the LSA output (LSA reads all of the
target's layers, so it runs next to them) and, for TLI = N, the K/V of the target's last N layers, which
go into the client's tail cache (``edge/tail.py``). Each drafter also

* steps alone (``offline_next``) when the server cannot be reached: EAGLE-style drafts feed their own
  predicted features back, MoA drafts let the tail layers write predicted K/V and keep their CA memory at
  the last verified position (the K-step bounded attention they were trained for);
* rolls back (``mark`` / ``rollback``) to the last verified state when the offline guesses are verified
  after the server returns, or when a verification call fails.

The drafter keeps a pending context (verified activations paired with the tokens after them) that the
next ``draft`` or ``offline_next`` consumes; ``absorb`` replaces it after a normal cycle and appends to it
when it was never consumed (a rollback restored the state from before it was absorbed).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.decoding.draft_context import DraftContext
from specdec_kit.runtime.decoding.drafting import Drafter, DraftTree, NoDrafter
from specdec_kit.runtime.decoding.moa_drafting import MoATreeDrafter, TorchMoAStep


class EdgeDrafter:
    """Wraps a runtime ``Drafter`` (batch of one) for client-server drafting; see the module docstring."""

    source = "features"  # which server activation source feeds this draft
    can_draft_offline = True

    def __init__(self, drafter: Drafter, device: torch.device, dtype: torch.dtype):
        self.drafter, self.device, self.dtype = drafter, device, dtype
        self.ctx: DraftContext | None = None
        self.consumed = True

    # -- state -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, capacity: int) -> None:
        self.drafter.reset(1, capacity)
        self.ctx, self.consumed = None, True

    def mark(self) -> tuple:
        """The state to come back to: the drafter's checkpoint plus the pending context."""
        return self.drafter.checkpoint(), self.ctx, self.consumed

    def rollback(self, mark: tuple) -> None:
        checkpoint, self.ctx, self.consumed = mark
        self.drafter.restore(checkpoint)

    def _set_context(self, feats: torch.Tensor, tokens: list[int]) -> None:
        tok = torch.tensor([tokens], dtype=torch.long, device=self.device)
        counts = torch.tensor([len(tokens)], dtype=torch.long, device=self.device)
        feats = feats.to(self.device, self.dtype)[None]
        if self.consumed or self.ctx is None:
            self.ctx = DraftContext.of(feats, tok, counts)
        else:
            self.ctx = self.ctx.append(feats, tok, counts)
        self.consumed = False

    # -- per cycle -------------------------------------------------------------------------------
    @torch.inference_mode()
    def absorb(self, activations: list[torch.Tensor], tokens: list[int]) -> None:
        """Activations of newly verified positions ([A, width] each), paired with the A tokens after them."""
        self._set_context(activations[0], tokens)

    @torch.inference_mode()
    def draft(self) -> DraftTree:
        c = self.ctx
        tree = self.drafter.draft(c.feats, c.tokens, c.counts)
        self.consumed = True
        return tree

    @torch.inference_mode()
    def offline_next(self) -> int:
        """One token from the draft alone (its greedy choice), its own prediction becoming the next context."""
        c = self.ctx
        root_logp, root_prediction = self.drafter.context_step(c.feats, c.tokens, c.counts)
        self.consumed = True
        token = int(root_logp[0].argmax())
        self._set_context(root_prediction, [token])
        return token


class EdgePlain(EdgeDrafter):
    """No draft: every call verifies the root alone (a remote API's one call per token)."""

    source = "none"
    can_draft_offline = False

    def __init__(self, device: torch.device):
        super().__init__(NoDrafter(), device, torch.float32)

    @torch.inference_mode()
    def absorb(self, activations: list[torch.Tensor], tokens: list[int]) -> None:
        self._set_context(torch.zeros(len(tokens), 0), tokens)

    def offline_next(self) -> int:
        raise RuntimeError("plain decoding has no draft to continue from")


class EdgeMoA(EdgeDrafter):
    """A Mixture-of-Attentions draft over a client tail of the target's last TLI layers."""

    def __init__(self, drafter: MoATreeDrafter, tail, source: str):
        super().__init__(drafter, tail.device, drafter.step.dtype)
        self.tail, self.source = tail, source
        self.tli = drafter.step.draft.tli
        self.tail_cache: KVCache | None = None

    def mark(self) -> tuple:
        """The drafter's state plus the tail cache's length (offline steps write predicted K/V into it)."""
        return super().mark(), self.tail_cache.lengths.clone()

    def rollback(self, mark: tuple) -> None:
        inner, tail_lengths = mark
        super().rollback(inner)
        self.tail_cache.truncate(tail_lengths)

    @torch.inference_mode()
    def start(self, capacity: int) -> None:
        super().start(capacity)
        self.tail_cache = self.tail.new_cache(1, capacity)
        self.drafter.bind(self.tail_cache)

    @torch.inference_mode()
    def absorb(self, activations: list[torch.Tensor], tokens: list[int]) -> None:
        """LSA outputs (and the tail layers' K/V) of the verified positions: into the tail cache and the CA
        memory now, the tokens into the pending context."""
        count = torch.tensor([len(tokens)], dtype=torch.long, device=self.device)
        tc = self.tail_cache
        tc.ensure_capacity(int(tc.lengths.max()) + len(tokens))
        if self.tli:  # a tail of no layers keeps positions only
            kv = activations[1].to(self.device, self.tail.dtype)  # [A, N * H * 2D]
            _, _, heads, _, dim = tc.keys.shape
            kv = kv.view(len(tokens), self.tli, heads, 2 * dim).permute(1, 2, 0, 3)[:, None]  # [N, 1, H, A, 2D]
            tc.write_all(kv[..., :dim], kv[..., dim:], tc.slots(len(tokens)))
        tc.commit(torch.arange(len(tokens), device=self.device)[None], count)
        step: TorchMoAStep = self.drafter.step
        pos = self.tail_cache.lengths[:, None] - count[:, None] + torch.arange(len(tokens), device=self.device)[None]
        keys, values = step.project_memory(activations[0].to(self.device, step.dtype)[None], pos)
        self.drafter.append_memory(keys, values, count)
        self._set_context(activations[0], tokens)

    def _set_context(self, feats: torch.Tensor, tokens: list[int]) -> None:
        """A MoA draft reads no per-position features: its context is the tokens alone."""
        super()._set_context(feats.new_zeros(len(tokens), 0), tokens)

    @torch.inference_mode()
    def offline_next(self) -> int:
        """The tail layers' K/V at the root's position (written by the step) stay in the tail cache as the best
        available guess of the target's; the CA memory stays at the last verified position."""
        token = super().offline_next()
        self.tail_cache.commit(
            torch.zeros(1, 1, dtype=torch.long, device=self.device), torch.ones(1, dtype=torch.long, device=self.device)
        )
        return token


def make_edge_drafter(
    kind: str, target_path, draft_path, tree, dtype=None, device=None, source: str | None = None
) -> EdgeDrafter:
    """The client's drafter from checkpoints on the client: the draft head plus the target's tail (its last TLI
    layers for a Mixture-of-Attentions head, else the LM head alone)."""
    from transformers import AutoConfig

    from specdec_kit.edge.tail import load_target_tail
    from specdec_kit.runtime.checkpoint import load_draft
    from specdec_kit.runtime.core.device import resolve_device
    from specdec_kit.runtime.registry import draft_kind

    if kind == "none":
        return EdgePlain(resolve_device(device))
    family = draft_kind(kind).family
    config = AutoConfig.from_pretrained(target_path)
    kv_dim = (
        2
        * (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    )
    module = load_draft(
        Path(draft_path), kind, config.hidden_size, config.vocab_size, target_shape=(config.num_hidden_layers, kv_dim)
    )
    tail = load_target_tail(target_path, int(getattr(module, "tli", 0)), dtype=dtype, device=device)
    drafter = family.client_drafter(module.to(device=tail.device, dtype=tail.dtype), tail, tree)
    if isinstance(drafter, MoATreeDrafter):
        return EdgeMoA(drafter, tail, source or kind)
    return EdgeDrafter(drafter, tail.device, tail.dtype)
