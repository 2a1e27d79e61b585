"""The committed demo zoo: within its size budget, built from the current recipe, strict-loadable, lossless on
its own target, and benchmarked: EAGLE-3 rows beside GRIFFIN's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.loader import make_drafter, resolve_tree
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.zoo import RECIPE, recipe_hash

ZOO = Path(__file__).resolve().parents[1] / "zoo"
pytestmark = pytest.mark.skipif(not (ZOO / "target" / "config.json").is_file(), reason="no committed zoo yet")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def test_zoo_fits_its_budget_and_matches_the_recipe():
    """The demo zoo's own budget; the named targets' heads beside it (``zoo/<name>/``) have theirs."""
    from specdec_kit.runtime.models.pretrained import NAMED_TARGETS

    weights = [p for p in ZOO.rglob("*") if p.suffix in WEIGHT_SUFFIXES]
    assert not [p for p in weights if p.name.endswith("training_state.pt")], "training state must not ship"
    total = sum(p.stat().st_size for p in weights if p.relative_to(ZOO).parts[0] not in NAMED_TARGETS)
    assert total <= 50 * 2**20, f"zoo weights are {total / 2**20:.1f} MiB > 50 MiB"
    log = json.loads((ZOO / "training_log.json").read_text())
    assert log["recipe"] == recipe_hash(json.loads(RECIPE.read_text())), "recipe changed: rebuild the zoo"


def test_zoo_heads_load_and_decode_losslessly():
    target = TargetModel.from_pretrained(ZOO / "target", dtype="float32", device="cpu")
    hf = target.hf_model
    prompt = [int(t) for t in torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(0))]
    ids = torch.tensor([prompt])
    ref = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0
    )[0, 12:].tolist()
    for kind, folder, tree in (
        ("griffin", "griffin", "dynamic"),
        ("eagle3", "eagle3", "dynamic"),
        ("peagle", "peagle", "dynamic"),
        ("dflash", "dflash", "dynamic"),
        ("hass", "hass", "dynamic"),
        ("eagle2", "eagle", "dynamic"),
        ("medusa", "medusa", "static:mc_sim_7b_63:24"),
        ("moa", "moa", "dynamic"),
        ("moa", "moa_tli0", "dynamic"),
    ):
        load_draft(
            ZOO / folder,
            kind,
            target.hidden_size,
            target.vocab_size,
            target_shape=(target.num_layers, 2 * target.num_kv_heads * target.head_dim),
        )
        drafter = make_drafter(
            target,
            kind,
            ZOO / folder,
            resolve_tree(kind, tree, None, None, None) if tree != "dynamic" else resolve_tree(kind, tree, 16, 3, 4),
        )
        out = SpeculativeGenerator(target, drafter, eos_token_ids=[]).generate([prompt], 40)[0]
        assert out.tokens == ref, kind


@pytest.mark.slow
def test_the_benchmark_reports_eagle3_beside_griffin(tmp_path):
    from specdec_kit.bench import speedup_cli

    out = tmp_path / "bench"
    assert (
        speedup_cli.main(
            ["--zoo", str(ZOO), "--out", str(out), "--smoke", "--methods", "griffin,eagle3", "--peers", "none"]
        )
        == 0
    )
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"plain", "griffin", "eagle3"}
    eagle3 = [r for r in rows if r["method"] == "eagle3"]
    assert {(r["prompt_set"], r["temperature"]) for r in eagle3} == {
        (s, t) for s in ("humaneval", "spec_bench", "heldout") for t in (0.0, 1.0)
    }
    for r in eagle3:
        assert r["acceptance_length"] >= 1.0 and r["bound"] > 0 and r["speedup"] > 0
    greedy = [r for r in eagle3 if r["temperature"] == 0.0]
    assert max(r["acceptance_length"] for r in greedy) > 1.5  # the trained head's drafts are accepted


def test_every_zoo_method_reports_identity_and_speedup_against_plain(tmp_path, capsys):
    """``specdec-generate --zoo``: plain decoding is measured once and every method's row says whether it matched
    it token for token and how fast it ran beside it."""
    from specdec_kit.runtime import cli

    out = tmp_path / "zoo.json"
    assert (
        cli.main(["--zoo", str(ZOO), "--prompt", "def parse(text):", "--max-new-tokens", "12", "--json", str(out)]) == 0
    )
    rows = json.loads(out.read_text())
    methods = [r for r in rows if r["method"] != "plain decoding"]
    assert len(methods) == 9 and [r["method"] for r in rows].count("plain decoding") == 1
    assert all(r["identical_to_plain"] is True and r["speedup_vs_plain"] > 0 for r in methods), methods
    assert capsys.readouterr().out.count("greedy output identical to plain decoding: True") == 9


@pytest.mark.slow
def test_the_model_free_benchmark_runs_every_method_on_every_category(tmp_path):
    """At a smoke size on the PyTorch backend: each method on each task category, the tables and the plot written,
    and each hybrid set against the better of its parts."""
    from specdec_kit.bench.lookup_bench import CATEGORIES, main

    out = tmp_path / "lookup"
    assert (
        main(["--target", "zoo", "--backend", "torch", "--smoke", "--engines", str(tmp_path), "--out", str(out)]) == 0
    )
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert result["meta"]["draft_weights"] == "float"  # 8-bit drafts are ONNX Runtime engines'; PyTorch runs the head
    methods = {"plain", "ngram", "suffix", "griffin", "griffin+suffix", "griffin+suffix (lookup first)"}
    assert {(r["prompt_set"], r["method"]) for r in rows} == {(c, m) for c in CATEGORIES.split(",") for m in methods}
    assert all(r["decode_speedup"] > 0 for r in rows)
    assert all(r["acceptance_length"] >= 1 for r in rows if r["method"] != "plain")
    assert (out / "speedup_by_category.png").stat().st_size > 0
    assert "griffin+suffix" in (out / "by_category.md").read_text()
    paired = json.loads((out / "hybrid_vs_parts.json").read_text())
    hybrids = {"griffin+suffix", "griffin+suffix (lookup first)"}
    assert {(p["prompt_set"], p["method"]) for p in paired} == {(c, m) for c in CATEGORIES.split(",") for m in hybrids}
    assert all(p["better_part"] in ("griffin", "suffix") and p["min_ratio"] <= p["max_ratio"] for p in paired)
    choices = json.loads((out / "hybrid_choices.json").read_text())
    assert {c["method"] for c in choices} == hybrids and all(c["cycles"] > 0 and c["given"] > 0 for c in choices)
    assert "lookup alone promised" in (out / "hybrid_choices.md").read_text()
    calibration = json.loads((out / "lookup_calibration.json").read_text())
    assert {c["method"] for c in calibration} <= {"ngram", "suffix"} and calibration
    assert all(c["cycles"] > 0 and c["promised"] > 0 and c["given"] > 0 for c in calibration)
    ceiling = json.loads((out / "ceiling.json").read_text())
    assert {s["prompt_set"] for s in ceiling["copyable"]} == set(CATEGORIES.split(","))
    assert all(
        s["answer_tokens"] > 0 and 0 <= s["copyable"]["3"] <= s["copyable"]["1"] <= 1 for s in ceiling["copyable"]
    )
    drafted = [r for r in rows if r["method"] != "plain"]
    for best in ceiling["best_per_prompt"]:  # one prompt a category: its best method's is the best single median
        mine = [r for r in drafted if r["prompt_set"] == best["prompt_set"]]
        assert best["best_per_prompt"] == pytest.approx(max(r["speedup"] for r in mine))
    assert {b["prompt_set"] for b in ceiling["best_per_prompt"]} == set(CATEGORIES.split(","))
