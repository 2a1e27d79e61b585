"""Tree verification as pure functions of tensors.

Every row comes down to one rule: the target chooses a token at every node (its argmax for greedy
rows; for sampled rows its Gumbel-max draw for the generated index that node's child would take, see
``sampling.py``); a node is accepted when its token is the target's choice at its parent and its parent
is accepted; the deepest accepted node ends the path and the target's choice there is the next token.

Why sampling stays lossless: plain sampling with a seed emits, at generated index k, the Gumbel-max
draw of the processed target distribution after the first k tokens with the noise of (seed, k). Along
an accepted path every node's prefix is the prefix plain sampling had, so the target's choice there is
the token plain sampling would have drawn; the path is accepted exactly as far as the tree guessed
those draws, and the next token is the next draw. The emitted tokens are therefore exactly plain
sampling's tokens for that seed (each one an exact sample of the target's distribution), whatever the
tree: speculation changes how many tokens one target call yields, never which tokens they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_kit.runtime.core.argmax import argmax_last
from specdec_kit.runtime.core.sampling import SamplingParams, sampled_tokens
from specdec_kit.runtime.core.trees import walked_on_cpu


@dataclass
class Verdict:
    path: torch.Tensor  # [B, A] node indices of the accepted path, root first, padded with 0
    counts: torch.Tensor  # [B] path lengths (accepted draft tokens + 1)
    next_tokens: torch.Tensor  # [B] the correction / bonus token


def path_of(tree_mask: torch.Tensor, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-to-node paths from the ancestor mask: ([B, A] node indices padded with 0, [B] lengths)."""
    rows = tree_mask[torch.arange(nodes.shape[0], device=nodes.device), nodes]  # [B, N]
    counts = rows.sum(dim=1)
    order = torch.argsort((~rows).to(torch.int8), dim=1, stable=True)  # ancestors first, in index order
    width = int(counts.max().item())
    path = order[:, :width]
    ar = torch.arange(width, device=nodes.device)
    return torch.where(ar[None, :] < counts[:, None], path, torch.zeros_like(path)), counts


def verify_choices(tokens, parents, valid, depth, tree_mask, choices) -> Verdict:
    """All rows at once. tokens/parents/valid/depth [B, N]; tree_mask [B, N, N]; choices [B, N]: the target's
    token after each node."""
    if walked_on_cpu(tokens, *tokens.shape):
        return _verify_walked(tokens, parents, valid, depth, tree_mask, choices)
    parent_choice = torch.gather(choices, 1, parents.clamp(min=0))
    match = valid & ((parents < 0) | (tokens == parent_choice))
    accepted = match.clone()
    for _ in range(int(depth.max().item())):
        accepted = match & torch.where(parents < 0, match, torch.gather(accepted, 1, parents.clamp(min=0)))
    score = torch.where(accepted, depth, torch.full_like(depth, -1))
    deepest = score.argmax(dim=1)
    path, counts = path_of(tree_mask, deepest)
    nxt = torch.gather(choices, 1, deepest[:, None]).squeeze(1)
    return Verdict(path=path, counts=counts, next_tokens=nxt)


def _verify_walked(tokens, parents, valid, depth, tree_mask, choices) -> Verdict:
    """``verify_choices`` in Python, node by node (a few small trees on the CPU, ``walked_on_cpu``): the same verdict.
    A node is accepted when it is real, its token is its parent's choice and its parent is accepted (the root: when
    real); the path ends at the first of the deepest accepted nodes."""
    rows = zip(tokens.tolist(), parents.tolist(), valid.tolist(), depth.tolist(), choices.tolist())
    passes = int(depth.max().item())  # the tensor form's passes (parents need not precede their children)
    paths, counts, next_tokens = [], [], []
    for b, (toks, pars, real, depths, chosen) in enumerate(rows):
        nodes = range(len(toks))
        match = [real[i] and (pars[i] < 0 or toks[i] == chosen[pars[i]]) for i in nodes]
        accepted = match
        for _ in range(passes):
            accepted = [match[i] and (pars[i] < 0 or accepted[pars[i]]) for i in nodes]
        scores = [depths[i] if accepted[i] else -1 for i in nodes]
        deepest = scores.index(max(scores))
        paths.append([j for j, seen in enumerate(tree_mask[b, deepest].tolist()) if seen])
        counts.append(len(paths[-1]))
        next_tokens.append(chosen[deepest])
    width = max(counts)
    return Verdict(
        path=torch.tensor([path + [0] * (width - len(path)) for path in paths], dtype=torch.long),
        counts=torch.tensor(counts, dtype=torch.long),
        next_tokens=torch.tensor(next_tokens, dtype=choices.dtype),
    )


def verify_batch(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    depth: torch.Tensor,
    tree_mask: torch.Tensor,
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int | None],
    first_index: list[int],
) -> Verdict:
    """Each row follows its own parameters: greedy rows by argmax, sampled rows by their seeded draws
    (``first_index[b]``: the generated index of the token the root's child takes)."""
    choices = argmax_last(logits)
    for b, p in enumerate(params):
        if not p.greedy:
            choices[b] = accepted_draws(
                tokens[b], parents[b], valid[b], depth[b], logits[b], p, seeds[b], first_index[b]
            )
    return verify_choices(tokens, parents, valid, depth, tree_mask, choices)


def accepted_draws(tokens, parents, valid, depth, logits, params: SamplingParams, seed: int, first_index: int):
    """One sampled row's choices [N]: the target's draw at each node verification accepts, found from the root down
    (a node is accepted when its token is its accepted parent's draw), and -1 at every other node, whose draw
    cannot change the verdict. A seeded draw costs a softmax and a vocabulary of noise: drawing at the accepted
    nodes alone (tau of them, not the tree's every node) is what keeps a sampled cycle near a greedy one's cost.
    Each draw is plain decoding's own call, one row at its generated index."""
    token_list, parent_list, depth_list, real = tokens.tolist(), parents.tolist(), depth.tolist(), valid.tolist()
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parent_list):
        if real[node] and parent >= 0:
            children.setdefault(parent, []).append(node)
    choices = torch.full((len(token_list),), -1, dtype=torch.long, device=logits.device)
    frontier = [node for node, parent in enumerate(parent_list) if parent < 0 and real[node]]
    while frontier:
        node = frontier.pop()
        draw = int(sampled_tokens(logits[node : node + 1], params, seed, [first_index + depth_list[node]])[0])
        choices[node] = draw
        frontier += [child for child in children.get(node, []) if token_list[child] == draw]
    return choices
