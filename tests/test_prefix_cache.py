"""Automatic prefix caching: blocks found only after the same tokens, least recently used leaves evicted first, and
generation over cached prefixes identical to the target's own greedy decoding (PyTorch and ONNX Runtime targets)."""

from __future__ import annotations

import pytest
import torch
from conftest import NEW_TOKENS, hf_greedy

from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter, TorchFeatureStep
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.prefix_cache import PrefixCache
from specdec_kit.runtime.synthetic import oracle_griffin

LAYERS, HEADS, DIM, FEATURES = 2, 1, 4, 3


def tensors_for(prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and features whose entries name the prompt's tokens (so a test can tell whose block it got)."""
    ids = torch.tensor(prompt, dtype=torch.float32)
    keys = ids[None, None, :, None].expand(LAYERS, HEADS, -1, DIM).clone()
    return keys, -keys, ids[:, None].expand(-1, FEATURES).clone()


def store(cache: PrefixCache, prompt: list[int]) -> None:
    cache.store(prompt, *tensors_for(prompt))


def test_a_block_is_found_only_after_the_same_tokens():
    cache = PrefixCache(block_size=4, max_tokens=64)
    prompt = list(range(1, 11))  # two whole blocks and two tokens
    store(cache, prompt)
    assert cache.cached_tokens == 8
    chain = cache.match(prompt + [99])
    assert [block.keys[0, 0, :, 0].tolist() for block in chain] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert torch.equal(chain[1].features[:, 0], torch.tensor([5.0, 6, 7, 8]))
    assert len(cache.match(prompt[:8])) == 1  # the last token is always computed: its logits choose the next
    assert cache.match([0, 2, 3, 4] + prompt[4:]) == []  # same second block after a different first: no hit
    assert len(cache.match(prompt[:4] + [0, 6, 7, 8, 9])) == 1
    assert cache.hit_tokens == 8 + 4 + 0 + 4 and cache.queried_tokens == 11 + 8 + 10 + 9


def test_least_recently_used_leaves_go_first_and_a_chain_keeps_its_start():
    cache = PrefixCache(block_size=2, max_tokens=8)  # four blocks
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    store(cache, a)
    store(cache, b)
    assert cache.cached_tokens == 8
    cache.match(a)  # a is now the more recent chain
    store(cache, [11, 12, 13])  # one block more: b's last block goes (a leaf), not b's first
    assert len(cache.match(a)) == 2 and len(cache.match(b)) == 1 and len(cache.match([11, 12, 13])) == 1
    store(cache, [14, 15, 16, 17, 18, 19, 20, 21, 22, 23])  # longer than the whole cache: only its start is kept
    assert cache.cached_tokens == 8 and len(cache.match([14, 15, 16, 17, 18, 19, 20, 21, 22])) == 4
    assert cache.match(a) == [] and cache.match(b) == []


def test_a_cache_too_small_for_one_block_is_refused(predictable_case):
    with pytest.raises(ValueError, match="at least one block"):
        PrefixCache.within(predictable_case.target, 0.001)


def shared_prefix_prompts(case) -> list[list[int]]:
    """A 37-token preamble before several of the case's prompts, a prompt repeated, and the preamble's start alone."""
    gen = torch.Generator().manual_seed(5)
    preamble = torch.randint(0, case.target.vocab_size, (37,), generator=gen).tolist()
    return [preamble + p for p in case.prompts[:4]] + [preamble[:20], preamble + case.prompts[0]]


def run_groups(gen: SpeculativeGenerator, prompts, groups):
    """Each group prefilled together and decoded to the end, one group after another; the rows in prompt order."""
    rows = []
    for group in groups:
        batch = gen.admit(
            None, gen.prefill([prompts[i] for i in group], [NEW_TOKENS] * len(group), [SamplingParams()] * len(group))
        )
        rows += list(batch.rows)
        while batch.size:
            gen.cycle(batch)
            gen.retire(batch)
    return rows


def oracle_drafter(case) -> FeatureTreeDrafter:
    return FeatureTreeDrafter(
        TorchFeatureStep(oracle_griffin(case.target), case.target.lm_head), DynamicTreeConfig(16, 3, 4)
    )


@pytest.mark.parametrize("speculative", [True, False], ids=["griffin", "plain"])
def test_generation_over_cached_prefixes_is_the_targets_greedy_output(predictable_case, speculative):
    case = predictable_case
    prompts = shared_prefix_prompts(case)
    cache = PrefixCache(block_size=8, max_tokens=256)
    gen = SpeculativeGenerator(
        case.target, oracle_drafter(case) if speculative else None, eos_token_ids=[], prefix_cache=cache
    )
    groups = [[0], [1, 2], [3, 4, 5]]
    rows = run_groups(gen, prompts, groups)
    assert [r.tokens for r in rows] == [hf_greedy(case.hf, p, NEW_TOKENS) for p in prompts]
    assert [r.stats.cached_tokens for r in rows] == [0, 32, 32, 32, 16, 40]
    if speculative:  # the draft's reading of cached blocks, loaded, drafts as a reading from scratch does
        uncached_gen = SpeculativeGenerator(case.target, oracle_drafter(case), eos_token_ids=[])
        uncached = run_groups(uncached_gen, prompts, groups)
        assert [r.stats.accepted_tokens for r in rows] == [r.stats.accepted_tokens for r in uncached]
        assert sum(r.stats.accepted_tokens for r in rows) > sum(r.stats.cycles for r in rows)
        blocks = cache.match(prompts[5])
        assert len(blocks) == 5 and all(block.draft_keys is not None for block in blocks)
        assert [block.draft_keys.shape[2] for block in blocks] == [7, 8, 8, 8, 8]


def test_an_onnx_runtime_engine_over_cached_prefixes_gives_its_uncached_output(demo_engine):
    from specdec_kit.runtime.engine import open_engine

    engine = open_engine(demo_engine)
    vocab = engine.target.vocab_size
    gen = torch.Generator().manual_seed(3)
    preamble = torch.randint(3, vocab, (40,), generator=gen).tolist()
    prompts = [preamble + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    for drafter in (engine.drafter, None):
        uncached = run_groups(SpeculativeGenerator(engine.target, drafter, eos_token_ids=[]), prompts, [[0], [1], [2]])
        cached = SpeculativeGenerator(
            engine.target, drafter, eos_token_ids=[], prefix_cache=PrefixCache.within(engine.target, 16)
        )
        rows = run_groups(cached, prompts + prompts, [[0], [1, 2], [3], [4, 5]])
        assert [r.tokens for r in rows] == [r.tokens for r in uncached + uncached]
        assert [r.stats.cached_tokens for r in rows] == [0, 32, 32, 32, 48, 48]
        accepted = [r.stats.accepted_tokens for r in uncached]
        assert [r.stats.accepted_tokens for r in rows] == accepted + accepted
