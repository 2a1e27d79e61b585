"""Checkpoint key -> (parameter, shard) for the kit's drafts in vLLM (no vLLM import: the kit's tests check this
table against the exporter's weight map without vLLM installed)."""

from __future__ import annotations

# checkpoint name fragment -> (vLLM parameter fragment, shard id) for the decoder layers' fused projections
STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}

# parameters a checkpoint may leave out: vLLM then shares the target's embedding (the LM head always is)
OPTIONAL = frozenset({"model.embed_tokens.weight"})


def parameter_for(name: str) -> tuple[str, str | int | None]:
    """Where checkpoint tensor ``name`` goes: decoder layers fuse q/k/v and gate/up; TGF (``fc.*``) does not."""
    if name.startswith("layers."):
        for fragment, (fused, shard) in STACKED.items():
            if fragment in name:
                return "model." + name.replace(fragment, fused), shard
    return "model." + name, None
