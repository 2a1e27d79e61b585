"""Model-free drafting: prompt lookup, suffix trees and a head merged with either, lossless through the one loop.

The sources are checked on texts whose answer is known (which continuation, how often, what the budget keeps, what
eviction leaves); the drafters against transformers' greedy decoding at batch 1 and 4 and with rows joining a running
batch; the sampled case is in ``test_sampling_distribution.py``.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from conftest import NEW_TOKENS, hf_greedy
from test_sampling_distribution import run_mixed

from specdec_kit.runtime.checkpoint import load_draft, save_draft
from specdec_kit.runtime.core.lookup import (
    Budget,
    NgramIndex,
    NgramSettings,
    Proposal,
    SuffixCache,
    SuffixSettings,
    SuffixTrie,
    settings_from,
)
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import (
    HEAD,
    HYBRID,
    LOOKUP,
    DynamicTreeConfig,
    SourcedTree,
    StaticTree,
    parse_tree_spec,
)
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter, LookupDrafter, merged
from specdec_kit.runtime.decoding.proposal_sizing import RunningMean
from specdec_kit.runtime.drafts.loading import DraftLoadError
from specdec_kit.runtime.loader import make_drafter, resolve_tree
from specdec_kit.runtime.registry import draft_choices, draft_kind, hybrid_parts, lookup_kinds, zoo_heads
from specdec_kit.runtime.synthetic import oracle_griffin, random_griffin


def paths(p: Proposal) -> set[tuple[int, ...]]:
    """Every node's path of tokens from the root."""
    out = set()
    for i in range(len(p)):
        path, node = [], i
        while node >= 0:
            path.append(p.tokens[node])
            node = p.parents[node]
        out.add(tuple(reversed(path)))
    return out


def test_prompt_lookup_continues_the_longest_ngram_from_its_latest_occurrences():
    index = NgramIndex(min_n=1, max_n=3, occurrences=2)
    index.extend([5, 6, 7, 1, 2, 3, 8, 9, 4, 2, 3, 9, 1, 2, 3])
    # "1 2 3" occurred once before (then 8 9 4 ...); "2 3" twice (8 ..., 9 ...): the longest wins
    chain = index.propose(Budget(nodes=3, depth=3, branches=2))
    assert chain.tokens == [8, 9, 4] and chain.parents == [-1, 0, 1] and chain.scores == [1.0, 1.0, 1.0]
    index.extend([7])  # "2 3 7", "3 7" never occurred; "7" once (then 1 2 3)
    assert index.propose(Budget(4, 4, 1)).tokens == [1, 2, 3, 8]
    index.extend([0])  # nothing ever followed a 0
    assert len(index.propose(Budget(4, 4, 1))) == 0


def test_prompt_lookup_branches_where_its_occurrences_disagree_and_keeps_to_the_budget():
    index = NgramIndex(min_n=2, max_n=2, occurrences=3)
    index.extend([1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2, 6, 0, 1, 2])
    tree = index.propose(Budget(nodes=4, depth=3, branches=2))
    assert len(tree) == 4
    assert (3,) in paths(tree) and tree.scores[tree.tokens.index(3)] == pytest.approx(2 / 3)
    assert all(len(p) <= 3 for p in paths(tree))
    children = [sum(1 for q in tree.parents if q == node) for node in [-1, *range(len(tree))]]
    assert max(children) <= 2
    for i, parent in enumerate(tree.parents):  # a child never scores above its parent
        assert parent < i and (parent < 0 or tree.scores[i] <= tree.scores[parent])


def test_a_suffix_trie_counts_what_followed_each_context():
    trie = SuffixTrie(depth=4)
    trie.extend(0, [1, 2, 3, 1, 2, 4, 1, 2, 3])
    matches = trie.match([9, 1, 2], longest=3)
    assert [length for length, _ in matches] == [2, 1]
    proposal = trie.grow(matches[0][1], Budget(nodes=2, depth=2, branches=2))
    assert proposal.tokens[0] == 3 and proposal.scores[0] == pytest.approx(2 / 3)


def test_a_growing_sequences_own_suffixes_are_its_matches_without_a_search():
    gen = torch.Generator().manual_seed(0)
    trie = SuffixTrie(depth=8)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    for start in range(0, 300, 7):  # grown a few tokens at a time, as cycles verify them
        trie.extend(0, tokens[start : start + 7])
        seen = tokens[: start + 7]
        assert trie.open_matches(0, 7) == trie.match(seen, 7)


def test_suffix_decoding_learns_from_finished_responses_and_forgets_the_oldest():
    cache = SuffixCache(
        SuffixSettings(max_tree_depth=8, max_spec_factor=4.0, min_token_prob=0.1, max_cached_requests=1)
    )
    first = cache.open()
    cache.extend(first, [100, 101, 7, 8, 9, 10, 11])
    cache.finish(first, response_from=2)  # its response: 7 8 9 10 11
    second = cache.open()
    cache.extend(second, [50, 7, 8])  # its own text holds no continuation; the earlier response does
    assert cache.propose(second, Budget(4, 4, 1)).tokens == [9, 10, 11]
    cache.finish(second, response_from=1)  # its response replaces the first (one kept)
    third = cache.open()
    cache.extend(third, [7, 8])
    assert cache.propose(third, Budget(4, 4, 1)).tokens == []
    fresh = SuffixTrie(depth=8)
    fresh.extend(0, [7, 8])
    assert _counts(cache.shared, cache.shared.root) == _counts(fresh, fresh.root)  # exactly the kept response's counts
    emptied = len(cache.shared._free)
    cache.extend(third, [20, 21])
    cache.finish(third, response_from=0)  # 7 8 20 21 replaces 7 8: its new nodes reuse the emptied ones
    fresh.extend(0, [20, 21])
    assert emptied > 0 and len(cache.shared._counts) == 1 + len(_nodes(cache.shared, cache.shared.root)) + len(
        cache.shared._free
    )
    assert len(cache.shared._free) < emptied and _counts(cache.shared, cache.shared.root) == _counts(fresh, fresh.root)


def _nodes(trie: SuffixTrie, node: int) -> list[int]:
    return [n for child in trie.children(node).values() for n in (child, *_nodes(trie, child))]


def _counts(trie: SuffixTrie, node: int) -> dict:
    return {tok: (trie.count(child), _counts(trie, child)) for tok, child in trie.children(node).items()}


def test_merging_keeps_the_likeliest_paths_of_both_as_one_trie():
    head = Proposal([4, 5, 6], [-1, 0, -1], [0.6, 0.3, 0.2])
    lookup = Proposal([4, 7, 8], [-1, 0, 1], [0.9, 0.9, 0.9])
    both = merged(head, lookup, nodes=4)
    assert paths(both) == {(4,), (4, 7), (4, 7, 8), (4, 5)}
    assert both.scores[both.tokens.index(4)] == 0.9  # a path both propose keeps the higher estimate
    assert len(merged(head, lookup, nodes=10)) == 5
    rounded = merged(Proposal([4, 5], [-1, 0], [0.5, 0.5000001]), Proposal([9], [-1], [0.5]), nodes=2)
    assert paths(rounded) == {(4,), (9,)} or paths(rounded) == {(4,), (4, 5)}  # a child never outranks its parent
    first = merged(head, Proposal([7], [-1], [0.2]), nodes=2, rule="lookup-first")
    assert paths(first) == {(7,), (4,)}  # the lookup's node first, then the head's best


def test_settings_files_are_checked_and_round_trip(tmp_path):
    settings = SuffixSettings(max_tree_depth=16, min_token_prob=0.2)
    save_draft(settings, tmp_path / "suffix", "suffix")
    assert load_draft(tmp_path / "suffix", "suffix", 0, 0) == settings
    assert load_draft(None, "ngram", 0, 0) == NgramSettings()
    bad = tmp_path / "bad.json"
    bad.write_text('{"prompt_lookup_max": 2, "prompt_lookup_min": 3}')
    with pytest.raises(DraftLoadError, match="bad.json.*prompt_lookup_min <= prompt_lookup_max"):
        load_draft(bad, "ngram", 0, 0)
    with pytest.raises(ValueError, match="unknown key 'depth'"):
        settings_from(SuffixSettings, {"depth": 3})
    with pytest.raises(ValueError, match="'occurrences' expects int"):
        settings_from(NgramSettings, {"occurrences": 1.5})


def test_the_registry_knows_the_model_free_kinds_and_their_hybrids():
    assert lookup_kinds() == ("ngram", "suffix")
    assert not set(lookup_kinds()) & set(zoo_heads())  # nothing to train or ship
    assert {"griffin+suffix", "eagle3+ngram"} <= set(draft_choices())
    assert hybrid_parts("griffin+suffix") == ("griffin", "suffix")
    with pytest.raises(ValueError, match="a hybrid's head is one of"):
        hybrid_parts("medusa+suffix")
    with pytest.raises(ValueError, match="after '\\+' comes a model-free kind"):
        hybrid_parts("griffin+eagle3")
    with pytest.raises(ValueError, match="dynamic tree"):
        draft_kind("ngram").family.check_tree(StaticTree.from_choices([[0], [0, 0]]))
    assert parse_tree_spec(draft_kind("suffix").default_tree) == DynamicTreeConfig(24, 15, 2)


LOOKUP_CASES = ["ngram", "suffix", "griffin+suffix", "griffin+ngram"]


def lookup_drafter(kind: str, target, good: bool = True):
    """A model-free drafter, or a hybrid over an oracle (``good``) or a random GRIFFIN head."""
    head, lookup = hybrid_parts(kind)
    if lookup is None:
        return make_drafter(target, kind, None, resolve_tree(kind, None, None, None, None))
    module = (oracle_griffin if good else random_griffin)(target)
    return HybridDrafter(
        draft_kind(head).family.torch_drafter(module, target, DynamicTreeConfig(total_tokens=16, depth=4, top_k=4)),
        make_drafter(target, lookup, None, resolve_tree(lookup, None, None, None, None)),
    )


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", LOOKUP_CASES)
def test_model_free_and_hybrid_drafts_are_greedy_identical(random_case, predictable_case, kind, batch):
    for case, good in ((random_case, False), (predictable_case, True)):
        gen = SpeculativeGenerator(case.target, lookup_drafter(kind, case.target, good))
        prompts = case.prompts[:8] if batch == 1 else case.prompts
        results = []
        for start in range(0, len(prompts), batch):
            results += gen.generate(prompts[start : start + batch], NEW_TOKENS)
        assert [r.tokens for r in results] == case.references[: len(prompts)], case.name
        tau = sum(r.stats.acceptance_length for r in results) / len(results)
        assert tau > 1.3, f"{kind} on {case.name}: repeating text should be copied (tau {tau:.2f})"


def test_a_hybrid_accepts_at_least_what_its_head_does_on_text_that_repeats(predictable_case):
    """On prompts whose answer repeats them, the merged tree holds the copy the head alone misses."""
    target = predictable_case.target
    base = [int(t) for t in torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(5))]
    prompts = [base + hf_greedy(predictable_case.hf, base, 40)[:30] + base[:4]]  # ends where a copy would start
    head = SpeculativeGenerator(target, lookup_drafter("griffin+suffix", target, good=False).head)
    hybrid = SpeculativeGenerator(target, lookup_drafter("griffin+suffix", target, good=False))
    ref = hf_greedy(predictable_case.hf, prompts[0], 32)
    alone, both = head.generate(prompts, 32)[0], hybrid.generate(prompts, 32)[0]
    assert alone.tokens == ref == both.tokens
    assert both.stats.acceptance_length > alone.stats.acceptance_length


def test_a_calibrated_merge_ranks_lookup_nodes_by_what_verification_accepted(predictable_case):
    """A continuation seen once scores 1.0 among the lookup's shares, above any head node; the kit's rule ranks it by
    the acceptance its sizing measured for nodes like it, so once such nodes are known to fail, the head's keep
    their place."""
    drafter = lookup_drafter("griffin+suffix", predictable_case.target)
    assert drafter.rule == "calibrated"
    weak = Proposal([9, 10], [-1, 0], [1.0, 1.0], match=1)
    assert drafter._ranked(weak).scores == [1.0, 1.0]  # nothing measured yet: its own scores
    for _ in range(50):
        drafter.lookup.sizing.calibration.observe(weak, set())  # verified, never accepted
    ranked = drafter._ranked(weak)
    assert ranked.tokens == weak.tokens and ranked.parents == weak.parents and max(ranked.scores) < 0.1
    head = Proposal([4], [-1], [0.6])
    assert paths(merged(head, ranked, nodes=1, rule="calibrated")) == {(4,)}
    assert paths(merged(head, weak, nodes=1, rule="probability")) == {(9,)}
    with pytest.raises(ValueError, match="expected one of \\('calibrated', 'probability', 'lookup-first'\\)"):
        HybridDrafter(drafter.head, drafter.lookup, "frequency")


def test_rows_joining_a_running_batch_read_their_prompts_as_they_join(random_case):
    """Continuous batching: rows join mid-flight and some cycles are plain; the output stays the target's and each
    row's lookup reads only its own text."""
    target = random_case.target
    gen = SpeculativeGenerator(target, lookup_drafter("suffix", target))
    prompts, budget = random_case.prompts[:5], 24
    outputs = run_mixed(gen, prompts, budget, [gen_params()] * len(prompts))
    assert outputs == [hf_greedy(random_case.hf, p, budget) for p in prompts]
    drafter = gen.drafter
    assert isinstance(drafter, LookupDrafter)
    # the rows that left gave their responses to the shared trie (as far as a draft read them: the last cycle's
    # tokens never reach it); the last row leaves at the next batch's start
    drafter.reset(0, 0)
    responses = drafter.source.cache.responses
    assert len(responses) == len(prompts) and not drafter.source.cache.sequences
    for response in responses:
        assert any(out[: len(response)] == response for out in outputs) and len(response) >= budget // 2


def test_a_hybrid_switching_between_its_parts_stays_lossless(predictable_case):
    """A server's policy picks the merged tree, the head alone, the lookup alone or plain decoding per cycle: with
    every switch (and rows joining), the output is the target's, and each part really drafted."""
    target = predictable_case.target
    drafter = lookup_drafter("griffin+suffix", target)
    gen = SpeculativeGenerator(target, drafter)
    tree = DynamicTreeConfig(total_tokens=16, depth=4, top_k=4)
    plans = [SourcedTree(16, 4, 4, source=s) for s in (HYBRID, HEAD, LOOKUP, LOOKUP)] + [None]
    prompts, budget = predictable_case.prompts[:6], 40
    used = {HYBRID: 0, HEAD: 0, LOOKUP: 0}
    batch = gen.admit(None, gen.prefill(prompts[:2], [budget] * 2, [gen_params()] * 2))
    rows, cycle = list(batch.rows), 0
    while batch.size or len(rows) < len(prompts):
        if len(rows) < len(prompts) and cycle % 2:
            fresh = gen.prefill([prompts[len(rows)]], [budget], [gen_params()])
            rows += fresh.rows
            batch = gen.admit(batch, fresh)
        gen.retire(batch)
        if batch.size:
            plan = plans[cycle % len(plans)]
            if plan is not None:
                gen.set_tree(plan)
                used[plan.source] += gen.cycle(batch).accepted_tokens
            else:
                gen.cycle(batch, speculate=False)
            cycle += 1
        gen.retire(batch)
    assert [row.tokens for row in rows] == [hf_greedy(predictable_case.hf, p, budget) for p in prompts]
    assert all(used.values()), used
    assert drafter.head.tree == tree  # the head drafts plain trees (an engine's whole-tree graph matches them)


def test_a_hybrid_judges_a_cycle_by_merged_trees_in_cycles_like_it(predictable_case):
    """Merged trees measured only while the lookup was copying say nothing of a cycle where it found nothing (a
    merged tree there is the head's alone): such a cycle tries a merged tree first, and is then judged by its own."""
    drafter = lookup_drafter("griffin+suffix", predictable_case.target)
    match, nothing = [Proposal([4, 5], [-1, 0], [0.9, 0.8])], [Proposal()]
    measured(drafter, {True: 2.0}, 0.05)  # merged trees, all in cycles with a match
    assert drafter.lookup.sizing.rate(match) is None  # no lookup-only cycle timed yet: the lookup's trees are tried
    assert drafter.lookup_suffices(match)
    assert not drafter.lookup_suffices(nothing)
    measured(drafter, {False: 0.1}, 0.05)
    assert drafter.lookup_suffices(nothing)


def test_a_hybrid_without_lookup_only_cycles_merges_in_every_cycle(predictable_case):
    """``lookup_alone=False`` (``specdec-bench-lookup --methods hybrid-merged``): where the lookup's trees alone would
    lead, the cycle still merges, and the output stays the target's."""
    drafter = lookup_drafter("griffin+suffix", predictable_case.target)
    match, nothing = [Proposal([4, 5], [-1, 0], [0.9, 0.8])], [Proposal()]
    measured(drafter, {True: 2.0, False: 0.1}, 0.05)
    assert drafter.lookup_suffices(match) and drafter.lookup_suffices(nothing)
    merging = HybridDrafter(drafter.head, drafter.lookup, lookup_alone=False)
    measured(merging, {True: 2.0, False: 0.1}, 0.05)
    assert not merging.lookup_suffices(match) and not merging.lookup_suffices(nothing)
    gen = SpeculativeGenerator(predictable_case.target, merging)
    results = gen.generate(predictable_case.prompts[:4], NEW_TOKENS)
    assert [r.tokens for r in results] == predictable_case.references[:4]
    assert merging._since_merged == 0  # no cycle drafted the lookup's tree alone


def test_a_hybrid_keeps_each_choice_with_its_estimates_and_what_the_cycle_gave(predictable_case):
    """With a list to keep them in, every choice's record is settled at the next draft (seconds to it, tokens the
    cycle committed), and a request's last choice, which no draft follows, is dropped when the next batch starts."""
    drafter = lookup_drafter("griffin+suffix", predictable_case.target)
    drafter.choices = []
    gen = SpeculativeGenerator(predictable_case.target, drafter)
    results = gen.generate(predictable_case.prompts[:1], NEW_TOKENS)
    first = list(drafter.choices)
    assert len(first) == results[0].stats.cycles and first[-1].seconds is None
    settled = first[:-1]
    assert all(c.seconds > 0 and c.tokens >= 1 for c in settled)
    assert any(c.lookup_only for c in settled) and any(c.merged_rate is not None for c in settled)
    assert sum(c.tokens for c in settled) < results[0].stats.generated_tokens
    gen.generate(predictable_case.prompts[1:2], 4)  # a new batch: the first request's last choice goes
    assert drafter.choices[: len(settled)] == settled and first[-1] not in drafter.choices


def test_a_model_free_draft_keeps_each_cycles_estimate_and_what_it_gave(predictable_case):
    drafter = lookup_drafter("suffix", predictable_case.target)
    drafter.choices = []
    results = SpeculativeGenerator(predictable_case.target, drafter).generate(predictable_case.prompts[:1], NEW_TOKENS)
    assert len(drafter.choices) == results[0].stats.cycles and drafter.choices[-1].seconds is None
    assert all(c.lookup_only and c.seconds > 0 and c.tokens >= 1 for c in drafter.choices[:-1])
    assert any(c.matched and c.lookup_rate for c in drafter.choices[:-1])


def measured(drafter, gains: dict[bool, float], seconds: float, cycles: int = 32) -> None:
    """``drafter`` has measured merged trees giving ``gains`` accepted tokens a greedy cycle (per kind: whether the
    lookup found a proposal, ``cycles`` of each) in ``seconds``; all greedy cycles together, their mean."""
    for matched, gain in gains.items():
        drafter.gains[(matched, False)] = RunningMean(drafter.smoothing)
        for _ in range(cycles):
            drafter.gains[(matched, False)].add(gain)
    drafter.sampled_gains, drafter.seconds = {False: RunningMean()}, RunningMean()
    drafter.sampled_gains[False].add(sum(gains.values()) / len(gains))
    drafter.seconds.add(seconds)


def test_a_hybrid_times_merged_cycles_of_both_kinds_as_one(predictable_case):
    """A merged tree costs the same whether the lookup found something or not (one head draft, one node budget): a
    merged cycle timed where the lookup found nothing sets the time a cycle with a match is judged by. (A probe, the
    only merged cycle of a kind the lookup leads in, reads the skipped pairs and is never timed.)"""
    drafter = lookup_drafter("griffin+suffix", predictable_case.target)
    match = [Proposal([4, 5], [-1, 0], [0.9, 0.8])]
    measured(drafter, {True: 1.0, False: 1.0}, 1.0)  # merged trees: 2-2.7 tokens/s, from one slow first cycle
    drafter.lookup.sizing.rate = lambda found: 3.0
    assert drafter.lookup_suffices(match)
    with_match = drafter.gains[(True, False)].count
    for _ in range(20):  # merged cycles without a match, the head not catching up, each started 10 ms before
        drafter._last = (time.perf_counter() - 0.01, False, (False, False), 8)
        drafter._credit(torch.tensor([2]))
    assert drafter.seconds.count == 21 and drafter.gains[(True, False)].count == with_match
    assert not drafter.lookup_suffices(match)


def test_a_hybrid_weighs_merged_trees_by_what_the_lookups_best_nodes_promise_and_by_cycles_like_it(predictable_case):
    """A merged tree holds the lookup's best nodes that fit its budget (or head nodes more likely still): it promises
    at least what they promise, whatever a few probes of its kind measured; and a kind measured in few cycles leans
    on the average of every cycle as greedy (or sampled) as it."""
    drafter = lookup_drafter("griffin+suffix", predictable_case.target)
    strong, weak = [Proposal([4, 5], [-1, 0], [0.9, 0.8])], [Proposal([4, 5], [-1, 0], [0.02, 0.02])]
    measured(drafter, {True: 0.0, False: 1.0}, 0.1)
    assert drafter.merged_gain((True, False), strong) == pytest.approx(0.9 + 0.8)  # unmeasured: the scores themselves
    assert drafter.merged_gain((True, False), weak) == pytest.approx((32 * 0.0 + 8 * 0.5) / 40)
    measured(drafter, {True: 0.0, False: 1.0}, 0.1, cycles=2)
    assert drafter.merged_gain((False, False), [Proposal()]) == pytest.approx((2 * 1.0 + 8 * 0.5) / 10)


def test_a_hybrid_keeps_sampled_cycles_apart_from_greedy_ones(predictable_case):
    """A sampled cycle accepts a lookup's node only where the draw picks it, while the head's guesses follow the
    draws: merged trees measured in greedy cycles do not judge sampled ones, which try merged trees first."""
    drafter = lookup_drafter("griffin+suffix", predictable_case.target)
    gen = SpeculativeGenerator(predictable_case.target, drafter)
    gen.generate(predictable_case.prompts[:1], 24)
    assert drafter.gains and all(not sampled for _, sampled in drafter.gains)
    measured(drafter, {True: 1.0, False: 1.0}, 0.05)
    match = [Proposal([4, 5], [-1, 0], [0.02, 0.02])]
    drafter.lookup.sizing.rate = lambda found: float("inf")  # the lookup alone beats any merged tree measured
    assert drafter.lookup_suffices(match)
    drafter.sampled = True  # as the loop's draw coupling for sampled rows sets it
    assert not drafter.lookup_suffices(match)  # no sampled cycle measured: merged trees first
    drafter.lookup.sizing.rate = lambda found: 0.0
    gen.generate(predictable_case.prompts[:1], 24, SamplingParams(temperature=0.7, seed=0))
    assert any(sampled for _, sampled in drafter.gains)


def test_a_hybrid_probes_each_kind_of_cycle_on_its_own(predictable_case):
    """Where the lookup leads in cycles with a match, merged trees are measured again in such a cycle after
    ``probe_gap`` of them, however many merged cycles without a match ran between; and a kind's first measurement,
    often its slowest, weighs no more than the next."""
    drafter = lookup_drafter("griffin+suffix", predictable_case.target)
    match, nothing = [Proposal([4, 5], [-1, 0], [0.1, 0.1])], [Proposal()]
    measured(drafter, {True: 0.05, False: 1.0}, 0.1)  # merged: 12 and 19 tokens/s (both kinds' mean counted in)
    drafter.lookup.sizing.rate = lambda found: 15.0  # the lookup's trees alone: 15 tokens/s
    without, with_match = [], []
    for _ in range(40):
        without.append(drafter._lookup_alone(nothing))
        with_match.append(drafter._lookup_alone(match))
    assert not any(without)
    gap = drafter.probe_gap
    assert with_match == [True] * gap + [False] + [True] * (39 - gap)  # probed once, then the gap doubles
    assert drafter.probe_gaps == {(True, False): 2 * gap, (False, False): gap}
    seconds = RunningMean(smoothing=0.1)
    for value in (1.0, 0.1, 0.1):
        seconds.add(value)
    assert seconds.value == pytest.approx(0.4)  # the mean of three, not 1.0 decaying by a tenth a cycle


def test_a_hybrid_whose_lookup_leads_leaves_a_joining_prompt_to_the_heads_next_draft(predictable_case):
    """While lookup-only trees lead, a joining row's prompt is not read by the head at the join (its draft cache
    stays empty); the head's next merged draft reads it; the output stays the target's throughout."""
    target = predictable_case.target
    drafter = lookup_drafter("griffin+suffix", target)
    gen = SpeculativeGenerator(target, drafter)
    prompts, budget = predictable_case.prompts[:2], 24
    batch = gen.admit(None, gen.prefill(prompts[:1], [budget], [gen_params()]))
    rows = list(batch.rows)
    gen.set_tree(SourcedTree(16, 4, 4, source=LOOKUP))
    gen.cycle(batch)
    fresh = gen.prefill(prompts[1:], [budget], [gen_params()])
    rows += fresh.rows
    batch = gen.admit(batch, fresh)
    assert int(drafter.head.positions_from()[-1]) == 0, "the head read the joining prompt while the lookup led"
    gen.set_tree(SourcedTree(16, 4, 4, source=HYBRID))
    gen.cycle(batch)
    assert int(drafter.head.positions_from()[-1]) >= len(prompts[1])  # the merged draft read the prompt
    while batch.size:
        gen.cycle(batch)
        gen.retire(batch)
    assert [row.tokens for row in rows] == [hf_greedy(predictable_case.hf, p, budget) for p in prompts]
    # with the head's trees asked for, a joining prompt is read at the join, as the head alone reads it
    gen.set_tree(SourcedTree(16, 4, 4, source=HEAD))
    fresh = gen.prefill(prompts[:1], [budget], [gen_params()])
    batch = gen.admit(None, fresh)
    assert int(drafter.head.positions_from()[0]) == len(prompts[0]) - 1


def test_a_hybrid_cuts_its_merged_tree_to_the_width_that_pays(predictable_case):
    """Under ``calibrated`` each merged node's score is its chance of acceptance: the tree keeps its best nodes up to
    the width with the most expected tokens per second (the merged cycles' measured time moved along the lookup's
    measured cost of a node); nothing is cut before both are measured, nor under another rule. Cut trees stay
    lossless."""
    target = predictable_case.target
    drafter = lookup_drafter("griffin+suffix", target)
    tree = Proposal([5, 6, 7, 8, 9], [-1, 0, 0, 1, 3], [0.9, 0.5, 0.05, 0.04, 0.01])
    assert drafter.sized([tree]) == [tree]  # nothing measured yet
    for width in (2, 6, 10, 14):  # lookup-only cycles: 30 ms and 2 ms a token
        for _ in range(2):
            drafter.lookup.sizing.cost.observe(1, width, 0.03 + 0.002 * width)
    drafter.seconds.add(0.06)  # merged cycles at width 10 took 60 ms: 40 ms and 2 ms a token
    drafter.widths.add(10)
    # 0, 1, 2, 3 nodes: about 1 / 0.043, 1.9 / 0.045, 2.4 / 0.047, 2.45 / 0.049 tokens a second: the first two
    (cut,) = drafter.sized([tree])
    assert cut.tokens == [5, 6] and cut.parents == [-1, 0] and cut.scores == [0.9, 0.5]
    drafter.lookup.sizing.cost = type(drafter.lookup.sizing.cost)()
    for width in (2, 6, 10, 14):  # a node costs about 18 ms: unlikely nodes do not pay, the root alone does
        for _ in range(2):
            drafter.lookup.sizing.cost.observe(1, width, 0.03 + 0.02 * width)
    drafter.seconds, drafter.widths = RunningMean(), RunningMean()
    drafter.seconds.add(0.25)
    drafter.widths.add(10)
    weak = Proposal([5, 6, 7], [-1, 0, 1], [0.2, 0.1, 0.05])
    assert drafter.sized([weak]) == [weak.subset([])]
    assert drafter.sized([tree])[0].tokens == [5, 6]
    drafter.rule = "probability"
    assert drafter.sized([weak]) == [weak]

    drafter = lookup_drafter("griffin+suffix", target)
    gen = SpeculativeGenerator(target, drafter)
    prompts, budget = predictable_case.prompts[:3], 40
    gen.generate(prompts[:1], 24)  # measures merged cycles; the lookup's cost line below: a node half a cycle's
    seconds, width = drafter.seconds.value, drafter.widths.value  # time over the width, at every width
    drafter.lookup.sizing.cost = type(drafter.lookup.sizing.cost)(prior_weight=0.0)
    for w in (2, 6, 10, 14):
        drafter.lookup.sizing.cost.observe(1, w, seconds / 2 + seconds / 2 / width * w)
    drafter.lookup_suffices = lambda found: False  # merged trees every cycle, their time as measured above
    drafter._credit = lambda counts: None
    widths = []
    sized = drafter.sized
    drafter.sized = lambda trees: [widths.append(len(t)) or t for t in sized(trees)]
    out = [r.tokens for r in gen.generate(prompts, budget)]
    assert out == [hf_greedy(predictable_case.hf, p, budget) for p in prompts]
    assert widths and min(widths) < drafter.head.tree.total_tokens - 1, widths


def test_a_hybrid_catching_up_reads_a_short_window_on_trial(predictable_case):
    """A merged cycle after lookup-only ones reads only the last ``trial_window`` pairs, and the next draft forgets
    that reading: where the lookup leads again the head stands where it stood before, and a second merged cycle in a
    row reads every pair, its draft cache then what reading them all at once would have left. The output stays the
    target's."""
    target = predictable_case.target
    prompts, budget = predictable_case.prompts[:2], 40
    states = {}
    for window in (4, 10**6):
        drafter = lookup_drafter("griffin+suffix", target)
        drafter.trial_window = window
        gen = SpeculativeGenerator(target, drafter)
        gen.set_tree(SourcedTree(16, 4, 4, source=LOOKUP))
        batch = gen.admit(None, gen.prefill(prompts, [budget] * 2, [gen_params()] * 2))
        rows = list(batch.rows)
        for _ in range(3):
            gen.cycle(batch)
        assert drafter.unread is not None and int(drafter.head.positions_from().max()) == 0
        gen.set_tree(SourcedTree(16, 4, 4, source=HYBRID))
        measured(drafter, {True: 1.0, False: 1.0}, 0.05)
        lookup_leads = {True: float("inf"), False: 0.0}
        for leads, trial in ((False, True), (True, False), (False, True), (False, False)):
            drafter.lookup.sizing.rate = lambda found, rate=lookup_leads[leads]: rate
            gen.cycle(batch)
            short = bool((drafter.head.skipped > 0).any())
            assert short == (trial and window == 4), (leads, trial, drafter.head.skipped)
            if leads and window == 4:  # the trial forgotten: the head has read nothing yet
                assert drafter._trial is None and int(drafter.head.positions_from().max()) == 0
        head = drafter.head
        lengths = head.cache.lengths.clone()
        states[window] = [lengths] + [head.cache.keys[:, b, :, :n].clone() for b, n in enumerate(lengths.tolist())]
        while batch.size:
            gen.cycle(batch)
            gen.retire(batch)
        assert [row.tokens for row in rows] == [hf_greedy(predictable_case.hf, p, budget) for p in prompts]
    trial, full = states[4], states[10**6]
    assert torch.equal(trial[0], full[0])
    assert all(torch.allclose(a, b) for a, b in zip(trial[1:], full[1:]))


def gen_params():
    from specdec_kit.runtime.core.sampling import SamplingParams

    return SamplingParams()


def test_a_frozen_heap_leaves_the_collector_only_what_came_after():
    """Start-up's objects (here a thousand lists) leave the collector's generations, so a full collection no longer
    walks them; what comes after is walked as before."""
    from specdec_kit.runtime.heap import freeze_heap

    start_up = [[] for _ in range(1000)]
    try:
        assert freeze_heap() >= 1000
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in walked for o in start_up)
        after = [[] for _ in range(10)]
        walked = {id(o) for o in gc.get_objects()}
        assert all(id(o) in walked for o in after)
    finally:
        gc.unfreeze()


def test_the_collection_clock_counts_full_collections_and_their_time_while_entered():
    from specdec_kit.runtime.heap import CollectionClock

    with CollectionClock() as clock:
        gc.collect()
        gc.collect(0)
    assert clock.full == 1 and clock.seconds > 0
    gc.collect()
    assert clock.full == 1


def test_a_suffix_tries_nodes_are_nothing_the_garbage_collector_walks():
    """However many nodes a trie grows, it adds a fixed handful of objects to every full collection's walk (a trie
    of objects added two per node)."""
    before = len(gc.get_objects())
    trie = SuffixTrie(depth=24)
    trie.extend(0, torch.randint(0, 50, (2000,), generator=torch.Generator().manual_seed(0)).tolist())
    assert len(trie._counts) > 10_000
    assert len(gc.get_objects()) - before < 20
