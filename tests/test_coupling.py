"""Drafts coupled to the target's seeded draws: a sampled row's children are ranked by their chances of being its draw.

The emitted tokens never depend on the tree (``test_sampling_distribution.py`` runs every drafter with coupling on);
these tests check what coupling changes: which tokens the tree holds.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kit.runtime.core.choices import chain
from specdec_kit.runtime.core.coupling import draw_coupling, ranked_children
from specdec_kit.runtime.core.sampling import SamplingParams, sampled_tokens
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter, TorchFeatureStep
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.drafts.layers import TargetRowsHead
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.ort.graphs import draft_tree_plan
from specdec_kit.runtime.synthetic import oracle_griffin, random_griffin, tiny_hf_model, with_draft_vocab

VOCAB = 24  # under the pool: every token's draw is compared


def test_a_draft_with_the_targets_distribution_ranks_the_targets_draw_first():
    """Where the draft's distribution is the target's, its first child at every level is the target's seeded draw
    at that level's index; ranked by the draft's probabilities alone it is only the likeliest token."""
    rows, levels, first = 200, 3, 11
    logits = 3.0 * torch.randn(rows, levels, VOCAB, generator=torch.Generator().manual_seed(0))
    for temperature in (0.7, 1.0):
        params = [SamplingParams(temperature=temperature, seed=s) for s in range(rows)]
        coupling = draw_coupling(params, [p.seed for p in params], [first] * rows, levels, VOCAB, torch.device("cpu"))
        for level in range(levels):
            logp = torch.log_softmax(logits[:, level], dim=-1)
            draws = torch.stack(
                [
                    sampled_tokens(logits[b, level][None], params[b], params[b].seed, [first + level])[0]
                    for b in range(rows)
                ]
            )
            coupled = ranked_children(logp, 2, coupling, level)[1][:, 0]
            alone = ranked_children(logp, 2, None, level)[1][:, 0]
            assert torch.equal(coupled, draws)
            assert (alone == draws).float().mean() < 0.8  # the argmax is often not the draw


def test_greedy_rows_rank_by_the_draft_alone_beside_sampled_rows():
    """A batch mixing greedy and sampled rows: the greedy rows' children and scores are exactly the draft's top-k."""
    logp = torch.log_softmax(torch.randn(4, 3, 200, generator=torch.Generator().manual_seed(1)), dim=-1)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams(), SamplingParams(1.0, seed=9)]
    coupling = draw_coupling(params, [None, 5, None, 9], [4, 7, 2, 0], 2, 200, torch.device("cpu"))
    assert torch.equal(coupling.inv_temperature, torch.tensor([0.0, 1.25, 0.0, 1.0]))
    scores, tokens = ranked_children(logp, 3, coupling, 1)
    want_scores, want_tokens = torch.topk(logp, 3, dim=-1)
    assert torch.equal(tokens[[0, 2]], want_tokens[[0, 2]]) and torch.equal(scores[[0, 2]], want_scores[[0, 2]])
    assert not torch.equal(tokens[[1, 3]], want_tokens[[1, 3]])  # the sampled rows' noise reorders them
    assert (scores <= 0).all()  # log-scores: a child never outranks its parent in the tree search
    assert draw_coupling([SamplingParams()] * 2, [None, None], [0, 0], 2, 200, torch.device("cpu")) is None


def oracle_chain_acceptance(target: TargetModel, couples: bool) -> tuple[int, list[list[int]]]:
    drafter = FeatureTreeDrafter(
        TorchFeatureStep(oracle_griffin(target), target.lm_head), StaticTree.from_choices(chain(3))
    )
    drafter.couples_draws = couples
    gen = SpeculativeGenerator(target, drafter, eos_token_ids=[])
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(8)]
    results = gen.generate([[1, 4, 2, s % 5] for s in range(8)], 16, params)
    return sum(r.stats.accepted_tokens for r in results), [r.tokens for r in results]


def test_coupled_drafting_accepts_more_of_an_oracle_drafts_chain_and_emits_the_same_tokens():
    """An oracle GRIFFIN draft (the target's own next-token distribution at its first level) on a chain of 3 at T=1:
    coupled, its chain's first token is the draw; uncoupled, only the likeliest token. Same tokens either way."""
    target = TargetModel(
        tiny_hf_model(hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=VOCAB, seed=21)
    )
    coupled, coupled_tokens = oracle_chain_acceptance(target, True)
    alone, alone_tokens = oracle_chain_acceptance(target, False)
    assert coupled_tokens == alone_tokens
    assert coupled > 3 * alone, (coupled, alone)  # 97 against 10 when written


@pytest.mark.parametrize("joined", [False, True], ids=["draft vocabulary", "with joined tokens"])
def test_a_draft_vocabulary_ranks_the_same_trees_without_the_targets_vocabulary(joined):
    """The one-call draft graph of a reduced-vocabulary GRIFFIN head ranks over the draft vocabulary alone (its ids
    mapped to the target's as they are chosen): the same tokens, parents and scores as ranking over the target's
    vocabulary with every other id at -inf (the scores to float rounding), for greedy and sampled rows alike; so do
    each row's tokens joined to the vocabulary (a padding slot never drafted)."""
    target = TargetModel(tiny_hf_model(hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=96))
    draft = with_draft_vocab(random_griffin(target), 40)
    head = TargetRowsHead(target.lm_head, draft)
    plan = draft_tree_plan(draft, head, DynamicTreeConfig(8, 3, 3))
    gen = torch.Generator().manual_seed(3)
    ids, feats, pos, mask, root, noise, inv_t, _, _, *past = plan.args
    outside = torch.tensor(sorted(set(range(96)) - set(head.ids.tolist())))
    extra = outside[torch.randperm(len(outside), generator=gen)[:12]].view(2, 6) if joined else torch.full((2, 1), -1)
    if joined:
        extra[0, -2:] = -1  # the first row joined fewer
    args = (
        torch.randint(0, 96, ids.shape, generator=gen),
        torch.randn(feats.shape, generator=gen),
        pos,
        mask,
        root,
        -torch.log(-torch.log(torch.rand(noise.shape, generator=gen))),  # Gumbel noise
        inv_t,  # a greedy row and a sampled one
        extra,
        target.lm_head.weight.detach()[extra.clamp(min=0)],
        *(torch.randn(b.shape, generator=gen) for b in past),
    )
    graph = plan.module
    assert graph.reduced
    with torch.no_grad():
        reduced = graph(*args)
        graph.reduced = False  # rank over the target's vocabulary, the draft's logits placed on it
        placed = graph(*args)
    assert torch.equal(reduced[0], placed[0]) and torch.equal(reduced[1], placed[1])  # tokens, parents
    torch.testing.assert_close(reduced[2], placed[2], rtol=0, atol=1e-5)  # a log-softmax over fewer terms rounds apart
    drafted = reduced[0][:, 1:]
    in_vocab = draft.t2d[drafted] | (drafted[..., None] == extra[:, None, :]).any(-1)
    assert bool(in_vocab.all())  # every drafted token is in the draft vocabulary or its row's joined tokens
    if joined:
        assert not bool(draft.t2d[drafted].all())  # and some are joined ones (a random head ranks them alike)


@pytest.mark.parametrize("kind", ["griffin", "griffin+suffix"])
def test_joined_tokens_can_be_turned_off_for_a_reduced_vocabulary_head(kind, tmp_path):
    """``make_drafter(..., joined_vocab=False)`` (``specdec-generate --joined-vocab off``): a reduced-vocabulary head,
    alone or under a hybrid, keeps its vocabulary as trained (alone, it drafts inside it however many of the prompt's
    tokens lie outside), with the target's greedy output; on by default."""
    from specdec_kit.runtime.checkpoint import save_draft
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.loader import make_drafter

    target = TargetModel(tiny_hf_model(hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=96))
    draft = with_draft_vocab(random_griffin(target), 40)
    path = save_draft(draft, tmp_path / "head", "griffin").parent
    tree = DynamicTreeConfig(6, 2, 3)

    def head_of(drafter):
        return getattr(drafter, "head", drafter)

    assert head_of(make_drafter(target, kind, path, tree)).joined is not None
    fixed = make_drafter(target, kind, path, tree, joined_vocab=False)
    assert head_of(fixed).joined is None
    trees = []
    original = fixed.draft
    fixed.draft = lambda *a: trees.append(original(*a)) or trees[-1]
    outside = torch.nonzero(~draft.t2d)[:, 0]
    prompt = outside[:12].tolist() + [5, 7, 9]  # the prompt's own tokens lie outside the vocabulary
    plain = SpeculativeGenerator(target, NoDrafter()).generate([prompt], 16)[0].tokens
    assert SpeculativeGenerator(target, fixed).generate([prompt], 16)[0].tokens == plain
    if kind == "griffin":  # (a hybrid's lookup copies the prompt's tokens, whatever its head drafts)
        drafted = torch.cat([t.tokens[:, 1:][t.valid[:, 1:]] for t in trees])  # a root is a verified token
        assert not bool(torch.isin(drafted, outside).any())
