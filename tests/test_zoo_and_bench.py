"""The zoo command builds every model from a recipe, and the benchmark's smoke mode runs on it."""

from __future__ import annotations

import json
import re

import pytest

from specdec_kit.bench import speedup_cli
from specdec_kit.bench.speedup import turns
from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train import zoo

TINY = {
    "tokenizer": {"vocab_size": 300, "train_files": 30},
    "target": {
        "hidden_size": 32,
        "layers": 2,
        "intermediate": 64,
        "heads": 2,
        "kv_heads": 1,
        "seq_len": 64,
        "batch": 4,
        "steps": 8,
        "lr": 0.001,
        "warmup": 2,
        "seed": 0,
    },
    "draft_lm": {
        "hidden_size": 32,
        "layers": 1,
        "intermediate": 64,
        "heads": 2,
        "kv_heads": 1,
        "seq_len": 64,
        "batch": 4,
        "steps": 4,
        "lr": 0.001,
        "warmup": 2,
        "seed": 1,
    },
    "heads": {m: {"steps": 4, "batch": 4, "seq_len": 64, "lr": 0.001} for m in ("eagle", "hass", "griffin", "medusa")},
    "save_dtype": "float16",
}


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    recipe = root / "recipe.json"
    recipe.write_text(json.dumps(TINY))
    assert zoo.main(["--out", str(root / "zoo"), "--recipe", str(recipe)]) == 0
    return root / "zoo"


def test_zoo_builds_every_model(tiny_zoo):
    target = TargetModel.from_pretrained(tiny_zoo / "target", dtype="float32", device="cpu")
    for method in ("eagle", "hass", "griffin", "medusa"):
        load_draft(tiny_zoo / method, method, target.hidden_size, target.vocab_size)
    assert (tiny_zoo / "draft_lm" / "config.json").is_file()
    log = json.loads((tiny_zoo / "training_log.json").read_text())
    assert {"corpus", "recipe", "target", "draft_lm", "griffin"} <= set(log)


def test_benchmark_smoke(tiny_zoo, tmp_path):
    out = tmp_path / "bench"
    assert speedup_cli.main(["--zoo", str(tiny_zoo), "--out", str(out), "--smoke"]) == 0
    for name in ("results.md", "results.csv", "results.json", "acceptance_per_depth.png", "speedup.png"):
        assert (out / name).stat().st_size > 0
    assert re.search(r"memory copy \d+-\d+ GB/s over the run \(median \d+\)", (out / "results.md").read_text())
    rows = json.loads((out / "results.json").read_text())["rows"]
    methods = {r["method"] for r in rows}
    assert methods == {"plain", "eagle2", "hass", "griffin", "medusa", "hf_generate", "hf_assisted", "hf_prompt_lookup"}
    assert {r["prompt_set"] for r in rows} == {"humaneval", "spec_bench", "heldout"}
    assert {r["temperature"] for r in rows} == {0.0, 1.0}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0 and r["copy_gbs"] > 0  # each prompt's turns: a copy's GB/s
        if r["method"] in ("eagle2", "hass", "griffin", "medusa"):
            assert r["acceptance_length"] >= 1.0 and r["bound"] > 0


def test_generate_on_zoo(tiny_zoo, capsys):
    from specdec_kit.runtime import cli

    assert cli.main(["--zoo", str(tiny_zoo), "--max-new-tokens", "8", "--prompt", "def f(x):\n"]) == 0
    printed = capsys.readouterr().out
    for kind in ("griffin", "hass", "eagle2", "eagle", "medusa", "plain decoding"):
        assert f"== {kind}" in printed
    assert "greedy output identical to plain decoding: True" in printed
    table = printed[printed.index("vs plain") :]  # the closing summary: every method with tau, tokens/s, speedup
    for kind in ("griffin", "hass", "eagle2", "medusa", "plain decoding"):
        assert kind in table
    assert "x\n" in table


def test_generate_without_zoo_says_how_to_build_it(tmp_path, capsys):
    from specdec_kit.runtime import cli

    assert cli.main(["--zoo", str(tmp_path)]) == 2
    assert "python -m specdec_kit.train.zoo" in capsys.readouterr().err


def test_sets_take_turns_over_the_same_runs():
    """Taken in turns, every set meets each stretch of the run: its i-th prompt at each temperature, then the next
    set's; the runs themselves are the same as set after set."""
    sets = {"a": [[1], [2]], "b": [[3], [4], [5]]}
    in_turns = turns(sets, [0.0, 0.7], 2, sets_take_turns=True)
    set_after_set = turns(sets, [0.0, 0.7], 2, sets_take_turns=False)
    assert sorted(in_turns) == sorted(set_after_set) and len(in_turns) == 2 * 2 * 5
    assert in_turns[:5] == [("a", 0.0, 0, 0), ("a", 0.7, 0, 0), ("b", 0.0, 0, 0), ("b", 0.7, 0, 0), ("a", 0.0, 0, 1)]
    assert in_turns[8:10] == [("b", 0.0, 0, 2), ("b", 0.7, 0, 2)]  # the longer set's last prompt, alone
    assert set_after_set[:3] == [("a", 0.0, 0, 0), ("a", 0.0, 0, 1), ("a", 0.0, 1, 0)]
