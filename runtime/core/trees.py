"""Draft-tree structures and buffers as pure functions of tensors (no model, no I/O).

A tree has N nodes; node 0 is the root (the last verified token, not yet in the KV cache) and every
other node's parent has a smaller index. The buffers follow the EAGLE/Medusa reference semantics:

* ``tree_mask`` [N, N]: node i sees node j iff j is i or an ancestor of i (the root is seen by all);
* ``position_offsets`` [N]: depth of each node (position id = committed length + depth);
* ``retrieve_indices`` [leaves, max_depth + 1]: one root-to-leaf path per leaf, padded with -1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec_kit.runtime.core.choices import NAMED_TREES, chain


@dataclass(frozen=True)
class TreeBuffers:
    parents: torch.Tensor  # [N] long, root's parent is -1
    tree_mask: torch.Tensor  # [N, N] bool
    position_offsets: torch.Tensor  # [N] long
    retrieve_indices: torch.Tensor  # [leaves, max_depth + 1] long, -1 padded

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.position_offsets.max().item())


def ancestor_masks(parents: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched ancestor masks and depths from parent pointers.

    parents: [..., N] long with -1 for the root (and for padding nodes); valid: optional [..., N] bool
    (padding nodes see only themselves and have depth 0). Uses pointer jumping: O(max_depth) tensor ops; a small
    batch of trees on the CPU is walked in Python instead (``walked_on_cpu``).
    """
    n = parents.shape[-1]
    if walked_on_cpu(parents, parents.numel() // max(n, 1), n):
        return _ancestor_masks_walked(parents, valid)
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(*parents.shape, n)
    mask = eye.clone()
    depth = torch.zeros_like(parents)
    cursor = parents.clone()
    for _ in range(n):
        live = cursor >= 0
        if not bool(live.any()):
            break
        mask |= live[..., None] & torch.nn.functional.one_hot(cursor.clamp(min=0), n).bool()
        depth += live.long()
        cursor = torch.where(live, torch.gather(parents, -1, cursor.clamp(min=0)), cursor)
    if valid is not None:
        mask = torch.where(valid[..., None], mask, eye)
        depth = torch.where(valid, depth, torch.zeros_like(depth))
    return mask, depth


# A batch of trees of at most SMALL_ROWS rows and SMALL_MASK_ENTRIES ancestor-mask entries in all (rows x nodes x
# nodes) is walked in Python on the CPU: a few small trees are walked faster there than the dozens of small tensor
# operations of pointer jumping run, whose cost hardly grows with the batch (2 cores: one tree of 7 nodes, masks 14
# against 73 us and verification 14 against 64; 4 of 25 nodes, masks 172 against 122; 16 of 7, verification 150
# against 115). The tensor forms stay the path for larger batches and for a device, where a walk would wait on a copy
# to the host.
SMALL_ROWS = 8
SMALL_MASK_ENTRIES = 2048


def walked_on_cpu(tensor: torch.Tensor, rows: int, nodes: int) -> bool:
    """Whether a batch of ``rows`` trees of ``nodes`` nodes, held in ``tensor``'s device, is walked in Python."""
    return tensor.device.type == "cpu" and rows <= SMALL_ROWS and rows * nodes * nodes <= SMALL_MASK_ENTRIES


def _ancestor_masks_walked(parents: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ancestor_masks`` by walking each node's parents in Python: the same masks and depths (a walk stops after N
    steps, as pointer jumping does, should the pointers loop)."""
    n = parents.shape[-1]
    rows = parents.reshape(-1, n).tolist()
    real = valid.reshape(-1, n).tolist() if valid is not None else None
    masks, depths = [], []
    for r, row in enumerate(rows):
        for i in range(n):
            seen = [False] * n
            seen[i] = True
            depth = 0
            if real is None or real[r][i]:
                cursor = row[i]
                while cursor >= 0 and depth < n:
                    seen[cursor] = True
                    depth += 1
                    cursor = row[cursor]
            masks.append(seen)
            depths.append(depth)
    mask = torch.tensor(masks, dtype=torch.bool).reshape(*parents.shape, n)
    return mask, torch.tensor(depths, dtype=parents.dtype).reshape(parents.shape)


def buffers_from_parents(parents: list[int] | torch.Tensor) -> TreeBuffers:
    """Build all buffers for one tree; checks that parents precede children."""
    parents = torch.as_tensor(parents, dtype=torch.long)
    if parents.ndim != 1 or parents.numel() == 0 or int(parents[0]) != -1:
        raise ValueError("parents must be a non-empty 1-D list whose first entry (the root) is -1")
    idx = torch.arange(parents.numel())
    if bool(((parents[1:] < 0) | (parents[1:] >= idx[1:])).any()):
        raise ValueError("every non-root node's parent must be an earlier node")
    mask, depth = ancestor_masks(parents)
    has_child = torch.zeros(parents.numel(), dtype=torch.bool)
    has_child[parents[1:]] = True
    leaves = torch.nonzero(~has_child).flatten().tolist()
    width = int(depth.max().item()) + 1
    rows = []
    for leaf in leaves:
        path = torch.nonzero(mask[leaf]).flatten().tolist()  # ancestors in index order = root->leaf
        rows.append(path + [-1] * (width - len(path)))
    return TreeBuffers(
        parents=parents,
        tree_mask=mask,
        position_offsets=depth,
        retrieve_indices=torch.tensor(rows, dtype=torch.long),
    )


@dataclass(frozen=True)
class StaticTree:
    """A tree given as Medusa / EAGLE-1 choices: node i+1 is ``choices[i]`` after sorting by (len, value)."""

    choices: tuple[tuple[int, ...], ...]
    buffers: TreeBuffers
    ranks: torch.Tensor  # [N] top-k rank of each node among its parent's proposals (root: 0)

    @classmethod
    def from_choices(cls, choices: list[list[int]]) -> "StaticTree":
        paths = sorted({tuple(int(c) for c in p) for p in choices}, key=lambda p: (len(p), p))
        if not paths:
            raise ValueError("a static tree needs at least one choice")
        index = {p: i + 1 for i, p in enumerate(paths)}
        parents = [-1]
        for p in paths:
            if len(p) == 0 or min(p) < 0:
                raise ValueError(f"choice {list(p)}: must be a non-empty list of non-negative ranks")
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"choice {list(p)} needs its prefix {list(p[:-1])} in the tree")
            parents.append(index[p[:-1]] if len(p) > 1 else 0)
        ranks = torch.tensor([0] + [p[-1] for p in paths], dtype=torch.long)
        return cls(choices=tuple(paths), buffers=buffers_from_parents(parents), ranks=ranks)

    @property
    def max_rank(self) -> int:
        return int(self.ranks.max().item()) + 1


@dataclass(frozen=True)
class DynamicTreeConfig:
    """EAGLE-2 dynamic tree: ``total_tokens`` nodes including the root, ``depth`` expansion steps
    after the first level (paths hold up to depth + 1 draft tokens, as in the reference code), and
    ``top_k`` beams per level / children per beam."""

    total_tokens: int = 60
    depth: int = 5
    top_k: int = 10

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 0 or self.total_tokens < 2:
            raise ValueError(
                f"dynamic tree needs top_k >= 1, depth >= 0, total_tokens >= 2; got {self.top_k}, "
                f"{self.depth}, {self.total_tokens}"
            )
        candidates = self.top_k + self.depth * self.top_k * self.top_k
        if self.total_tokens - 1 > candidates:
            raise ValueError(
                f"total_tokens={self.total_tokens} exceeds the {candidates} candidates that depth={self.depth}, "
                f"top_k={self.top_k} produce (+1 root)"
            )


HYBRID, HEAD, LOOKUP = "hybrid", "head", "lookup"


@dataclass(frozen=True)
class SourcedTree(DynamicTreeConfig):
    """A dynamic tree and which part of a hybrid draft fills it: the head and the model-free draft merged
    (``hybrid``), the head alone (``head``) or the model-free draft alone (``lookup``). A server's cost policy
    weighs the three (and plain decoding) as candidates like any trees."""

    source: str = HYBRID

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source not in (HYBRID, HEAD, LOOKUP):
            raise ValueError(f"tree source {self.source!r}: expected {HYBRID}, {HEAD} or {LOOKUP}")


def source_of(tree: object) -> str | None:
    """The part of a hybrid draft a tree is for (None: a tree of a single draft)."""
    return tree.source if isinstance(tree, SourcedTree) else None


def parse_tree_spec(spec: str) -> StaticTree | DynamicTreeConfig:
    """``dynamic`` | ``dynamic:TOTAL:DEPTH:TOP_K`` | ``static:NAME`` (``mc_sim_7b_63``, ``eagle1_default``,
    ``chain-N``) | ``static:NAME:N`` (the first N choices of a named list; Medusa's lists are ordered most useful
    first) | a JSON file."""
    if spec == "dynamic":
        return DynamicTreeConfig()
    if spec.startswith("dynamic:"):
        numbers = spec.split(":")[1:]
        if len(numbers) != 3 or not all(n.isdigit() for n in numbers):
            raise ValueError(f"tree spec {spec!r}: expected dynamic:TOTAL_TOKENS:DEPTH:TOP_K, e.g. dynamic:24:15:2")
        total, depth, top_k = (int(n) for n in numbers)
        return DynamicTreeConfig(total_tokens=total, depth=depth, top_k=top_k)
    if spec.startswith("static:"):
        parts = spec.split(":")
        name = parts[1]
        limit = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
        if len(parts) > 3 or (len(parts) == 3 and limit is None):
            raise ValueError(f"tree spec {spec!r}: expected static:NAME or static:NAME:N (the first N choices)")
        if name.startswith("chain-") and name[6:].isdigit():
            return StaticTree.from_choices(chain(int(name[6:])))
        if name not in NAMED_TREES:
            raise ValueError(f"unknown static tree {name!r}; expected one of {sorted(NAMED_TREES)} or chain-N")
        return StaticTree.from_choices(NAMED_TREES[name][:limit])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"tree spec {spec!r}: not 'dynamic', 'static:NAME' or an existing JSON file")
    try:
        choices = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(choices, list) or not all(isinstance(c, list) for c in choices):
        raise ValueError(
            f"{path}: expected a JSON list of choice paths like [[0], [0, 1]], found {type(choices).__name__}"
        )
    return StaticTree.from_choices(choices)


def tree_to_dict(tree: StaticTree | DynamicTreeConfig) -> dict:
    """The tree as an engine manifest records it (static trees by their full choice list)."""
    if isinstance(tree, StaticTree):
        return {
            "type": "static",
            "choices": [list(p) for p in tree.choices],
            "num_nodes": tree.buffers.num_nodes,
            "max_depth": tree.buffers.max_depth,
        }
    return {"type": "dynamic", "total_tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k}


def tree_from_dict(data: dict) -> StaticTree | DynamicTreeConfig:
    kind = data.get("type")
    if kind == "static":
        return StaticTree.from_choices(data["choices"])
    if kind == "dynamic":
        return DynamicTreeConfig(
            total_tokens=int(data["total_tokens"]), depth=int(data["depth"]), top_k=int(data["top_k"])
        )
    raise ValueError(f"tree type {kind!r}: expected 'static' or 'dynamic'")
