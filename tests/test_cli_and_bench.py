"""The command-line entry points run end to end on checkpoints written to disk."""

from __future__ import annotations

import json
import statistics

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


def test_generate_compare_plain_in_rounds(checkpoints, tmp_path, capsys):
    """``--rounds``: the method and plain decoding take turns; the speedup reported is the median of the rounds'."""
    out = tmp_path / "stats.json"
    args = ["--target", str(checkpoints / "target"), "--draft", "griffin", "--draft-path", str(checkpoints / "griffin")]
    rc = cli.main(
        args
        + ["--prompt", "Hello there", "--one-by-one", "--max-new-tokens", "16", "--compare-plain", "--rounds", "3"]
        + ["--json", str(out)]
    )
    assert rc == 0
    method, plain = json.loads(out.read_text())
    assert method["identical_to_plain"] is True and method["rounds"] == plain["rounds"] == 3
    assert len(method["speedup_rounds"]) == 3 and len(method["copy_gbs_rounds"]) == 3
    assert all(gbs > 0 for gbs in method["copy_gbs_rounds"])
    assert method["speedup_vs_plain"] == pytest.approx(statistics.median(method["speedup_rounds"]), abs=1e-3)
    printed = capsys.readouterr().out
    assert "median of 3 rounds taking turns" in printed and printed.count("== plain decoding") == 1
    with pytest.raises(SystemExit):
        cli.main(args + ["--compare-plain", "--rounds", "0"])
    assert "--rounds: expected a whole number of at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(args + ["--rounds", "3"])
    assert "--rounds 3: the rounds take turns with plain decoding; add --compare-plain" in capsys.readouterr().err


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


@pytest.mark.slow
def test_server_variants_are_measured_side_by_side_with_plain_decoding(demo_engine, tmp_path):
    """``specdec-bench-variants`` serves each variant and plain decoding, measures every level in every round, and
    reports each variant against plain and against the first variant, with the same greedy text as plain."""
    from specdec_kit.bench.server_variants import main, parse_variant

    assert parse_variant("pooled=--cost-pool 0.25") == ("pooled", ["--speculation", "cost", "--cost-pool", "0.25"])
    assert parse_variant("x=--speculation=off --fold-prompt-tokens 0")[1] == [
        "--speculation",
        "off",
        "--fold-prompt-tokens",
        "0",
    ]
    for bad in ("plain=--speculation off", "no-options", "a-b=--cost-pool 0"):
        with pytest.raises(Exception, match="LABEL=OPTIONS"):
            parse_variant(bad)
    args = ["--engine", str(demo_engine), "--concurrency", "1,2", "--repeats", "1", "--prompts", "2"]
    args += ["--max-tokens", "8", "--requests-per-stream", "1", "--quiet-wait", "0", "--out", str(tmp_path)]
    assert main([*args, "--variant", "each=--cost-pool 0", "--variant", "fold=--fold-prompt-tokens 64"]) == 0
    result = json.loads((tmp_path / "server_variants.json").read_text())
    assert {(r["mode"], r["streams"]) for r in result["summary"]} == {
        (m, c) for m in ("plain", "each", "fold") for c in (1, 2)
    }
    assert len(result["rows"]) == 3 * 2 and not any(r["failed"] for r in result["rows"])
    for row in result["summary"]:
        assert row["same_text_as_reference"] == "2/2" and row["over_compared"] is not None
        assert (row["acceptance_length"] is None) == (row["mode"] == "plain")
    assert (tmp_path / "server_variants.md").read_text().count("| kit |") == 6


def test_coupled_drafting_is_measured_against_uncoupled_and_plain_with_the_same_tokens(demo_engine, tmp_path):
    """``python -m specdec_kit.bench.coupled_drafting`` decodes each prompt plainly, with the head ranking by its
    probabilities and by the draws, and reports both drafts' acceptance against plain sampling's identical text."""
    from specdec_kit.bench.coupled_drafting import main

    out = tmp_path / "coupled"
    args = [str(demo_engine), "--categories", "qa,translation", "--prompts", "2", "--new-tokens", "12"]
    assert main([*args, "--temperature", "0.9", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["identical"] is True and result["prompts"] == 4 and result["temperature"] == 0.9
    assert set(result["modes"]) == {"plain", "uncoupled", "coupled"} and "tau" not in result["modes"]["plain"]
    assert all(result["modes"][m]["tau"] >= 1.0 for m in ("uncoupled", "coupled"))
    assert out.with_suffix(".md").read_text().count("| coupled |") == 1


def test_the_kits_threads_are_the_cores_its_process_may_run_on(tmp_path):
    """``set_threads`` (torch) and an engine's ONNX Runtime sessions on a CPU count the cores the process may run on
    (a container's cpuset, ``taskset``), not the machine's, which both torch's and ONNX Runtime's own counts take:
    on one core of this machine one thread; split further between ``torchrun``'s ranks; ``OMP_NUM_THREADS`` kept
    where set. A session's threads are counted as those opening one graph adds (its intra-op pool's workers, beside
    one of ONNX Runtime's own)."""
    import os
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "relu.onnx")
    probe = (
        "import os, sys, torch\n"
        "os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\n"
        "from specdec_kit.runtime.loader import set_threads\n"
        "from specdec_kit.runtime.ort.backend import OrtGraph\n"
        "own = torch.get_num_threads()\n"
        "set_threads()\n"
        "tasks = len(os.listdir('/proc/self/task'))\n"
        "graph = OrtGraph(sys.argv[2], torch.device('cpu'))\n"
        "print(own, torch.get_num_threads(), len(os.listdir('/proc/self/task')) - tasks)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}

    def threads(allowed: list[int], **extra: str) -> tuple[int, int, int]:
        """In a process on ``allowed`` cores: torch's own count, torch's after ``set_threads``, the threads a
        session adds."""
        cpus = ",".join(str(c) for c in allowed)
        argv = [sys.executable, "-c", probe, cpus, str(tmp_path / "relu.onnx")]
        run = subprocess.run(argv, env={**env, **extra}, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        own, after, added = run.stdout.split()[-3:]
        return int(own), int(after), int(added)

    cores = sorted(os.sched_getaffinity(0))
    _, torch_on_one, session_on_one = threads(cores[:1])
    assert torch_on_one == 1
    _, torch_on_all, session_on_all = threads(cores)
    assert torch_on_all == len(cores) and session_on_all == session_on_one + len(cores) - 1
    assert threads(cores, LOCAL_WORLD_SIZE="2")[1] == max(1, len(cores) // 2)
    own, after, added = threads(cores, OMP_NUM_THREADS="1")
    assert after == own and added == session_on_one  # the user's setting, as torch reads it, and the sessions' too


def test_servers_run_the_threads_their_process_may(monkeypatch):
    """A benchmark's or test's llama-server gets ``-t`` = ``OMP_NUM_THREADS`` where set (test processes side by side set
    it to 1), else this process's cores; the printed serve command leaves the count to llama.cpp."""
    import os
    from pathlib import Path

    from specdec_kit.export import llamacpp
    from specdec_kit.runtime.core.cpu import process_threads

    cores = len(os.sched_getaffinity(0))
    for value, expected in (("1", 1), ("3", 3), ("", cores), ("0", cores), ("two", cores)):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert process_threads() == expected, value
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert process_threads() == cores
    monkeypatch.setattr(llamacpp, "tool", lambda name: Path("/opt/llama.cpp/bin") / name)
    pinned = llamacpp.server_command(Path("t.gguf"), None, 8080, threads=1)
    assert pinned[pinned.index("-t") + 1] == "1"
    assert "-t" not in llamacpp.server_command(Path("t.gguf"), Path("d.gguf"), 8080)
