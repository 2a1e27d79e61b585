"""From paths and names to a ready ``SpeculativeGenerator``: the one place that wires the parts."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree, parse_tree_spec
from specdec_kit.runtime.decoding.drafting import Drafter, NoDrafter
from specdec_kit.runtime.decoding.joined_vocab import keep_draft_vocabulary
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import draft_choices, draft_kind, hybrid_parts, lookup_drafter


def _default_tree_spec(kind: str) -> str:
    """A kind's registered tree (a hybrid's: its head's); plain decoding's is never drafted."""
    return "dynamic" if kind == "none" else draft_kind(hybrid_parts(kind)[0]).default_tree


def resolve_tree(
    kind: str,
    spec: str | None,
    total_tokens: int | None,
    depth: int | None,
    top_k: int | None,
    sized: dict | None = None,
):
    """The tree a draft kind uses: its registered default (EAGLE-1 and Medusa static, the others dynamic)
    unless ``spec`` names one; the dynamic-tree options apply to dynamic trees only, and ``sized`` (a CPU-sized
    tree: total_tokens, depth, top_k) fills the ones left open."""
    tree = parse_tree_spec(spec or _default_tree_spec(kind))
    if kind != "none" and not draft_kind(hybrid_parts(kind)[0]).sized_for_cpu:
        sized = None  # a CPU-sized tree saves draft calls per level: a model-free or one-call draft makes none
    if isinstance(tree, DynamicTreeConfig):
        base = DynamicTreeConfig(**sized) if sized else tree
        tree = DynamicTreeConfig(
            total_tokens=total_tokens or base.total_tokens,
            depth=base.depth if depth is None else depth,
            top_k=top_k or base.top_k,
        )
    elif any(v is not None for v in (total_tokens, depth, top_k)):
        raise ValueError(
            f"--total-tokens/--depth/--top-k apply to dynamic trees only; the {kind} tree is {spec or 'static'}"
        )
    return tree


def default_tree(kind: str, dynamic: DynamicTreeConfig, medusa_spec: str) -> StaticTree | DynamicTreeConfig:
    """Each kind's usual tree when running several kinds side by side: its registered static tree (EAGLE-1),
    ``medusa_spec`` for Medusa (usually a prefix of its full tree), ``dynamic`` for the dynamic-tree methods."""
    spec = _default_tree_spec(kind)
    if spec == "dynamic":
        return dynamic
    return parse_tree_spec(medusa_spec if draft_kind(hybrid_parts(kind)[0]).family.name == "medusa" else spec)


def head_kind(kind: str) -> str | None:
    """The kind whose checkpoint ``kind`` loads (a hybrid's head), or None when it loads none (plain decoding, a
    model-free kind)."""
    if kind == "none":
        return None
    head = hybrid_parts(kind)[0]
    return None if draft_kind(head).model_free else head


def load_draft_for(target: TargetModel, kind: str, draft_path: str | Path | None):
    """A draft checkpoint of ``kind`` loaded strictly against ``target`` (on its device, in its dtype); a model-free
    kind's settings (``draft_path`` optional)."""
    shape = (target.num_layers, 2 * target.num_kv_heads * target.head_dim)
    return load_draft(
        draft_path,
        kind,
        target.hidden_size,
        target.vocab_size,
        dtype=target.dtype,
        device=target.device,
        target_shape=shape,
        embedding=target.embed_tokens.weight,
    )


def make_drafter(
    target: TargetModel,
    kind: str,
    draft_path: str | Path | None,
    tree,
    lookup_path: str | Path | None = None,
    joined_vocab: bool = True,
) -> Drafter:
    """The drafter of ``kind`` (a registered kind, ``none`` or a hybrid like ``griffin+suffix``). ``draft_path``: the
    head's checkpoint, or a model-free kind's settings (optional); ``lookup_path``: a hybrid's model-free settings;
    ``joined_vocab=False``: a head's reduced draft vocabulary stays as trained (``decoding/joined_vocab.py``)."""
    if kind == "none":
        return NoDrafter()
    if kind not in draft_choices():
        raise ValueError(f"unknown draft {kind!r}; expected one of {['none', *draft_choices()]}")
    head, lookup = hybrid_parts(kind)
    if lookup is not None:
        from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter

        settings = load_draft_for(target, lookup, lookup_path)
        head_drafter = make_drafter(target, head, draft_path, tree, joined_vocab=joined_vocab)
        return HybridDrafter(head_drafter, lookup_drafter(lookup, settings))
    if draft_path is None and not draft_kind(kind).model_free:
        raise ValueError(f"draft {kind!r} needs a checkpoint directory")
    drafter = draft_kind(kind).family.torch_drafter(load_draft_for(target, kind, draft_path), target, tree)
    return drafter if joined_vocab else keep_draft_vocabulary(drafter)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: no usable tokenizer ({exc})") from exc


def set_threads() -> None:
    """Use every core this process may run on for intra-op parallelism on CPU (torch's default may be fewer in
    containers; the machine's count is too many where a cpuset or ``taskset`` gives the process fewer: threads beyond
    its cores wait on each other); processes that share the cores (``torchrun``'s ranks) split them.
    ``OMP_NUM_THREADS``, where set, is the user's choice and stays (processes that run side by side on few cores set it
    to 1 so that their threads do not compete)."""
    import os

    from specdec_kit.runtime.core.cpu import process_threads

    if not torch.cuda.is_available() and not os.environ.get("OMP_NUM_THREADS"):
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, process_threads() // ranks))
