"""The backend contract and the drafter registry: the KV cache on its own, the protocols each backend implements,
one registration making a new draft kind usable everywhere, declared drafter methods, and cycle outcomes."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from specdec_kit.runtime import registry
from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.contract import FeatureStep, LayerCache, MedusaStep, TargetStep, TokenStep
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter, MedusaDrafter, NoDrafter, TorchFeatureStep
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.moa_drafting import TorchMoAStep
from specdec_kit.runtime.loader import make_drafter
from specdec_kit.runtime.ort.graphs import GraphCache
from specdec_kit.runtime.synthetic import oracle_eagle, random_medusa, random_moa, tiny_target


@torch.inference_mode()
def filled_cache(batch=2, capacity=8, layers=2, heads=1, dim=2) -> KVCache:
    cache = KVCache.allocate(layers, batch, heads, dim, capacity, torch.float32, "cpu")
    slots = torch.arange(capacity)
    cache.keys[:] = slots[None, None, None, :, None].float()  # each slot's key holds its slot number
    cache.values[:] = -slots[None, None, None, :, None].float()
    return cache


def test_window_writes_after_each_rows_length_and_masks_pending_slots():
    cache = filled_cache()
    cache.lengths = torch.tensor([3, 1])
    # two levels of a tree already pending (slots len+0, len+1); the new token sees the first of them only
    pending = torch.tensor([[[True, False, True]], [[True, False, True]]])
    window = cache.window(pending)
    assert window.k_len == 3 + 3 and window.slots.tolist() == [[5], [3]]
    new = torch.full((2, 1, 1, 2), 100.0)
    out = window.attend(0, torch.zeros(2, 1, 1, 2), new, -new)  # zero queries: the mean of the visible values
    assert float(cache.keys[0, 0, 0, 5, 0]) == 100 and float(cache.keys[0, 1, 0, 3, 0]) == 100
    assert out[:, 0, 0, 0].tolist() == pytest.approx([-(0 + 1 + 2 + 3 + 100) / 5, -(0 + 1 + 100) / 3])
    mask = window.mask[:, 0, 0]
    assert mask[0].tolist() == [True, True, True, True, False, True]  # 3 committed, pending 0 yes, 1 no, itself
    assert mask[1].tolist() == [True, True, False, True, False, False]  # row 1 is shorter: its slots end earlier


def test_slot_mask_puts_new_tokens_at_their_slots():
    cache = filled_cache()
    cache.lengths = torch.tensor([3, 1])
    # one level pending (slot len+0); two new tokens: the first sees it and itself, the second (padding) nothing new
    pending = torch.tensor([[[True, True, False], [False, False, False]]] * 2)
    mask = cache.slot_mask(pending)
    assert mask.shape == (2, 2, cache.capacity)
    assert mask[0, 0].tolist() == [True, True, True, True, True, False, False, False]  # committed, pending, itself
    assert mask[0, 1].tolist() == [True, True, True, False, False, False, False, False]
    assert mask[1, 0].tolist() == [True, True, True, False, False, False, False, False]  # row 1's slots end earlier
    assert mask[1, 1].tolist() == [True, False, False, False, False, False, False, False]
    cache.lengths = torch.tensor([7, 1])
    assert cache.slot_mask(pending).shape[2] >= 7 + 3  # grown so the new tokens' slots exist


def test_single_token_window_needs_no_mask():
    cache = filled_cache(batch=1)
    cache.lengths = torch.tensor([4])
    assert cache.window(torch.ones(1, 1, 1, dtype=torch.bool)).mask is None


def test_commit_compacts_accepted_slots_and_truncate_rolls_back():
    cache = filled_cache()
    cache.lengths = torch.tensor([2, 0])
    cache.commit(torch.tensor([[0, 2, 3], [1, 0, 0]]), torch.tensor([3, 1]))
    assert cache.lengths.tolist() == [5, 1]
    assert cache.keys[0, 0, 0, 2:5, 0].tolist() == [2, 4, 5]  # pending 0, 2, 3 of row 0 moved into place
    assert cache.keys[1, 1, 0, 0, 0].tolist() == 1 and cache.values[1, 1, 0, 0, 0].tolist() == -1
    cache.truncate(torch.tensor([3, 1]))
    assert cache.lengths.tolist() == [3, 1]
    with pytest.raises(ValueError, match="exceed the committed"):
        cache.truncate(4)


@torch.inference_mode()
def test_commit_moves_the_same_entries_listed_as_gathered(monkeypatch):
    """A few rows on the CPU commit by listed copies, the rest by gathers: the same cache either way, whatever the
    accepted slots (paths through a tree, rows with nothing accepted, any order)."""
    from specdec_kit.runtime.core import trees

    rng = torch.Generator().manual_seed(0)
    for _ in range(50):
        pending = torch.stack([torch.randperm(5, generator=rng)[:4] for _ in range(3)])
        counts = torch.randint(0, 5, (3,), generator=rng)
        caches = []
        for small in (0, trees.SMALL_ROWS):  # 0 rows: gathered
            monkeypatch.setattr(trees, "SMALL_ROWS", small)
            cache = filled_cache(batch=3, capacity=12)
            cache.values.copy_(torch.arange(cache.values.numel()).reshape(cache.values.shape).float())  # all differ
            cache.lengths = torch.tensor([2, 0, 5])
            cache.commit(pending, counts)
            caches.append(cache)
        gathered, listed = caches
        assert torch.equal(listed.lengths, gathered.lengths)
        assert torch.equal(listed.keys, gathered.keys) and torch.equal(listed.values, gathered.values)


def test_capacity_grows_keeping_contents_and_rows_join_and_leave():
    cache = filled_cache(capacity=4)
    cache.lengths = torch.tensor([4, 2])
    cache.ensure_capacity(9)
    assert cache.capacity >= 9 and cache.keys[0, 0, 0, :4, 0].tolist() == [0, 1, 2, 3]
    blocks = filled_cache(capacity=4)
    blocks.block, blocks.lengths = 4, torch.tensor([3, 1])
    blocks.ensure_capacity(9)
    assert blocks.capacity == 12 and blocks.keys[0, 0, 0, :4, 0].tolist() == [0, 1, 2, 3]
    blocks.lengths = torch.tensor([9, 2])
    blocks.select_rows(torch.tensor([1]))  # the longest row left: its spare blocks go with it
    assert blocks.capacity == 4 and blocks.keys[0, 0, 0, :4, 0].tolist() == [0, 1, 2, 3]
    fresh = KVCache.allocate(2, 1, 1, 2, 3, torch.float32, "cpu")
    fresh.lengths = torch.tensor([1])
    cache = KVCache.with_rows(cache, fresh)
    assert cache.batch == 3 and cache.lengths.tolist() == [4, 2, 1]
    cache.select_rows(torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [1, 4] and float(cache.keys[0, 1, 0, 3, 0]) == 3
    assert KVCache.with_rows(None, fresh) is fresh


def test_both_caches_and_every_backend_step_implement_the_contract():
    target = tiny_target(hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=40)
    assert isinstance(target, TargetStep)
    assert isinstance(target.new_cache(1, 4), LayerCache)
    assert isinstance(GraphCache([torch.zeros(1, 1, 0, 16)], [torch.zeros(1, 1, 0, 16)]), LayerCache)
    assert isinstance(TorchFeatureStep(oracle_eagle(target), target.lm_head), FeatureStep)
    assert isinstance(TorchMoAStep(random_moa(target), target), TokenStep)
    assert isinstance(random_medusa(target), MedusaStep)


def test_graph_cache_attends_over_past_plus_new_like_the_runtime_cache():
    """The same attention through a ``GraphCache`` (export) and a ``KVCache`` (runtime) gives the same output."""
    target = tiny_target(hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=40, seed=3)
    ids = torch.randint(0, 40, (1, 5))
    ar = torch.arange(5)
    causal = (ar[None, :] <= ar[:, None])[None]
    cache = target.new_cache(1, 16)
    target(ids[:, :3], ar[None, :3], causal[:, :3, :3], cache)
    cache.commit(ar[None, :3], torch.tensor([3]))
    ref = target(ids[:, 3:], ar[None, 3:], causal[:, 3:, 3:], cache)
    # the graph reads each layer's whole buffer (16 slots, stale ones too) under the mask over buffer + new keys
    with torch.inference_mode():
        cache.keys[:, :, :, 3:] = 1e4
    mask = cache.buffer_and_new_mask(causal[:, 3:, 3:])
    assert mask.shape == (1, 2, 16 + 2) and mask[0, :, :3].all() and not mask[0, :, 3:16].any()
    graph = GraphCache(list(cache.keys), list(cache.values))
    with torch.inference_mode():
        got = target.cached_step(ids[:, 3:], ar[None, 3:], mask, graph)
    assert torch.allclose(ref.logits, got.logits, atol=1e-5)
    assert graph.present()[0].shape == (2, 1, 1, 2, 16)


def test_every_kind_is_registered_with_its_family():
    assert registry.draft_kinds() == (
        "griffin",
        "eagle",
        "eagle2",
        "hass",
        "eagle3",
        "peagle",
        "dflash",
        "medusa",
        "moa",
        "ngram",
        "suffix",
    )
    assert registry.head_kinds() == registry.draft_kinds()[:-2]  # all but the model-free ngram and suffix
    assert registry.draft_kind("peagle").family.name == "peagle"
    assert registry.draft_kind("dflash").family.one_call and not registry.draft_kind("dflash").sized_for_cpu
    assert registry.draft_kind("suffix").family.name == "lookup" and registry.draft_kind("suffix").model_free
    assert registry.draft_kind("medusa").family.name == "medusa"
    assert registry.draft_kind("eagle3").family.name == "eagle3"
    assert (
        registry.draft_kind("moa").refusal("sglang").startswith("--draft moa builds for --backend onnxruntime or torch")
    )
    assert registry.draft_kind("griffin").refusal("sglang") is None
    # Medusa and EAGLE-3: no client drafter (EAGLE-3 reads three layers of the server's forward)
    assert registry.client_draft_kinds() == ("griffin", "eagle", "eagle2", "hass", "moa")
    with pytest.raises(ValueError, match="unknown draft kind 'nope'; expected one of"):
        registry.draft_kind("nope")


def test_one_registration_makes_a_new_kind_load_and_decode(tmp_path, monkeypatch):
    """A new kind is one ``register`` call: the loader, the tree defaults and the drafter all follow it."""
    target = tiny_target(hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=40, seed=5)
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    build_eagle = registry.Ref("specdec_kit.runtime.drafts.loading", "build_eagle")
    registry.register(
        registry.DraftKind(
            "eagle-chain",
            registry.FeatureFamily(),
            build_eagle,
            "EAGLE weights on a chain",
            default_tree="static:chain-3",
        )
    )
    save_draft(oracle_eagle(target), tmp_path / "head", "eagle2")
    from specdec_kit.runtime.loader import resolve_tree

    tree = resolve_tree("eagle-chain", None, None, None, None)
    assert isinstance(tree, StaticTree) and tree.buffers.max_depth == 3
    drafter = make_drafter(target, "eagle-chain", tmp_path / "head", tree)
    prompt = [1, 2, 3, 4]
    result = SpeculativeGenerator(target, drafter).generate([prompt], 24)[0]
    assert result.tokens == hf_greedy(target.hf_model, prompt, 24)
    assert result.stats.acceptance_length > 2.0  # the oracle head is accepted: the kind's drafter really drafts
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.DraftKind("eagle-chain", registry.FeatureFamily(), build_eagle, "again"))


def test_trees_are_set_through_the_declared_method():
    target = tiny_target(hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=40)
    drafter = FeatureTreeDrafter(TorchFeatureStep(oracle_eagle(target), target.lm_head), DynamicTreeConfig(12, 3, 3))
    drafter.set_tree(DynamicTreeConfig(4, 2, 2))
    assert drafter.tree.total_tokens == 4 and drafter.max_nodes == 12  # cache sizing keeps the largest tree
    medusa = MedusaDrafter(random_medusa(target, heads=2), StaticTree.from_choices([[0], [0, 0]]))
    with pytest.raises(ValueError, match="static trees"):
        medusa.set_tree(DynamicTreeConfig(4, 2, 2))
    with pytest.raises(ValueError, match="drafts no tree"):
        NoDrafter().set_tree(DynamicTreeConfig(4, 2, 2))


def test_a_cycle_reports_its_outcome_as_the_rows_statistics_do():
    target = tiny_target(hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=40, seed=9)
    gen = SpeculativeGenerator(
        target, registry.drafter_for("eagle2", oracle_eagle(target), target, DynamicTreeConfig(8, 3, 2))
    )
    from specdec_kit.runtime.core.sampling import SamplingParams

    batch = gen.admit(None, gen.prefill([[1, 2, 3], [4, 5]], [30, 30], [SamplingParams()] * 2))
    before = [len(r.tokens) for r in batch.rows]
    outcome = gen.cycle(batch)
    assert outcome.speculative and outcome.rows == 2
    assert outcome.emitted == sum(len(r.tokens) for r in batch.rows) - sum(before)
    assert outcome.accepted_tokens == sum(r.stats.accepted_tokens for r in batch.rows) > 0
    assert outcome.draft_tokens == sum(r.stats.draft_tokens for r in batch.rows) == 2 * 7
    assert outcome.accepted_per_depth[0] == sum(r.stats.accepted_per_depth[0] for r in batch.rows)
    plain = gen.cycle(batch, speculate=False)
    assert not plain.speculative and plain.draft_tokens == 0 and plain.emitted == 2


def test_drafter_checkpoint_restores_its_own_caches():
    target = tiny_target(hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=40)
    drafter = registry.drafter_for("moa", random_moa(target, tli=1), target, DynamicTreeConfig(6, 2, 2))
    drafter.reset(1, 16)
    drafter.bind(target.new_cache(1, 16))
    mark = drafter.checkpoint()
    for cache in drafter.owned_caches():
        cache.commit(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]))
    drafter.restore(mark)
    assert [int(c.lengths[0]) for c in drafter.owned_caches()] == [0, 0]
