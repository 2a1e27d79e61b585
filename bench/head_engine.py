"""The engine a benchmark runs a head through, built as a serving team would build it for this device: the kit's
builder, the target's CPU tree, and on ONNX Runtime the head's weights in 8 bits by default (a draft only proposes
tokens, so its precision moves the speed, never the output). An identical rebuild is reused."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence


def add_draft_weights_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-weights",
        default="int8",
        choices=["float", "int8"],
        help="onnxruntime: the heads' weights (int8: 8-bit blocks with int8 dot products, a cheaper draft cycle on a "
        "CPU; the output stays the float target's either way)",
    )


def effective_draft_weights(backend: str, draft_weights: str) -> str:
    """Quantized drafts are ONNX Runtime engines'; another backend runs the head as trained."""
    return draft_weights if backend == "onnxruntime" else "float"


def build_head_engine(
    target: str, head: str, backend: str, draft_weights: str, engines: Path, extra_trees: Sequence = ()
) -> Path:
    """``engines/<target>-<head>-<backend>[-draftint8][-trees]``: ``target`` a named target (``smollm2``, with the
    kit's heads and its CPU tree) or ``zoo`` (the demo zoo's target and head, the demo tree). ``extra_trees``: more
    dynamic trees whose draft cycle the engine carries as one graph each, where the head's kind has one (a tree
    search's candidates, each then drafted as cheaply as the engine's own tree; ``-trees``: not the directory a plain
    build of the head writes, which the demo then reuses)."""
    from specdec_kit.export.builder import build_engine
    from specdec_kit.export.cli import weights_suffix
    from specdec_kit.export.inputs import BuildInputs, resolve_paths
    from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_to_dict
    from specdec_kit.runtime.models.pretrained import NAMED_TARGETS
    from specdec_kit.runtime.presets import DEMO_TREE
    from specdec_kit.runtime.registry import draft_kind

    named = target != "zoo"
    target_path, draft, tokenizer, _ = resolve_paths(head, Path(target) if named else None, None, None)
    draft_weights = effective_draft_weights(backend, draft_weights)
    tree = DynamicTreeConfig(**(NAMED_TARGETS[target].cpu_tree(head) if named else DEMO_TREE))
    tree_graphs = backend == "onnxruntime" and draft_kind(head).family.tree_graphs
    inputs = BuildInputs(
        draft=head,
        target=target_path,
        draft_path=draft,
        tokenizer=tokenizer,
        backend=backend,
        dtype="float32",
        draft_weights=draft_weights,
        tree=tree_to_dict(tree),
        extra_trees=tuple(tree_to_dict(t) for t in extra_trees) if tree_graphs else (),
    )
    carried = "-trees" if inputs.extra_trees else ""
    out = engines / f"{target}-{head}-{backend}{weights_suffix('float', draft_weights)}{carried}"
    print(f"{head}: engine {out}", file=sys.stderr)
    return build_engine(inputs, out, step=lambda msg: print(f"  {msg}", file=sys.stderr), replace_other=True).path
