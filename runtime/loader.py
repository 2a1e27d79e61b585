"""From paths and names to a ready ``SpeculativeGenerator``: the one place that wires the parts."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec_kit.runtime.drafting import Drafter, FeatureDraftStep, FeatureTreeDrafter, MedusaDrafter, NoDrafter
from specdec_kit.runtime.drafts.loading import DRAFT_KINDS, load_draft
from specdec_kit.runtime.target import TargetModel
from specdec_kit.runtime.trees import DynamicTreeConfig, StaticTree, parse_tree_spec

DEFAULT_TREES = {"medusa": "static:mc_sim_7b_63", "eagle": "static:eagle1_default"}


def resolve_tree(kind: str, spec: str | None, total_tokens: int | None, depth: int | None, top_k: int | None):
    """The tree a draft kind uses: EAGLE-1 and Medusa default to their static trees, the others dynamic."""
    tree = parse_tree_spec(spec or DEFAULT_TREES.get(kind, "dynamic"))
    if isinstance(tree, DynamicTreeConfig):
        tree = DynamicTreeConfig(
            total_tokens=total_tokens or tree.total_tokens, depth=tree.depth if depth is None else depth,
            top_k=top_k or tree.top_k,
        )
    elif kind != "medusa" and any(v is not None for v in (total_tokens, depth, top_k)):
        raise ValueError("--total-tokens/--depth/--top-k apply to dynamic trees only")
    return tree


def default_tree(kind: str, dynamic: DynamicTreeConfig, medusa_spec: str) -> StaticTree | DynamicTreeConfig:
    """Each kind's usual tree when running several kinds side by side: EAGLE-1 its static tree, Medusa
    ``medusa_spec``, the dynamic-tree methods (EAGLE-2, HASS, GRIFFIN) ``dynamic``."""
    if kind == "medusa":
        return parse_tree_spec(medusa_spec)
    return parse_tree_spec(DEFAULT_TREES[kind]) if kind in DEFAULT_TREES else dynamic


def make_drafter(target: TargetModel, kind: str, draft_path: str | Path | None, tree) -> Drafter:
    if kind == "none":
        return NoDrafter()
    if kind not in DRAFT_KINDS:
        raise ValueError(f"unknown draft {kind!r}; expected one of {['none', *DRAFT_KINDS]}")
    if draft_path is None:
        raise ValueError(f"draft {kind!r} needs a checkpoint directory")
    shape = (target.num_layers, 2 * target.num_kv_heads * target.head_dim)
    module = load_draft(draft_path, kind, target.hidden_size, target.vocab_size, dtype=target.dtype, device=target.device,
                        target_shape=shape)
    if kind == "medusa":
        if not isinstance(tree, StaticTree):
            raise ValueError("Medusa heads draft static trees only (e.g. static:mc_sim_7b_63)")
        return MedusaDrafter(module, tree)
    if kind == "moa":
        from specdec_kit.runtime.moa_drafting import MoAStep, MoATreeDrafter

        return MoATreeDrafter(MoAStep(module, target), tree)
    return FeatureTreeDrafter(FeatureDraftStep(module, target.lm_head), tree)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: no usable tokenizer ({exc})") from exc


def set_threads() -> None:
    """Use every core for intra-op parallelism on CPU (torch's default may be fewer in containers)."""
    import os

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, os.cpu_count() or 1))
