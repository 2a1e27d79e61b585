"""Greedy speculative output is token-identical to transformers' greedy generation of the target.

Every draft type, with random-weight drafts and with drafts that predict well, at batch 4 with mixed prompt
lengths (20 prompts x 64 new tokens each) and at batch 1 (the first 8 of them).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import NEW_TOKENS, TargetCase, hf_greedy, make_prompts

from specdec_kit.runtime.core.choices import EAGLE1_DEFAULT, MC_SIM_7B_63
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.drafting import NoDrafter
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import drafter_for
from specdec_kit.runtime.synthetic import (
    dflash_with_draft_vocab,
    eagle3_layers,
    fitted_medusa,
    oracle_eagle,
    oracle_griffin,
    oracle_moa,
    random_dflash,
    random_eagle,
    random_eagle3,
    random_griffin,
    random_medusa,
    random_moa,
    random_peagle,
    with_draft_vocab,
)

DYNAMIC = DynamicTreeConfig(total_tokens=24, depth=4, top_k=4)


@functools.cache
def _eagle3_trained_for(hf_model, method: str = "eagle3") -> Path:
    from specdec_kit.train.eagle3 import eagle3_spec, train_eagle3

    target = TargetModel(hf_model)
    data = torch.randint(0, target.vocab_size, (64, 64), generator=torch.Generator().manual_seed(0))
    parallel = {"steps": 200, "step_decay": 0.5} if method == "peagle" else {"steps": 100}
    spec = eagle3_spec(
        method,
        **parallel,
        batch=8,
        seq_len=64,
        lr=3e-3,
        warmup=10,
        draft_vocab=60,
        ttt_length=4,
        feature_layers=list(eagle3_layers(target)),
    )
    folder = Path(tempfile.mkdtemp(prefix=f"{method}-"))
    train_eagle3(target, data, spec, folder, progress=False)
    return folder


@functools.cache
def _dflash_trained_for(hf_model) -> Path:
    """A DFlash head trained by the kit's trainer on the target's own greedy continuations (its blocks guess what
    the target writes next, so its data must be what the target writes)."""
    from specdec_kit.train.dflash import DFlashSpec, train_dflash

    starts = torch.randint(0, hf_model.config.vocab_size, (64, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        data = hf_model.generate(starts, max_new_tokens=60, do_sample=False, pad_token_id=0)
    spec = DFlashSpec(steps=150, batch=8, seq_len=64, lr=3e-3, warmup=10, block_size=5, blocks_per_row=16)
    folder = Path(tempfile.mkdtemp(prefix="dflash-"))
    train_dflash(TargetModel(hf_model), data, spec, folder, progress=False)
    return folder


def trained_dflash(target: TargetModel):
    from specdec_kit.runtime.checkpoint import load_draft

    return load_draft(
        _dflash_trained_for(target.hf_model),
        "dflash",
        target.hidden_size,
        target.vocab_size,
        dtype=target.dtype,
        target_shape=(target.num_layers, 2 * target.num_kv_heads * target.head_dim),
    )


def trained_eagle3(target: TargetModel, method: str = "eagle3"):
    """EAGLE-3 (and P-EAGLE) have no hand-built oracle: a small head trained by the kit's own trainer (training-time
    test, a draft vocabulary of 60 of the 80 tokens), written in the official layout and loaded back."""
    from specdec_kit.runtime.checkpoint import load_draft

    return load_draft(
        _eagle3_trained_for(target.hf_model, method),
        method,
        target.hidden_size,
        target.vocab_size,
        dtype=target.dtype,
        target_shape=(target.num_layers, 2 * target.num_kv_heads * target.head_dim),
    )


# test case -> (registered draft kind, module builders (good, random), tree)
CASES = {
    "eagle2": ("eagle2", (oracle_eagle, random_eagle), DYNAMIC),  # EAGLE-2 / HASS: EAGLE weights, dynamic tree
    "eagle1": ("eagle", (oracle_eagle, random_eagle), StaticTree.from_choices(EAGLE1_DEFAULT)),
    "griffin": ("griffin", (oracle_griffin, random_griffin), DYNAMIC),
    "griffin-static": ("griffin", (oracle_griffin, random_griffin), StaticTree.from_choices(EAGLE1_DEFAULT)),
    # a reduced draft vocabulary (the target's LM-head rows of 3/4 of its tokens): proposals only from those
    "griffin-vocab": (
        "griffin",
        (
            lambda t: with_draft_vocab(oracle_griffin(t), 3 * t.vocab_size // 4),
            lambda t: with_draft_vocab(random_griffin(t), 3 * t.vocab_size // 4),
        ),
        DYNAMIC,
    ),
    "eagle3": ("eagle3", (trained_eagle3, random_eagle3), DYNAMIC),
    "eagle3-static": ("eagle3", (trained_eagle3, random_eagle3), StaticTree.from_choices(EAGLE1_DEFAULT)),
    # P-EAGLE: one forward proposes 4 tokens; a tree of their top-4 each, and vLLM's chain
    "peagle": ("peagle", (lambda t: trained_eagle3(t, "peagle"), random_peagle), DYNAMIC),
    "peagle-chain": ("peagle", (lambda t: trained_eagle3(t, "peagle"), random_peagle), DynamicTreeConfig(4, 3, 1)),
    # DFlash: one block of 4 masked slots; a tree of each position's top-4, and the official chain
    "dflash": ("dflash", (trained_dflash, random_dflash), DYNAMIC),
    "dflash-chain": ("dflash", (trained_dflash, random_dflash), DynamicTreeConfig(5, 3, 1)),
    # a reduced draft vocabulary with the head's own LM head (speculators' default DFlash)
    "dflash-vocab": (
        "dflash",
        (
            lambda t: dflash_with_draft_vocab(trained_dflash(t), t, 3 * t.vocab_size // 4),
            lambda t: dflash_with_draft_vocab(random_dflash(t), t, 3 * t.vocab_size // 4),
        ),
        DYNAMIC,
    ),
    "medusa": (
        "medusa",
        (lambda t: fitted_medusa(t, heads=4), lambda t: random_medusa(t, heads=4)),
        StaticTree.from_choices(MC_SIM_7B_63),
    ),
    # Mixture of Attentions: oracle with TLI = L, or random with TLI = 1 (dynamic tree) / TLI = 0 (static)
    "moa": ("moa", (oracle_moa, lambda t: random_moa(t, tli=1)), DYNAMIC),
    "moa-static": ("moa", (oracle_moa, lambda t: random_moa(t, tli=0)), StaticTree.from_choices(EAGLE1_DEFAULT)),
}


def build_drafter(kind: str, quality: str, target):
    """Every draft through the registry, as the loader and the engines build them."""
    registered, (good, bad), tree = CASES[kind]
    return drafter_for(registered, (good if quality == "good" else bad)(target), target, tree)


SINGLE_PROMPTS = 8  # prompts run one at a time; batches of 4 cover all of them


def run_batches(case: TargetCase, drafter, batch: int):
    """The case's prompts ``batch`` at a time (at batch 1, the first ``SINGLE_PROMPTS``): results in prompt order."""
    gen = SpeculativeGenerator(case.target, drafter)  # an EAGLE-3 drafter reads a tapped view of the target
    prompts = case.prompts[:SINGLE_PROMPTS] if batch == 1 else case.prompts
    results = []
    for start in range(0, len(prompts), batch):
        results += gen.generate(prompts[start : start + batch], NEW_TOKENS)
    return results


KINDS = list(CASES)
FAST_SINGLE = ("griffin", "eagle3")  # batch 1 with random drafts: the rest of the kinds run in the slow tier


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_good_drafts_identical(predictable_case, kind, batch):
    results = run_batches(predictable_case, build_drafter(kind, "good", predictable_case.target), batch)
    for prompt, res, ref in zip(predictable_case.prompts, results, predictable_case.references):
        assert res.tokens == ref, f"prompt of length {len(prompt)} diverged"
    tau = sum(r.stats.acceptance_length for r in results) / len(results)
    # Medusa and P-EAGLE guess several steps ahead from one forward (without the tokens between); a reduced
    # vocabulary misses a quarter of the target's tokens
    floor = 1.5 if kind in ("medusa", "griffin-vocab") else 1.3 if kind.startswith(("peagle", "dflash")) else 2.0
    assert tau > floor, f"a good {kind} draft should be accepted often; tau={tau:.2f}"


@pytest.mark.parametrize(
    "kind, batch",
    [(kind, 4) for kind in KINDS]
    + [(kind, 1) if kind in FAST_SINGLE else pytest.param(kind, 1, marks=pytest.mark.slow) for kind in KINDS],
)
def test_random_drafts_identical(random_case, kind, batch):
    results = run_batches(random_case, build_drafter(kind, "random", random_case.target), batch)
    for res, ref in zip(results, random_case.references):
        assert res.tokens == ref
    assert all(r.finish_reason == "length" and len(r.tokens) == NEW_TOKENS for r in results)


def test_plain_decoding_identical(random_case):
    results = run_batches(random_case, NoDrafter(), 4)
    assert [r.tokens for r in results] == random_case.references
    assert all(r.stats.acceptance_length == 1.0 for r in results)


def test_batch_mixes_lengths(predictable_case):
    """The batch-4 runs above must really mix lengths; guard the fixture."""
    lengths = [len(p) for p in predictable_case.prompts[:4]]
    assert len(set(lengths)) > 1


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_identical(family):
    """Qwen2 (q/k/v biases) and Mistral targets through the same adapter, plain and speculative."""
    case = TargetCase(
        family,
        family=family,
        hidden_size=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=96,
        context_mix=0.3,
        logit_scale=20.0,
        seed=5,
    )
    prompts = make_prompts(96, count=6, seed=3)
    refs = [hf_greedy(case.hf, p, 32) for p in prompts]
    for drafter in (NoDrafter(), build_drafter("griffin", "good", case.target)):
        out = SpeculativeGenerator(case.target, drafter).generate(prompts, 32)
        assert [r.tokens for r in out] == refs


def test_float64_long_generation_identical():
    """A longer run in float64 (no rounding near-ties at all): 200 tokens, batch of 3."""
    case = TargetCase(
        "f64",
        hidden_size=64,
        layers=3,
        heads=4,
        kv_heads=4,
        intermediate=128,
        vocab=128,
        context_mix=0.5,
        logit_scale=10.0,
        seed=9,
        dtype=torch.float64,
    )
    prompts = make_prompts(128, count=3, seed=8)
    refs = [hf_greedy(case.hf, p, 200) for p in prompts]
    out = SpeculativeGenerator(case.target, build_drafter("griffin", "random", case.target)).generate(prompts, 200)
    assert [r.tokens for r in out] == refs
