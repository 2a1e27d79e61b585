"""Tree verification as pure functions of tensors.

Greedy: a node is accepted when its token is the target's argmax at its parent and its parent is
accepted; the deepest accepted node ends the path and the argmax there is the next token.

Sampling (lossless; SpecInfer-style multi-draft rejection with deterministic, top-k proposals): at the
current node, r = the processed target distribution; its children are tried in order, child x is
accepted with probability r(x) (the proposal is a point mass, q(x) = 1), and on rejection r(x) is
zeroed and r renormalised. When no child is accepted, the correction token is drawn from the residual
r; when the path reaches a leaf, the bonus token is drawn from the processed target distribution at
that leaf (temperature, top-k and top-p applied, unlike the GRIFFIN/HASS reference code). Each step
is exact: a tried child x comes out with probability r(x); an untried token y with probability
(1 - r(x)) * r(y) / (1 - r(x)) = r(y); by induction over the children, the token emitted after the
node has the target's distribution, and below an accepted child the same holds at the next position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_kit.runtime.sampling import SamplingParams, sample, target_probs


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


def verify_greedy(tokens, parents, valid, depth, tree_mask, logits) -> Verdict:
    """All rows at once. tokens/parents/valid/depth [B, N]; tree_mask [B, N, N]; logits [B, N, V]."""
    best_tok = logits.argmax(dim=-1)  # [B, N]
    parent_best = torch.gather(best_tok, 1, parents.clamp(min=0))
    match = valid & ((parents < 0) | (tokens == parent_best))
    accepted = match.clone()
    for _ in range(int(depth.max().item())):
        accepted = match & torch.where(parents < 0, match, torch.gather(accepted, 1, parents.clamp(min=0)))
    score = torch.where(accepted, depth, torch.full_like(depth, -1))
    deepest = score.argmax(dim=1)
    path, counts = path_of(tree_mask, deepest)
    nxt = torch.gather(best_tok, 1, deepest[:, None]).squeeze(1)
    return Verdict(path=path, counts=counts, next_tokens=nxt)


def children_lists(parents: list[int], valid: list[bool]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0 and valid[i]:
            kids[p].append(i)
    return kids


def verify_sampling_row(
    tokens: list[int],
    parents: list[int],
    valid: list[bool],
    probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """One tree, one sequence. probs [N, V]: processed target distribution at every node."""
    kids = children_lists(parents, valid)
    node, path = 0, [0]
    while True:
        residual = probs[node]
        accepted = None
        for child in kids[node]:
            x = tokens[child]
            p_x = float(residual[x])
            if p_x > 0.0 and float(torch.rand((), generator=generator)) < p_x:
                accepted = child
                break
            if p_x > 0.0:
                residual = residual.clone()
                residual[x] = 0.0
                residual = residual / residual.sum()
        if accepted is None:
            return path, sample(residual, generator)
        path.append(accepted)
        node = accepted


def verify_batch(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    depth: torch.Tensor,
    tree_mask: torch.Tensor,
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> Verdict:
    """Greedy rows vectorised, sampling rows one by one; each row follows its own parameters."""
    verdict = verify_greedy(tokens, parents, valid, depth, tree_mask, logits)
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if not sampled:
        return verdict
    paths = [verdict.path[b].tolist()[: int(verdict.counts[b])] for b in range(tokens.shape[0])]
    nxt = verdict.next_tokens.clone()
    for b in sampled:
        probs = target_probs(logits[b], params[b]).cpu()  # the row's generator is a CPU generator
        paths[b], nxt[b] = verify_sampling_row(
            tokens[b].tolist(), parents[b].tolist(), valid[b].tolist(), probs, generators[b]
        )
    width = max(len(p) for p in paths)
    path = torch.zeros(len(paths), width, dtype=torch.long, device=tokens.device)
    for b, p in enumerate(paths):
        path[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    counts = torch.tensor([len(p) for p in paths], dtype=torch.long, device=tokens.device)
    return Verdict(path=path, counts=counts, next_tokens=nxt)
