"""Continuous batching in the runtime: requests that join a running batch between cycles, rows that
leave it, and cycles that skip speculation all keep greedy output identical to the target's own."""

from __future__ import annotations

import torch
from conftest import NEW_TOKENS

from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.draft_context import DraftContext
from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter, TorchFeatureStep
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.synthetic import oracle_griffin


def generator(case) -> SpeculativeGenerator:
    drafter = FeatureTreeDrafter(
        TorchFeatureStep(oracle_griffin(case.target), case.target.lm_head), DynamicTreeConfig(16, 3, 4)
    )
    return SpeculativeGenerator(case.target, drafter, eos_token_ids=[])


def run_with_arrivals(
    gen: SpeculativeGenerator, prompts, arrivals: dict[int, list[int]], speculate=lambda c: True, fold: bool = False
):
    """Prompts join at the cycle numbers in ``arrivals``; returns each prompt's row. With ``fold``, prompts that
    arrive while a batch runs are read by that cycle's target call (``cycle(..., joining=)``), not prefilled."""
    greedy = SamplingParams()
    batch, rows, cycle = None, {}, 0
    pending = dict(arrivals)
    while pending or (batch is not None and batch.size):
        joining = None
        if cycle in pending:
            ids = pending.pop(cycle)
            args = ([prompts[i] for i in ids], [NEW_TOKENS] * len(ids), [greedy] * len(ids))
            if fold and batch is not None and batch.size:
                joining = gen.prepare(*args, tags=ids)
                rows.update({row.tag: row for row in joining.rows})
            else:
                new = gen.prefill(*args, tags=ids)
                rows.update({row.tag: row for row in new.rows})
                batch = gen.admit(batch, new)
                gen.retire(batch)
        if batch is not None and batch.size:
            outcome = gen.cycle(batch, speculate=speculate(cycle), joining=joining)
            assert outcome.joined == (len(joining.rows) if joining else 0)
            gen.retire(batch)
        cycle += 1
    return [rows[i] for i in sorted(rows)]


def test_requests_joining_a_running_batch_stay_lossless(predictable_case):
    case = predictable_case
    prompts = case.prompts[:6]
    rows = run_with_arrivals(generator(case), prompts, {0: [0, 1], 2: [2], 3: [3, 4], 9: [5]})
    assert [r.tokens for r in rows] == case.references[:6]
    assert all(r.finish == "length" for r in rows)
    assert sum(r.stats.accepted_tokens for r in rows) > 2 * sum(r.stats.cycles for r in rows)  # tau > 3


def test_a_joining_row_is_read_at_the_join_not_in_every_rows_next_draft(predictable_case):
    """The draft reads a joining row's prompt on that row alone as it joins: the running rows' next draft stays as
    narrow as their accepted paths (no catch-up over the new prompt's width) and the output stays the target's."""
    case = predictable_case
    gen = generator(case)
    greedy = SamplingParams()
    batch = gen.admit(None, gen.prefill([case.prompts[0], case.prompts[1]], [NEW_TOKENS] * 2, [greedy] * 2))
    gen.cycle(batch)
    gen.cycle(batch)
    prompt = case.prompts[2]
    batch = gen.admit(batch, gen.prefill([prompt], [NEW_TOKENS], [greedy]))
    assert batch.context.width <= gen.drafter.max_depth + 1  # the new row's last pair alone is pending
    assert batch.context.counts[-1].item() == 1
    assert gen.drafter.cache.lengths[-1].item() == len(prompt) - 1 and gen.drafter.skipped[-1].item() == 0
    rows = list(batch.rows)
    outcome = gen.cycle(batch)
    assert not outcome.caught_up and outcome.rows == 3 and outcome.accepted_tokens > 0
    while batch.size:
        gen.retire(batch)
        if batch.size:
            gen.cycle(batch)
    assert [r.tokens for r in rows] == case.references[:3]


def test_joining_rows_stay_lossless_with_every_admission_pattern(predictable_case):
    """Rows joining one or several at a time, while others speculate or run plain, give the target's output."""
    case = predictable_case
    prompts = case.prompts[:6]
    rows = run_with_arrivals(
        generator(case), prompts, {0: [0], 1: [1, 2], 4: [3], 5: [4, 5]}, speculate=lambda c: c % 5 != 3
    )
    assert [r.tokens for r in rows] == case.references[:6]


def test_prompts_read_by_a_running_cycles_target_call_stay_lossless(predictable_case):
    """Prompts that join while a batch runs, read by the target call that verifies its trees (one call, rows padded
    to the widest input), give the target's output, whether those cycles speculate or run plain, and the rows that
    joined so speculate as well as rows prefilled on their own."""
    case = predictable_case
    prompts = case.prompts[:6]
    arrivals = {0: [0], 1: [1, 2], 4: [3], 5: [4, 5]}
    folded = run_with_arrivals(generator(case), prompts, arrivals, fold=True)
    mixed = run_with_arrivals(generator(case), prompts, arrivals, speculate=lambda c: c % 5 != 3, fold=True)
    assert [r.tokens for r in folded] == [r.tokens for r in mixed] == case.references[:6]
    alone = run_with_arrivals(generator(case), prompts, arrivals)
    assert sum(r.stats.accepted_tokens for r in folded) >= 0.9 * sum(r.stats.accepted_tokens for r in alone)
    assert [r.stats.prompt_tokens for r in folded] == [len(p) for p in prompts]


def test_prompts_a_cycle_cannot_read_are_handed_back_and_the_batch_goes_on(predictable_case):
    """A target call over trees and joining prompts that fails (here: a prompt token outside the vocabulary) leaves
    the running rows as they were: their trees are verified alone, the prompts come back unread (``joined`` 0), and
    the output stays the target's."""
    case = predictable_case
    gen, greedy = generator(case), SamplingParams()
    batch = gen.admit(None, gen.prefill(case.prompts[:2], [NEW_TOKENS] * 2, [greedy] * 2))
    rows = list(batch.rows)
    gen.cycle(batch)
    bad = gen.prepare([[case.target.vocab_size + 5] * 3], [NEW_TOKENS], [greedy])
    outcome = gen.cycle(batch, joining=bad)
    assert outcome.joined == 0 and batch.size == 2 and batch.cache.batch == 2
    while batch.size:
        gen.cycle(batch)
        gen.retire(batch)
    assert [r.tokens for r in rows] == case.references[:2]


def test_plain_cycles_keep_the_draft_context(predictable_case):
    """Cycles without speculation hand their context to the next speculative one: acceptance on the
    speculative cycles stays what it is with speculation throughout."""
    case = predictable_case
    prompts = case.prompts[:4]
    always = run_with_arrivals(generator(case), prompts, {0: [0, 1, 2, 3]})
    mixed = run_with_arrivals(generator(case), prompts, {0: [0, 1], 1: [2, 3]}, speculate=lambda c: c % 3 == 2)
    assert [r.tokens for r in always] == [r.tokens for r in mixed] == case.references[:4]
    per_cycle_always = sum(r.stats.accepted_tokens for r in always) / sum(r.stats.spec_cycles for r in always)
    per_cycle_mixed = sum(r.stats.accepted_tokens for r in mixed) / sum(r.stats.spec_cycles for r in mixed)
    assert sum(r.stats.spec_cycles for r in mixed) < sum(r.stats.cycles for r in mixed)
    assert per_cycle_always > 2.0 and per_cycle_mixed > 0.7 * per_cycle_always


def test_draft_context_appends_per_row_in_place_and_keeps_snapshots():
    feats = torch.arange(2 * 3 * 1, dtype=torch.float).view(2, 3, 1)
    toks = torch.tensor([[1, 2, 3], [4, 5, 0]])
    snapshot = DraftContext.of(feats, toks, torch.tensor([3, 2]))
    new_feats = -torch.arange(1, 2 * 2 + 1, dtype=torch.float).view(2, 2, 1)
    grown = snapshot.append(new_feats, torch.tensor([[7, 8], [9, 0]]), torch.tensor([2, 1]))
    assert grown.counts.tolist() == [5, 3] and grown.width == 5
    assert grown.tokens[0].tolist() == [1, 2, 3, 7, 8] and grown.tokens[1, :3].tolist() == [4, 5, 9]
    assert grown.feats[0, :, 0].tolist() == [0, 1, 2, -1, -2] and grown.feats[1, :3, 0].tolist() == [3, 4, -3]
    # the earlier context still reads what it held
    assert snapshot.tokens.tolist() == [[1, 2, 3], [4, 5, 0]] and snapshot.counts.tolist() == [3, 2]
    # a long run of one-pair appends writes into room kept ahead (buffers double), not a copy per append
    ctx, buffers = grown, set()
    for step in range(40):
        ctx = ctx.append(torch.full((2, 1, 1), float(step)), torch.full((2, 1), 100 + step), torch.tensor([1, 1]))
        buffers.add(ctx.tokens_buffer.data_ptr())
    assert ctx.counts.tolist() == [45, 43] and len(buffers) <= 4
    assert ctx.tokens[0, 5:].tolist() == list(range(100, 140)) and ctx.tokens[1, 3:43].tolist() == list(range(100, 140))
    assert ctx.feats[1, 42, 0].item() == 39.0
    kept = ctx.select_rows(torch.tensor([1]))
    assert kept.counts.tolist() == [43] and kept.tokens[0, :3].tolist() == [4, 5, 9]
    joined = kept.extend_rows(snapshot)
    assert joined.counts.tolist() == [43, 3, 2] and joined.tokens[1, :3].tolist() == [1, 2, 3]


def test_a_bounded_catch_up_skips_old_context_and_stays_lossless(predictable_case):
    """After runs of plain cycles the draft reads only each row's newest pairs (positions kept): outputs stay the
    target's own, and the draft still predicts well from what it read."""
    case = predictable_case
    prompts = case.prompts[:4]
    gen = generator(case)
    gen.drafter.catch_up_pairs, gen.drafter.min_window = 8, 2  # 2 pairs per row at batch 4
    rows = run_with_arrivals(gen, prompts, {0: [0, 1], 1: [2, 3]}, speculate=lambda c: c % 4 == 3)
    assert [r.tokens for r in rows] == case.references[:4]
    skipped = []
    gen = generator(case)
    gen.drafter.catch_up_pairs, gen.drafter.min_window = 8, 2
    original = gen.drafter._bounded

    def spy(*args):
        out = original(*args)
        skipped.append(int(gen.drafter.skipped.sum()))
        return out

    gen.drafter._bounded = spy
    rows = run_with_arrivals(gen, prompts, {0: [0, 1, 2, 3]}, speculate=lambda c: c % 4 == 3)
    assert [r.tokens for r in rows] == case.references[:4]
    assert skipped and skipped[-1] > 0  # prompts and plain runs were skipped in part
    spec = sum(r.stats.spec_cycles for r in rows)
    assert sum(r.stats.accepted_tokens for r in rows) > 1.0 * spec  # the draft still accepts from what it read


def test_rows_join_into_kept_room_and_leavers_places_are_filled_from_the_end():
    """Joining writes into room kept after the batch (no copy of the cache once there is room), leaving moves only
    as many rows as left, and every row keeps its own keys, values and length."""
    from specdec_kit.runtime.core.kv_cache import KVCache
    from specdec_kit.runtime.decoding.generate import places_after_leaving

    def rows_of(ids: list[int]) -> KVCache:
        cache = KVCache.allocate(2, len(ids), 1, 2, 8, torch.float32, "cpu")
        with torch.inference_mode():  # row i holds the value i everywhere and i + 1 committed tokens
            for b, i in enumerate(ids):
                cache.keys[:, b] = float(i)
                cache.values[:, b] = -float(i)
                cache.lengths[b] = i + 1
        return cache

    def ids_in(cache: KVCache) -> list[int]:
        assert torch.equal(cache.values, -cache.keys)
        assert torch.equal(cache.lengths, cache.keys[0, :, 0, 0, 0].long() + 1)
        return cache.keys[0, :, 0, 0, 0].long().tolist()

    cache = rows_of([0, 1, 2])
    cache.extend_rows(rows_of([3]))  # grows once, with room for more
    store = cache.key_store.data_ptr()
    cache.extend_rows(rows_of([4, 5]))
    assert ids_in(cache) == [0, 1, 2, 3, 4, 5] and cache.key_store.data_ptr() == store
    order = places_after_leaving([True, False, True, False, True, True])
    assert order == [0, 4, 2, 5]
    cache.select_rows(torch.tensor(order))
    assert ids_in(cache) == [0, 4, 2, 5] and cache.key_store.data_ptr() == store
    cache.extend_rows(rows_of([6]))
    assert ids_in(cache) == [0, 4, 2, 5, 6] and cache.key_store.data_ptr() == store
    assert all(w.is_contiguous() for w in cache.keys) and all(w.is_contiguous() for w in cache.values)
