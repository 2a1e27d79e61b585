"""The command-line entry points run end to end on checkpoints written to disk."""

from __future__ import annotations

import json

import pytest

from specdec_kit.bench import runtime_overhead
from specdec_kit.runtime import cli
from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.demo import write_char_tokenizer
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.synthetic import oracle_griffin, tiny_hf_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    hf = tiny_hf_model(
        hidden_size=64,
        layers=3,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=75,
        context_mix=0.1,
        logit_scale=20.0,
        seed=2,
    )
    hf.save_pretrained(root / "target")
    write_char_tokenizer(root / "target")
    save_draft(oracle_griffin(TargetModel(hf)), root / "griffin", "griffin")
    return root


def test_generate_compare_plain(checkpoints, tmp_path, capsys):
    out = tmp_path / "stats.json"
    rc = cli.main(
        [
            "--target",
            str(checkpoints / "target"),
            "--draft",
            "griffin",
            "--draft-path",
            str(checkpoints / "griffin"),
            "--prompt",
            "Hello there",
            "--prompt",
            "abc",
            "--total-tokens",
            "12",
            "--depth",
            "3",
            "--top-k",
            "3",
            "--max-new-tokens",
            "24",
            "--compare-plain",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    stats = json.loads(out.read_text())
    assert stats[0]["identical_to_plain"] is True and stats[0]["tokens"] == 48
    assert stats[0]["acceptance_length"] > 1.5
    printed = capsys.readouterr().out
    assert "acceptance length tau=" in printed and "'Hello there' ->" in printed


def test_generate_refuses_mismatched_draft(checkpoints, tmp_path, capsys):
    hf = tiny_hf_model(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=75)
    save_draft(oracle_griffin(TargetModel(hf)), tmp_path / "small", "griffin")
    rc = cli.main(
        ["--target", str(checkpoints / "target"), "--draft", "griffin", "--draft-path", str(tmp_path / "small")]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "hidden_size" in err and "expected 64, found 32" in err


def test_benchmark_smoke(tmp_path):
    out = tmp_path / "bench.json"
    assert runtime_overhead.main(["--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["greedy_outputs_identical"] is True
    assert 0.0 <= result["share_outside_forwards"] < 1.0 and result["runtime_plain_tok_s"] > 0
