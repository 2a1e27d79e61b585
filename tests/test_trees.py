"""Property tests of tree buffers (static and dynamic) and of the verification functions."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specdec_kit.runtime.core.choices import EAGLE1_DEFAULT, MC_SIM_7B_63, chain
from specdec_kit.runtime.core.sampling import SamplingParams, sampled_tokens
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree, buffers_from_parents, parse_tree_spec
from specdec_kit.runtime.core.verify import accepted_draws, verify_batch, verify_choices
from specdec_kit.runtime.registry import drafter_for
from specdec_kit.runtime.synthetic import random_eagle, random_griffin, tiny_target

parent_lists = st.lists(st.integers(min_value=0, max_value=10_000), min_size=0, max_size=40).map(
    lambda raw: [-1] + [r % (i + 1) for i, r in enumerate(raw)]
)


def check_buffers(buf, parents):
    n = len(parents)
    mask = buf.tree_mask
    assert mask.shape == (n, n) and mask.diagonal().all()
    for i in range(1, n):
        p = parents[i]
        assert p < i  # ancestors precede
        expected = mask[p].clone()
        expected[i] = True
        assert torch.equal(mask[i], expected)  # a node sees its parent's view plus itself
        assert mask[i, 0]  # everyone sees the root
    assert torch.equal(buf.position_offsets, mask.sum(1) - 1)  # position offset = depth
    leaves = set(range(n)) - set(parents[1:])
    assert buf.retrieve_indices.shape[0] == len(leaves)
    assert buf.retrieve_indices.shape[1] == int(buf.position_offsets.max()) + 1
    seen = set()
    for row in buf.retrieve_indices.tolist():
        path = [x for x in row if x >= 0]
        assert row[len(path) :] == [-1] * (len(row) - len(path))  # -1 padding only at the end
        assert path[0] == 0 and path[-1] in leaves
        assert all(parents[b] == a for a, b in zip(path, path[1:]))  # root-to-leaf, parent by parent
        seen.add(path[-1])
    assert seen == leaves


@given(parent_lists)
@settings(max_examples=150, deadline=None)
def test_buffers_from_random_parent_lists(parents):
    check_buffers(buffers_from_parents(parents), parents)


choice_sets = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=1, max_size=30)


@given(choice_sets)
@settings(max_examples=100, deadline=None)
def test_static_trees_from_choices(raw):
    closed = {tuple(p[:k]) for p in raw for k in range(1, len(p) + 1)}  # close under prefixes
    tree = StaticTree.from_choices([list(p) for p in closed])
    parents = tree.buffers.parents.tolist()
    check_buffers(tree.buffers, parents)
    assert tree.buffers.num_nodes == len(closed) + 1
    for i, path in enumerate(tree.choices, start=1):
        assert tree.ranks[i] == path[-1]
        assert tree.buffers.position_offsets[i] == len(path)
        if len(path) > 1:
            assert tree.choices[parents[i] - 1] == path[:-1]


def test_named_trees():
    medusa = StaticTree.from_choices(MC_SIM_7B_63)
    assert medusa.buffers.num_nodes == 64 and medusa.buffers.max_depth == 4
    eagle1 = StaticTree.from_choices(EAGLE1_DEFAULT)
    assert eagle1.buffers.num_nodes == 26 and eagle1.buffers.max_depth == 5
    assert parse_tree_spec("static:chain-3").buffers.parents.tolist() == [-1, 0, 1, 2]
    assert parse_tree_spec("dynamic") == DynamicTreeConfig()


def test_static_tree_rejects_missing_prefix():
    try:
        StaticTree.from_choices([[0], [1, 2]])
    except ValueError as exc:
        assert "[1, 2]" in str(exc) and "prefix [1]" in str(exc)
    else:
        raise AssertionError("a choice without its prefix must be refused")


@given(
    total=st.integers(2, 30),
    depth=st.integers(0, 4),
    top_k=st.integers(1, 5),
    seed=st.integers(0, 1000),
    griffin=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_dynamic_trees(total, depth, top_k, seed, griffin):
    assume(total - 1 <= top_k + depth * top_k * top_k)  # the tree must fit among the candidates
    target = tiny_target(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=40, logit_scale=5.0)
    draft = (random_griffin if griffin else random_eagle)(target, seed=seed)
    drafter = drafter_for("griffin" if griffin else "eagle2", draft, target, DynamicTreeConfig(total, depth, top_k))
    batch = 3
    drafter.reset(batch, 16)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor([4, 1, 3])
    tree = drafter.draft(
        torch.randn(batch, 4, 32, generator=gen), torch.randint(0, 40, (batch, 4), generator=gen), counts
    )
    assert tree.tokens.shape == (batch, total)
    for b in range(batch):
        parents = tree.parents[b].tolist()
        buf = buffers_from_parents(parents)
        check_buffers(buf, parents)
        assert torch.equal(buf.tree_mask, tree.tree_mask[b]) and torch.equal(buf.position_offsets, tree.depth[b])
        assert int(tree.depth[b].max()) <= depth + 1
        kids = {}
        for i, p in enumerate(parents[1:], start=1):
            kids.setdefault(p, []).append(int(tree.tokens[b, i]))
        for p, toks in kids.items():
            assert len(toks) == len(set(toks)) and len(toks) <= top_k  # distinct siblings, at most top_k
    assert torch.equal(drafter.cache.lengths, counts)  # only the context joins the draft's cache


def test_greedy_verification_by_hand():
    # root 0 -> 1 (tok 5) -> 3 (tok 7); root 0 -> 2 (tok 6); argmax: root->5, node1->7, node3->9
    parents = torch.tensor([[-1, 0, 0, 1]])
    tokens = torch.tensor([[4, 5, 6, 7]])
    buf = buffers_from_parents(parents[0])
    logits = torch.full((1, 4, 10), -5.0)
    for node, best in [(0, 5), (1, 7), (2, 1), (3, 9)]:
        logits[0, node, best] = 5.0
    v = verify_choices(
        tokens,
        parents,
        torch.ones_like(tokens, dtype=torch.bool),
        buf.position_offsets[None],
        buf.tree_mask[None],
        logits.argmax(-1),
    )
    assert v.path.tolist() == [[0, 1, 3]] and v.counts.tolist() == [3] and v.next_tokens.tolist() == [9]
    logits[0, 1, 7] = -9.0  # now node 3's token is not the argmax after node 1
    v = verify_choices(
        tokens,
        parents,
        torch.ones_like(tokens, dtype=torch.bool),
        buf.position_offsets[None],
        buf.tree_mask[None],
        logits.argmax(-1),
    )
    assert v.path.tolist() == [[0, 1]] and v.next_tokens.tolist() == [int(logits[0, 1].argmax())]


def test_chain_helper():
    assert chain(3) == [[0], [0, 0], [0, 0, 0]]


@given(
    parent_lists,
    st.integers(0, 2**31 - 1),
    st.sampled_from([SamplingParams(0.7), SamplingParams(1.0, top_k=3), SamplingParams(1.3, top_p=0.8)]),
)
@settings(max_examples=150, deadline=None)
def test_sampled_verification_draws_at_the_accepted_nodes_alone_and_agrees_with_drawing_at_every_node(
    parents, seed, params
):
    """Drawing only where verification accepts gives the verdict of drawing at every node, even where siblings
    repeat a token or padding nodes sit in the tree."""
    n, vocab = len(parents), 4  # a tiny vocabulary: drafted tokens are often the draws, siblings often repeat
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, n), generator=gen)
    valid = torch.rand(1, n, generator=gen) < 0.9
    valid[0, 0] = True
    logits = torch.randn(1, n, vocab, generator=gen) * 2
    buf = buffers_from_parents(parents)
    parent_t, depth, mask = torch.tensor([parents]), buf.position_offsets[None], buf.tree_mask[None]
    first = seed % 50
    everywhere = sampled_tokens(logits[0], params, seed, [first + d for d in depth[0].tolist()])[None]
    expected = verify_choices(tokens, parent_t, valid, depth, mask, everywhere)
    lazy = verify_batch(tokens, parent_t, valid, depth, mask, logits, [params], [seed], [first])
    assert lazy.path.tolist() == expected.path.tolist() and lazy.counts.tolist() == expected.counts.tolist()
    assert lazy.next_tokens.tolist() == expected.next_tokens.tolist()
    drawn = accepted_draws(tokens[0], parent_t[0], valid[0], depth[0], logits[0], params, seed, first)
    accepted = {0}  # the nodes verification accepts, from drawing everywhere
    for node in range(1, n):
        if valid[0, node] and parents[node] in accepted and tokens[0, node] == everywhere[0, parents[node]]:
            accepted.add(node)
    assert {node for node in range(n) if drawn[node] >= 0} == accepted
    assert all(drawn[node] == everywhere[0, node] for node in accepted)


tree_batches = st.tuples(st.integers(1, 4), st.integers(1, 12), st.booleans(), st.integers(0, 2**31 - 1))


@given(tree_batches)
@settings(max_examples=150, deadline=None)
def test_small_trees_walked_in_python_give_the_tensor_forms_masks_and_verdicts(batch):
    """On the CPU a cycle's small trees are walked in Python (``walked_on_cpu``): the ancestor masks, depths and verdicts
    are the tensor form's, for well-formed trees, padding, and pointers in any order (loops included)."""
    import random

    from specdec_kit.runtime.core import trees

    rows, n, arbitrary, seed = batch
    rng = random.Random(seed)
    if arbitrary:
        parents = [[-1] + [rng.randrange(-1, n) for _ in range(1, n)] for _ in range(rows)]
    else:
        parents = [[-1] + [-1 if rng.random() < 0.1 else rng.randrange(i) for i in range(1, n)] for _ in range(rows)]
    parents = torch.tensor(parents)
    valid = torch.tensor([[i == 0 or rng.random() < 0.85 for i in range(n)] for _ in range(rows)])
    tokens = torch.tensor([[rng.randrange(3) for _ in range(n)] for _ in range(rows)])
    choices = torch.tensor([[rng.randrange(3) for _ in range(n)] for _ in range(rows)])
    assert trees.walked_on_cpu(parents, rows, n)  # the walks are what runs here by default
    results = []
    for small in (0, trees.SMALL_ROWS):  # 0 rows: every batch takes the tensor form
        saved, trees.SMALL_ROWS = trees.SMALL_ROWS, small
        try:
            mask, depth = trees.ancestor_masks(parents, valid)
            unmasked = trees.ancestor_masks(parents)
            verdict = verify_choices(tokens, parents, valid, depth, mask, choices)
        finally:
            trees.SMALL_ROWS = saved
        results.append([mask, depth, *unmasked, verdict.path, verdict.counts, verdict.next_tokens])
    for tensor_form, walked in zip(*results):
        assert walked.dtype == tensor_form.dtype and torch.equal(walked, tensor_form)
