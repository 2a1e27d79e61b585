"""Speculative sampling draws from exactly the target's (processed) distribution.

A small-vocabulary target; many sequences sampled in one batch (one seed per row, fixed); the
joint distribution of the first two tokens and the marginal of the third are compared with the exact
distributions computed from the target by chi-square goodness-of-fit tests. The false-alarm rate of
each test is below 1e-3 (Bonferroni over its checks). Draft trees are deep enough that every branch
runs: acceptances, rejections with residual resampling, and bonus tokens after full acceptance.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import chi_square_pvalue

from specdec_kit.runtime.core.choices import EAGLE1_DEFAULT, chain
from specdec_kit.runtime.core.lookup import NgramSettings, SuffixSettings
from specdec_kit.runtime.core.sampling import SamplingParams, target_probs
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter, MedusaDrafter, NoDrafter, TorchFeatureStep
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter, LookupDrafter, NgramSource, SuffixSource
from specdec_kit.runtime.decoding.moa_drafting import MoATreeDrafter, TorchMoAStep
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import drafter_for as registry_drafter_for
from specdec_kit.runtime.synthetic import (
    fitted_medusa,
    oracle_griffin,
    oracle_moa,
    random_dflash,
    random_eagle,
    random_eagle3,
    random_moa,
    random_peagle,
    tiny_hf_model,
    with_draft_vocab,
)

VOCAB = 6
SAMPLES = 3000
PROMPT = [1, 4, 2]
ALPHA = 1e-3


@pytest.fixture(scope="module")
def small_target() -> TargetModel:
    return six_token_target()


def six_token_target() -> TargetModel:
    """A target of 6 tokens whose next-token distributions are neither flat nor peaked: every branch of
    speculative sampling runs."""
    return TargetModel(
        tiny_hf_model(
            hidden_size=32,
            layers=2,
            heads=4,
            kv_heads=2,
            intermediate=64,
            vocab=VOCAB,
            context_mix=0.6,
            logit_scale=6.0,
            seed=21,
        )
    )


@torch.no_grad()
def exact_distributions(target: TargetModel, params: SamplingParams):
    """p(x1, x2) [V, V] and p(x3) [V] under the processed target distribution, by enumeration."""
    hf = target.hf_model

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        logits = hf(torch.tensor(prefixes)).logits[:, -1]
        return target_probs(logits, params)

    p1 = next_probs([PROMPT])[0]
    p2 = next_probs([PROMPT + [a] for a in range(VOCAB)])  # [V, V]
    joint12 = p1[:, None] * p2
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    p3 = next_probs([PROMPT + [a, b] for a, b in pairs]).view(VOCAB, VOCAB, VOCAB)
    marginal3 = (joint12[:, :, None] * p3).sum(dim=(0, 1))
    return joint12.double(), marginal3.double()


def drafter_for(name: str, target: TargetModel):
    if name == "plain":
        return NoDrafter()
    if name == "eagle-random-dynamic":
        return FeatureTreeDrafter(
            TorchFeatureStep(random_eagle(target), target.lm_head), DynamicTreeConfig(total_tokens=10, depth=3, top_k=3)
        )
    if name == "griffin-oracle-static":
        return FeatureTreeDrafter(
            TorchFeatureStep(oracle_griffin(target), target.lm_head), StaticTree.from_choices(EAGLE1_DEFAULT)
        )
    if name == "griffin-oracle-chain1":  # one draft token: full acceptance then a bonus token at x3
        return FeatureTreeDrafter(
            TorchFeatureStep(oracle_griffin(target), target.lm_head), StaticTree.from_choices(chain(1))
        )
    if name == "moa-oracle-static":  # TLI = L: proposals are the target's own top tokens
        return MoATreeDrafter(TorchMoAStep(oracle_moa(target), target), StaticTree.from_choices(EAGLE1_DEFAULT))
    if name == "moa-random-tli1-dynamic":
        return MoATreeDrafter(
            TorchMoAStep(random_moa(target, tli=1), target), DynamicTreeConfig(total_tokens=10, depth=3, top_k=3)
        )
    if name == "griffin-oracle-vocab-dynamic":  # a reduced draft vocabulary (4 of the 6 tokens): q = 0 outside it
        return registry_drafter_for(
            "griffin",
            with_draft_vocab(oracle_griffin(target), 4),
            target,
            DynamicTreeConfig(total_tokens=10, depth=3, top_k=3),
        )
    if name == "eagle3-random-dynamic":  # 4 of the 6 tokens in the draft vocabulary: q = 0 outside it
        return registry_drafter_for(
            "eagle3", random_eagle3(target, draft_vocab=4), target, DynamicTreeConfig(total_tokens=10, depth=3, top_k=3)
        )
    if name == "peagle-random-dynamic":  # 3 proposals from one forward, each position's top-3 in the tree
        return registry_drafter_for(
            "peagle", random_peagle(target, parallel_tokens=3), target, DynamicTreeConfig(10, 3, 3)
        )
    if name == "dflash-random-dynamic":  # a block of 3 masked slots from one forward, each position's top-3
        return registry_drafter_for("dflash", random_dflash(target, block_size=4), target, DynamicTreeConfig(10, 3, 3))
    if name == "medusa-fitted":
        return MedusaDrafter(fitted_medusa(target, heads=5), StaticTree.from_choices(EAGLE1_DEFAULT))
    lookup_tree = DynamicTreeConfig(total_tokens=8, depth=3, top_k=2)
    if name == "ngram":  # prompt lookup from one token on: the text's own repeats
        return LookupDrafter(NgramSource(NgramSettings(prompt_lookup_min=1)), lookup_tree)
    if name == "suffix":
        return LookupDrafter(SuffixSource(SuffixSettings(min_token_prob=0.0)), lookup_tree)
    if name == "griffin-oracle+suffix":
        head = FeatureTreeDrafter(
            TorchFeatureStep(oracle_griffin(target), target.lm_head),
            DynamicTreeConfig(total_tokens=10, depth=3, top_k=3),
        )
        return HybridDrafter(head, LookupDrafter(SuffixSource(SuffixSettings(min_token_prob=0.0)), lookup_tree))
    raise AssertionError(name)


SETTINGS = {"T=1": dict(temperature=1.0), "T=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9)}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(
    "drafter_name",
    [
        "eagle-random-dynamic",
        "griffin-oracle-static",
        "griffin-oracle-chain1",
        "medusa-fitted",
        "moa-oracle-static",
        "moa-random-tli1-dynamic",
        "eagle3-random-dynamic",
        "peagle-random-dynamic",
        "dflash-random-dynamic",
        "griffin-oracle-vocab-dynamic",
        "ngram",
        "suffix",
        "griffin-oracle+suffix",
        "plain",
    ],
)
def test_sampled_distribution_matches_target(small_target, drafter_name, setting):
    base = SETTINGS[setting]
    params = [SamplingParams(seed=10_000 + i, **base) for i in range(SAMPLES)]
    gen = SpeculativeGenerator(small_target, drafter_for(drafter_name, small_target), eos_token_ids=[])
    results = gen.generate([PROMPT] * SAMPLES, 3, params)
    seqs = torch.tensor([r.tokens for r in results])
    assert seqs.shape == (SAMPLES, 3)
    joint, marginal3 = exact_distributions(small_target, SamplingParams(**base))
    observed12 = torch.zeros(VOCAB, VOCAB)
    observed12.index_put_((seqs[:, 0], seqs[:, 1]), torch.ones(SAMPLES), accumulate=True)
    observed3 = torch.bincount(seqs[:, 2], minlength=VOCAB)
    p12 = chi_square_pvalue(observed12, joint)
    p3 = chi_square_pvalue(observed3, marginal3)
    assert min(p12, p3) > ALPHA / 2, f"p-values {p12:.2e}, {p3:.2e}"
    accepted = sum(r.stats.accepted_tokens for r in results)
    cycles = sum(r.stats.cycles for r in results)
    if (drafter_name, setting) == ("moa-oracle-static", "T=1"):  # an exact draft, ranking by the draws, guesses each
        assert accepted == cycles * gen.drafter.max_depth
    elif drafter_name != "plain":  # both acceptance and rejection (residual resampling) really ran
        assert 0 < accepted < cycles * gen.drafter.max_depth
    if drafter_name == "griffin-oracle-chain1":  # the bonus-token branch ran in many rows
        assert sum(r.stats.accepted_tokens for r in results) > SAMPLES // 10


def test_detects_a_biased_sampler(small_target):
    """The test has power: the GRIFFIN/HASS reference bonus token (no temperature) is caught at T=0.7."""
    params = SamplingParams(temperature=0.7, top_p=0.9)
    joint, _ = exact_distributions(small_target, params)
    wrong, _ = exact_distributions(small_target, SamplingParams(temperature=1.0))
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(wrong.flatten().float(), SAMPLES, replacement=True, generator=gen)
    observed = torch.bincount(draws, minlength=VOCAB * VOCAB).view(VOCAB, VOCAB)
    with pytest.raises(AssertionError):
        assert chi_square_pvalue(observed, joint) > ALPHA / 2


def test_processing_matches_transformers_warpers():
    """temperature -> top-k -> top-p exactly as transformers' plain sampling applies them."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 10, 0.8), (0.5, 3, 1.0)]:
        ours = target_probs(logits, SamplingParams(temperature=t, top_k=k, top_p=p))
        scores = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1.0:
            scores = TopPLogitsWarper(p)(None, scores)
        torch.testing.assert_close(ours, scores.softmax(-1))


def run_mixed(gen: SpeculativeGenerator, prompts, budget: int, params) -> list[list[int]]:
    """Continuous batching by hand: rows join one cycle apart and every third cycle does not speculate."""
    batch = gen.admit(None, gen.prefill(prompts[:1], [budget], params[:1]))
    rows, cycle = list(batch.rows), 0
    while batch.size or len(rows) < len(prompts):
        if len(rows) < len(prompts):
            fresh = gen.prefill([prompts[len(rows)]], [budget], [params[len(rows)]])
            rows += fresh.rows
            batch = gen.admit(batch, fresh)
        gen.retire(batch)
        if batch.size:
            gen.cycle(batch, speculate=cycle % 3 != 2)
            cycle += 1
        gen.retire(batch)
    return [row.tokens for row in rows]


@pytest.mark.parametrize(
    "drafter_name",
    [
        "eagle-random-dynamic",
        "griffin-oracle-static",
        "medusa-fitted",
        "moa-random-tli1-dynamic",
        "eagle3-random-dynamic",
        "peagle-random-dynamic",
        "dflash-random-dynamic",
        "ngram",
        "suffix",
        "griffin-oracle+suffix",
    ],
)
def test_a_seed_gives_plain_samplings_tokens_whatever_the_tree_and_batch(small_target, drafter_name):
    """Seeded draws are keyed by (seed, token index): the text is plain sampling's for that seed whether the
    tokens came from a tree, from plain cycles, alone or in a batch that rows join mid-flight."""
    count, budget = 24, 10
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=7 * i - 50) for i in range(count)]
    prompts = [PROMPT + [i % VOCAB] for i in range(count)]
    plain = [
        r.tokens
        for r in SpeculativeGenerator(small_target, NoDrafter(), eos_token_ids=[]).generate(prompts, budget, params)
    ]
    assert len({tuple(t) for t in plain}) > count // 2  # the seeds really draw different texts
    spec_gen = SpeculativeGenerator(small_target, drafter_for(drafter_name, small_target), eos_token_ids=[])
    assert [r.tokens for r in spec_gen.generate(prompts, budget, params)] == plain
    assert [spec_gen.generate([p], budget, [q])[0].tokens for p, q in zip(prompts[:4], params[:4])] == plain[:4]
    assert run_mixed(spec_gen, prompts[:6], budget, params[:6]) == plain[:6]
