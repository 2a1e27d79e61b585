"""Generation-loop behaviour: stopping, statistics, per-row parameters, input errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specdec_kit.paths import default_zoo
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.core.verify import path_of
from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter, NoDrafter, TorchFeatureStep
from specdec_kit.runtime.decoding.generate import (
    STOP_EDGE_CHARS,
    RequestStats,
    SpeculativeGenerator,
    stop_may_end_in_tail,
)
from specdec_kit.runtime.synthetic import oracle_griffin, random_griffin, tiny_target
from specdec_kit.serving.policy import fewest_steps


@pytest.fixture(scope="module")
def target():
    return tiny_target(
        hidden_size=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=60,
        context_mix=0.3,
        logit_scale=20.0,
        seed=4,
        max_positions=128,
    )


def griffin(target):
    return FeatureTreeDrafter(TorchFeatureStep(oracle_griffin(target), target.lm_head), DynamicTreeConfig(16, 3, 4))


def test_eos_stops_and_is_kept(target):
    plain = SpeculativeGenerator(target, NoDrafter(), eos_token_ids=[]).generate([[1, 2, 3]], 40)[0].tokens
    eos = plain[17]
    first = plain.index(eos)
    for drafter in (NoDrafter(), griffin(target)):
        res = SpeculativeGenerator(target, drafter, eos_token_ids=[eos]).generate([[1, 2, 3]], 40)[0]
        assert res.tokens == plain[: first + 1] and res.finish_reason == "stop"


def test_max_tokens_is_exact_even_mid_cycle(target):
    for n in (1, 2, 5, 13):
        res = SpeculativeGenerator(target, griffin(target), eos_token_ids=[]).generate([[3, 4]], n)[0]
        assert len(res.tokens) == n and res.finish_reason == "length"


def test_stop_strings(target):
    decode = lambda toks: "".join(chr(65 + t % 26) for t in toks)  # noqa: E731
    plain = SpeculativeGenerator(target, NoDrafter(), eos_token_ids=[], decode=decode).generate([[1, 2, 3]], 30)[0]
    stop = plain.text[10:12]
    cut = plain.text.find(stop)
    res = SpeculativeGenerator(target, griffin(target), eos_token_ids=[], decode=decode).generate(
        [[1, 2, 3]], 30, stop_strings=[stop]
    )[0]
    assert res.text == plain.text[:cut] and res.finish_reason == "stop"
    assert decode(res.tokens).find(stop) == cut  # tokens end right after the stop string appears


def test_stop_strings_late_in_a_long_output_decode_only_a_tail(target):
    lengths = []

    def decode(toks):
        lengths.append(len(toks))
        return "".join(chr(65 + t % 26) for t in toks)

    def generate(stops: list[str]):
        return SpeculativeGenerator(target, griffin(target), eos_token_ids=[], decode=decode).generate(
            [[1, 2, 3]], 110, stop_strings=stops
        )[0]

    plain = SpeculativeGenerator(target, NoDrafter(), eos_token_ids=[], decode=decode).generate([[1, 2, 3]], 110)[0]
    lengths.clear()
    res = generate(["a"])  # never there (lower case)
    assert res.tokens == plain.tokens and res.finish_reason == "length"
    # the window: the longest stop string plus the edge margin, and one cycle's tokens (tree depth 3 + 1); the whole
    # completion is decoded once, for the result's text
    assert [n for n in lengths if n > len("a") + STOP_EDGE_CHARS + 4] == [110]
    stop = plain.text[95:98]  # late
    cut = plain.text.find(stop)
    res = generate([stop])
    assert res.text == plain.text[:cut] and res.finish_reason == "stop"
    assert decode(res.tokens).find(stop) == cut


def test_the_tail_check_misses_no_stop_string_across_multibyte_characters():
    tokenizer = AutoTokenizer.from_pretrained(default_zoo() / "tokenizer")
    text = "Crème brûlée 🍮 costs 5€; 日本語のテキスト, naïve café — résumé 🎉🎉 ok!\n  indented\tend"
    tokens = tokenizer(text)["input_ids"]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    checked = 0
    for end in range(1, len(tokens) + 1):
        whole = decode(tokens[:end])
        for appended in range(1, min(4, end) + 1):
            before = decode(tokens[: end - appended])
            for length in range(1, 7):
                for stop_end in range(len(whole) - 3, len(whole) + 1):
                    stop = whole[max(0, stop_end - length) : stop_end]
                    if stop and stop in whole and stop not in before:
                        checked += 1
                        assert stop_may_end_in_tail(decode, tokens[:end], appended, [stop]), (end, appended, stop)
    assert checked > 100


def drafted_paths(target, draft, tree) -> list[list[tuple[int, ...]]]:
    """The token paths (root first) of the first tree ``tree`` drafts for three prompts, per row, sorted."""
    gen = SpeculativeGenerator(
        target, FeatureTreeDrafter(TorchFeatureStep(draft, target.lm_head), tree), eos_token_ids=[]
    )
    prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10]]
    batch = gen.admit(None, gen.prefill(prompts, [20] * 3, [SamplingParams()] * 3))
    drafted = gen.drafter.draft(batch.ctx_feats, batch.ctx_tokens, batch.ctx_counts)
    out = []
    for b in range(drafted.tokens.shape[0]):
        nodes = drafted.valid[b].nonzero().flatten()
        path, counts = path_of(drafted.tree_mask[b].expand(len(nodes), -1, -1), nodes)
        out.append(sorted(tuple(drafted.tokens[b, p[:c]].tolist()) for p, c in zip(path, counts)))
    return out


def test_a_dynamic_tree_with_fewest_steps_drafts_the_same_tree(target):
    """``fewest_steps`` keeps only the draft steps a tree's nodes can use; the tree drafted is the same as with every
    step."""
    draft = random_griffin(target)  # an imperfect draft: its trees branch
    # a single beam drafts a chain as deep as the nodes allow: a step fewer would cut it
    for full in (
        DynamicTreeConfig(4, 4, 3),
        DynamicTreeConfig(6, 5, 2),
        DynamicTreeConfig(3, 5, 2),
        DynamicTreeConfig(4, 4, 1),
    ):
        small = fewest_steps(full)
        assert small.depth < full.depth and small.total_tokens == full.total_tokens
        assert drafted_paths(target, draft, small) == drafted_paths(target, draft, full)


def test_statistics_are_consistent(target):
    gen = SpeculativeGenerator(target, griffin(target), eos_token_ids=[])
    res = gen.generate([[1, 2, 3], [9, 8, 7, 6, 5, 4]], 48)
    for r in res:
        st = r.stats
        assert st.generated_tokens == 48 and st.cycles > 0
        assert st.accepted_per_depth[0] <= st.cycles
        assert all(a >= b for a, b in zip(st.accepted_per_depth, st.accepted_per_depth[1:]))
        assert sum(st.accepted_per_depth) == st.accepted_tokens
        # every cycle yields accepted + 1 tokens; the first token comes from prefill; the last cycle may be cut
        assert st.accepted_tokens + st.cycles + 1 >= st.generated_tokens
        assert st.acceptance_length == pytest.approx((st.accepted_tokens + st.cycles) / st.cycles)
        assert st.draft_tokens == st.cycles * 15
        assert 0 < st.draft_s < st.total_s and 0 < st.verify_s < st.total_s
        assert st.tokens_per_s > 0
    pooled = RequestStats.combined([r.stats for r in res])
    assert pooled.cycles == sum(r.stats.cycles for r in res)
    assert pooled.accepted_per_depth == [a + b for a, b in zip(*(r.stats.accepted_per_depth for r in res))]
    assert pooled.acceptance_length == pytest.approx(
        sum(r.stats.accepted_tokens + r.stats.cycles for r in res) / sum(r.stats.cycles for r in res)
    )


def test_mixed_parameters_in_one_batch(target):
    gen = SpeculativeGenerator(target, griffin(target), eos_token_ids=[])
    greedy_alone = gen.generate([[5, 6, 7]], 20)[0].tokens
    sampled_alone = gen.generate([[1, 2]], 20, SamplingParams(temperature=0.8, seed=3))[0].tokens
    both = gen.generate([[1, 2], [5, 6, 7]], 20, [SamplingParams(temperature=0.8, seed=3), SamplingParams()])
    assert both[1].tokens == greedy_alone and both[0].tokens == sampled_alone  # seeds make rows reproducible


def test_bad_inputs(target):
    gen = SpeculativeGenerator(target, NoDrafter())
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        gen.generate([[]], 5)
    with pytest.raises(ValueError, match="100 prompt tokens \\+ 40 new tokens exceed the target's context of 128"):
        gen.generate([[1] * 100], 40)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="stop strings need a decode function"):
        gen.generate([[1]], 3, stop_strings=["x"])
