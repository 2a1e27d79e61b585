"""The model-free benchmarks' own logic, on given numbers. Replaying proposals over known answers: a cycle gains its
accepted path and one token, a budget bounds the path, text never seen gains nothing, and a finished response teaches
the suffix trees the next request's. A hybrid against the better of its parts, prompt by prompt."""

from __future__ import annotations

import json

import pytest

from specdec_kit.bench.lookup_bench import hybrids_against_parts, paired_table
from specdec_kit.bench.lookup_replay import (
    FixedCut,
    OracleCut,
    SizingCut,
    category_speedups,
    main,
    replay,
    replay_cycles,
)
from specdec_kit.runtime.core.lookup import Budget, NgramSettings, SuffixSettings
from specdec_kit.runtime.decoding.lookup_drafting import NgramSource, SuffixSource

PROMPT = list(range(100, 140))
COPY = PROMPT[5:35]  # an answer that copies 30 tokens of its prompt
NOVEL = list(range(200, 230))  # an answer of tokens the prompt never holds


@pytest.mark.parametrize(
    "fresh", [lambda: NgramSource(NgramSettings()), lambda: SuffixSource(SuffixSettings())], ids=["ngram", "suffix"]
)
def test_one_node_a_cycle_on_a_copy_gains_two_tokens_a_cycle(fresh):
    source = fresh()
    tokens, cycles = replay(source, PROMPT, COPY, Budget(1, 25, 2))
    assert tokens == 29 and cycles == 15  # the first token is the prefill's; 14 cycles of two, the last of one


@pytest.mark.parametrize(
    "fresh", [lambda: NgramSource(NgramSettings()), lambda: SuffixSource(SuffixSettings())], ids=["ngram", "suffix"]
)
def test_a_wider_budget_accepts_longer_runs_of_a_copy_and_nothing_of_novel_text(fresh):
    source = fresh()
    tokens, cycles = replay(source, PROMPT, COPY, Budget(16, 25, 2))
    assert tokens == 29 and cycles <= 6
    assert replay(source, PROMPT, NOVEL, Budget(16, 25, 2)) == (29, 29)


def test_suffix_trees_replay_a_finished_response_to_the_next_request():
    source = SuffixSource(SuffixSettings(max_cached_requests=4))
    assert replay(source, PROMPT, NOVEL, Budget(8, 25, 2)) == (29, 29)
    tokens, cycles = replay(source, PROMPT, NOVEL, Budget(8, 25, 2))
    assert tokens == 29 and cycles <= 8
    alone = SuffixSource(SuffixSettings(max_cached_requests=0))  # each request's own text only
    replay(alone, PROMPT, NOVEL, Budget(8, 25, 2))
    assert replay(alone, PROMPT, NOVEL, Budget(8, 25, 2)) == (29, 29)


def test_the_oracle_verifies_only_accepted_nodes_and_a_fixed_budget_at_most_its_nodes():
    budget = Budget(16, 25, 2)
    oracle = replay_cycles(SuffixSource(SuffixSettings()), PROMPT, COPY, budget, OracleCut())
    assert all(width == gained for width, gained in oracle[:-1])  # every verified node accepted, then one token
    one = replay_cycles(SuffixSource(SuffixSettings()), PROMPT, COPY, budget, FixedCut(1))
    assert max(width for width, _ in one) == 2 and sum(g for _, g in one) == sum(g for _, g in oracle) == 29


def test_simulated_speedups_rank_the_oracle_first_and_the_sizing_learns_a_copy():
    prompts = [PROMPT, [7, *PROMPT]]
    answers = [COPY + NOVEL, PROMPT[2:30] + NOVEL[:10]]  # copies, then text never seen
    line = (1.1, 0.035)
    speedups = category_speedups("suffix", prompts, answers, [1, 4, 16], line)
    assert speedups["oracle"] >= max(speedups.values()) and speedups["16"] > speedups["1"] > 1.0
    assert speedups["sizing"] > speedups["1"]  # it learned to verify more than one node of a copy
    sizing = SizingCut(*line)
    cycles = replay_cycles(SuffixSource(SuffixSettings()), PROMPT, COPY * 3, Budget(16, 25, 2), sizing)
    assert max(width for width, _ in cycles) > 2
    assert sizing.sizing.calibration.proposed  # every verdict reached its calibration


@pytest.mark.slow
def test_the_replay_writes_tau_per_category_kind_and_budget(tmp_path):
    out = tmp_path / "replay"
    argv = ["--target", "zoo", "--backend", "torch", "--smoke", "--engines", str(tmp_path), "--out", str(out)]
    assert main([*argv, "--categories", "code_editing,summarization", "--budgets", "1,4"]) == 0
    result = json.loads((out / "replay.json").read_text())
    assert result["budgets"] == [1, 4]
    assert set(result["tau"]) == {"code_editing", "summarization"}
    for by_kind in result["tau"].values():
        assert set(by_kind) == {"ngram", "suffix"}
        assert all(1.0 <= tau <= 5.0 for taus in by_kind.values() for tau in taus.values())
    assert "| code_editing | suffix |" in (out / "replay.md").read_text()
    for by_kind in result["simulated_speedup"].values():
        for by_cut in by_kind.values():
            assert set(by_cut) == {"1", "4", "sizing", "oracle"} and by_cut["oracle"] >= max(by_cut.values())
    assert result["meta"]["cost_line"] == [1.08, 0.033] and "| sizing | oracle |" in (out / "replay.md").read_text()
    assert (out / "replay.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--budgets: expected node budgets of at least 1"):
        main([*argv, "--budgets", "0"])
    with pytest.raises(SystemExit, match="--cost-line: expected INTERCEPT,SLOPE"):
        main([*argv, "--cost-line", "1.1"])


def test_a_hybrid_is_compared_prompt_by_prompt_with_the_better_of_its_parts():
    def runs(*tps: float) -> dict:
        return {(i, 0): {"tps": t} for i, t in enumerate(tps)}

    results = {
        ("rag", 0.0, "plain"): runs(10, 10, 10),
        ("rag", 0.0, "griffin"): runs(9, 9, 9),
        ("rag", 0.0, "suffix"): runs(12, 10, 11),
        ("rag", 0.0, "griffin+suffix"): runs(12, 12, 9.9),
    }
    rows = [
        {"prompt_set": "rag", "temperature": 0.0, "method": m, "speedup": s}
        for m, s in [("plain", 1.0), ("griffin", 0.9), ("suffix", 1.1), ("griffin+suffix", 1.2)]
    ]
    (paired,) = hybrids_against_parts(results, rows, "griffin", "suffix")
    assert paired["better_part"] == "suffix"
    assert paired["median_ratio"] == pytest.approx(1.0) and paired["min_ratio"] == pytest.approx(0.9)
    assert paired["max_ratio"] == pytest.approx(1.2) and (paired["prompts_faster"], paired["prompts"]) == (1, 3)
    assert "| rag | 0 | griffin+suffix | suffix | 1.00 [0.90, 1.20] | 1 of 3 |" in paired_table([paired])
    assert hybrids_against_parts({k: v for k, v in results.items() if "+" not in k[2]}, rows, "griffin", "suffix") == []


def test_copyable_tokens_follow_an_earlier_occurrence_of_their_preceding_tokens():
    from specdec_kit.bench.copy_ceiling import copyable

    # prompt 1 2 3 4, answer 2 3 9 3 4: the 3 follows a 2 as in the prompt, the last 4 a 3 (not "9 3"): 2 after one
    # token; the first 2 follows a 4, which nothing followed before; nothing follows two earlier tokens
    found = copyable([1, 2, 3, 4], [2, 3, 9, 3, 4])
    assert found == {1: 2, 2: 0, 3: 0}
    assert copyable([5, 6, 7], [5, 6, 7], orders=(1, 2)) == {1: 2, 2: 1}  # the first 5 follows nothing seen
    assert copyable([], [8, 8, 8]) == {1: 1, 2: 0, 3: 0}


def test_the_ceiling_takes_each_prompts_best_method_and_counts_plain_answers():
    from specdec_kit.bench.copy_ceiling import best_per_prompt, ceiling_table, copy_shares

    def prompts(*speedups):
        return [{"prompt": i, "speedup": s, "decode_speedup": s + 0.1} for i, s in enumerate(speedups)]

    def row(method, speedup, by_prompt=None):
        return {"prompt_set": "rag", "temperature": 0.0, "method": method, "speedup": speedup, "by_prompt": by_prompt}

    rows = [row("plain", 1.0), row("suffix", 1.2, prompts(1.2, 1.0, 1.3)), row("griffin", 1.1, prompts(1.0, 1.6, 1.1))]
    (best,) = best_per_prompt(rows)
    assert best["best_per_prompt"] == pytest.approx(1.3) and best["best_per_prompt_decoding"] == pytest.approx(1.4)
    assert (best["best_method"], best["best_method_speedup"], best["prompts"]) == ("suffix", 1.2, 3)
    assert best["wins"] == {"suffix": 2, "griffin": 1}
    results = {
        ("rag", 0.0, "plain"): {(0, 0): {"output": [2, 3, 4]}, (1, 0): {"output": [7, 6, 7]}},
        ("rag", 0.0, "suffix"): {(0, 0): {"output": [9, 9, 9]}},  # only plain decoding's answers count
    }
    (shares,) = copy_shares(results, {"rag": [[1, 2, 3, 4], [6]]})
    assert shares["answer_tokens"] == 6
    assert shares["copyable"] == {"1": pytest.approx(3 / 6), "2": pytest.approx(1 / 6), "3": 0.0}
    table = "\n".join(ceiling_table([shares], [best]))
    assert "| rag | 0 | 6 | 50% / 17% / 0% | 1.30x (1.40x) | suffix | 1.20x | suffix 2, griffin 1 |" in table
