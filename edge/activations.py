"""What the server sends per verified position, by activation source (the client names one in OPEN).

* ``none``: nothing (plain decoding, one call per token: a remote API);
* ``features``: the target's last-layer feature (EAGLE/EAGLE-2/HASS/GRIFFIN drafts), width d;
* a Mixture-of-Attentions head: the LSA output (width d_draft; LSA reads the K/V of all L target layers, so
  it runs beside them and only its mean crosses the network, L x 2 x kv_dim -> d_draft) and, for TLI = N,
  the K/V of the target's last N layers (N x 2 x kv_dim) that the client's tail layers attend to.

A MoA source is tied to one trained head (its LSA weights); HELLO carries the digest of the head's
weights so a client with a different head is refused before it drafts anything.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.decoding.moa_drafting import verified_kv
from specdec_kit.runtime.drafts.moa import MoADraft


def weights_digest(draft_path: str | Path) -> str:
    """SHA-256 of a draft checkpoint's weights file(s), to check both ends hold the same head."""
    path = Path(draft_path)
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    if not files:
        raise ValueError(f"{path}: no weights file to identify the draft head")
    for file in files:
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


class ActivationSource:
    kind = "none"

    def describe(self) -> dict:
        return {"kind": self.kind, "widths": []}

    def __call__(self, features: torch.Tensor, cache: KVCache, count: int) -> list[torch.Tensor]:
        """features [A, d]: the target's features of the A newest committed positions; ``cache`` after commit."""
        return []


class FeatureSource(ActivationSource):
    kind = "features"

    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size

    def describe(self) -> dict:
        return {"kind": self.kind, "widths": [self.hidden_size]}

    def __call__(self, features, cache, count):
        return [features]


class MoASource(ActivationSource):
    kind = "moa"

    def __init__(self, draft: MoADraft, digest: str):
        self.draft, self.digest = draft, digest

    def describe(self) -> dict:
        d = self.draft
        return {
            "kind": self.kind,
            "tli": d.tli,
            "weights_sha256": self.digest,
            "widths": [d.config.hidden_size] + ([d.tli * d.target_kv_dim] if d.tli else []),
        }

    @torch.inference_mode()
    def __call__(self, features, cache, count):
        counts = torch.tensor([count], dtype=torch.long, device=cache.lengths.device)
        kv, _ = verified_kv(cache, counts)
        w = self.draft.embed_tokens.weight
        out = [self.draft.lsa_memory(kv.to(w.dtype))[0]]
        if self.draft.tli:  # the last TLI layers of the same gather
            out.append(kv[0, :, -self.draft.tli :].reshape(count, -1))
        return out
