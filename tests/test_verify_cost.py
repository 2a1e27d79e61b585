"""The verification-cost curve: every (batch, N) point timed over a cache kept at the context's length."""

from __future__ import annotations

import json

import pytest

from specdec_kit.bench.verify_cost import main, parse_tokens


def test_the_curve_covers_every_batch_and_token_count(tmp_path):
    assert (
        main(
            [
                "--shape",
                "tiny",
                "--device",
                "cpu",
                "--tokens",
                "1-3,8",
                "--batch",
                "1,2",
                "--repeats",
                "2",
                "--context",
                "12",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "verify_cost.json").read_text())
    assert [(p["batch"], p["tokens"]) for p in result["points"]] == [(b, n) for b in (1, 2) for n in (1, 2, 3, 8)]
    assert all(p["ms_min"] <= p["ms"] <= p["ms_max"] and p["ms"] > 0 for p in result["points"])
    assert [p["ratio_to_first"] for p in result["points"] if p["tokens"] == 1] == [1.0, 1.0]
    assert result["parameters"] > 0 and result["device"] == "cpu"
    assert "| 2 | 8 |" in (tmp_path / "verify_cost.md").read_text()
    assert (tmp_path / "verify_cost.png").stat().st_size > 0


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_an_engines_own_target_step_is_timed_over_its_context(backend, demo_engine, demo_checkpoints, tmp_path, capsys):
    """``--engine``: the built engine's target step (its backend, weights and dtype), each call over the same context
    (the drafted tokens are never committed; the run checks the cache's length after every point)."""
    from conftest import griffin_inputs

    from specdec_kit.export.builder import build_engine

    engine = demo_engine
    if backend == "torch":
        engine = build_engine(griffin_inputs(demo_checkpoints, backend="torch"), tmp_path / "torch-engine").path
    out = tmp_path / "out"
    argv = ["--engine", str(engine), "--tokens", "1,2,5", "--batch", "1,2", "--context", "20", "--repeats", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads((out / "verify_cost.json").read_text())
    assert result["engine"] == str(engine) and result["shape"] is None and result["dtype"] == "float32"
    assert f"({backend} target step)" in result["model"]
    assert [(p["batch"], p["tokens"]) for p in result["points"]] == [(b, n) for b in (1, 2) for n in (1, 2, 5)]
    assert all(p["ms_min"] <= p["ms"] <= p["ms_max"] and p["ms"] > 0 for p in result["points"])
    assert f"# Verification cost: engine {engine.name}" in (out / "verify_cost.md").read_text()
    if backend == "torch":  # no ONNX Runtime operators to profile
        assert main([*argv, "--ops", "--out", str(out)]) == 2
        assert "--ops profiles ONNX Runtime's operators" in capsys.readouterr().err


def test_the_kernel_sets_take_turns_over_one_engine(demo_engine, tmp_path, capsys):
    """``--matmul packed,packed-matmul-only,onnxruntime``: the engine's target step with the kit's operators, with
    the kit's MatMul beside ONNX Runtime's Attention, and with ONNX Runtime's own, a curve each, each point's kernels
    named; a kernel set the tool does not know, or one without an engine, is refused."""
    out = tmp_path / "out"
    argv = ["--engine", str(demo_engine), "--tokens", "1,4", "--context", "16", "--repeats", "1"]
    kernels = ("packed", "packed-matmul-only", "onnxruntime")
    assert main([*argv, "--matmul", ",".join(kernels), "--out", str(out)]) == 0
    result = json.loads((out / "verify_cost.json").read_text())
    assert [(p["matmul"], p["tokens"]) for p in result["points"]] == [(k, n) for k in kernels for n in (1, 4)]
    assert [p["ratio_to_first"] for p in result["points"] if p["tokens"] == 1] == [1.0, 1.0, 1.0]
    table = (out / "verify_cost.md").read_text()
    assert "| batch | kernels | N new tokens |" in table and "| 1 | onnxruntime | 4 |" in table
    assert main([*argv, "--matmul", "packed,mkl", "--out", str(out)]) == 2
    assert "--matmul 'packed,mkl'" in capsys.readouterr().err
    assert main(["--shape", "tiny", "--matmul", "packed", "--out", str(out)]) == 2
    assert "give --engine too" in capsys.readouterr().err


def test_ops_profiles_each_width_by_operator_and_says_where_it_grows(demo_engine, tmp_path, capsys):
    """``--ops``: after the timed rounds, each N's calls under ONNX Runtime's profiler (the profiling session's first
    call left out), per kernel set: every operator type's time a call at each N, and a growth column that is the last
    N's time less the first's. Each kernel set is profiled in its own kernels (the kit's MatMul in one, ONNX
    Runtime's in the other). A model shape (no engine) is refused."""
    out = tmp_path / "out"
    argv = ["--engine", str(demo_engine), "--tokens", "1,6", "--context", "24", "--repeats", "1", "--ops"]
    assert main([*argv, "--matmul", "packed,onnxruntime", "--out", str(out)]) == 0
    result = json.loads((out / "verify_cost.json").read_text())
    found = {(f["matmul"], f["tokens"]): f for f in result["operators"]}
    assert sorted(found) == [("onnxruntime", 1), ("onnxruntime", 6), ("packed", 1), ("packed", 6)]
    for f in found.values():
        assert f["calls"] == 10  # PROFILED_CALLS, the first of the new session's 11 left out
        assert f["operators"] and all(o["ms"] > 0 and o["nodes"] > 0 for o in f["operators"].values())
    for n in (1, 6):
        assert "PackedMatMul" in found[("packed", n)]["operators"]
        assert "PackedMatMul" not in found[("onnxruntime", n)]["operators"]
        assert "MatMul" in found[("onnxruntime", n)]["operators"]
    table = (out / "verify_cost_ops.md").read_text().splitlines()
    assert "## batch 1, kernels packed" in table and "## batch 1, kernels onnxruntime" in table
    assert "| operator | nodes | N=1: ms | N=6: ms | N=6 - N=1 |" in table
    row = next(line for line in table if line.startswith("| PackedMatMul |")).split("|")
    one, six, growth = (float(cell) for cell in row[3:6])
    assert one == pytest.approx(found[("packed", 1)]["operators"]["PackedMatMul"]["ms"], abs=0.006)
    assert growth == pytest.approx(six - one, abs=0.011)
    assert main(["--shape", "tiny", "--ops", "--out", str(out)]) == 2
    assert "--ops applies to an engine's target step" in capsys.readouterr().err


def test_an_engine_that_is_not_there_is_named(tmp_path, capsys):
    assert main(["--engine", str(tmp_path / "missing"), "--tokens", "1"]) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err


def test_token_counts_parse_and_bad_ones_are_named(capsys):
    assert parse_tokens("1-4,8,3") == [1, 2, 3, 4, 8]
    assert main(["--shape", "tiny", "--tokens", "4-2"]) == 2
    assert "'4-2' is not a range" in capsys.readouterr().err


def test_the_gpu_check_says_what_it_would_run_without_a_gpu(tmp_path):
    import os
    import shutil
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    bin_dir = tmp_path / "bin"  # a PATH with the script's tools and no nvidia-smi, whatever this machine has
    bin_dir.mkdir()
    for tool in ("date", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PATH": str(bin_dir)}
    proc = subprocess.run(
        [shutil.which("bash"), str(script), str(tmp_path / "gpu")], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout and "specdec_kit.bench.verify_cost --shape llama3-8b" in proc.stdout
    assert "cuda_check.py --device cuda" in proc.stdout and not (tmp_path / "gpu").exists()
    assert "bash scripts/setup.sh" in proc.stdout and ".venv/bin/python -m pytest" in proc.stdout
    given = subprocess.run(
        [shutil.which("bash"), str(script), str(tmp_path / "gpu")],
        capture_output=True,
        text=True,
        env={**env, "PYTHON": "python3 -P"},
        timeout=60,
    )  # a machine's own interpreter: no set-up
    assert given.returncode == 0 and "setup.sh" not in given.stdout and "python3 -P -m pytest" in given.stdout


def test_the_cuda_check_decodes_every_kind_on_the_cpu_identically(tmp_path):
    """``scripts/cuda_check.py`` (the GPU check's zoo step) runs every registered kind, the model-free ones without a
    head, and finds each identical to transformers' greedy decoding here too."""
    import subprocess
    import sys
    from pathlib import Path

    from specdec_kit.runtime.registry import draft_kinds

    script = Path(__file__).resolve().parent.parent / "scripts" / "cuda_check.py"
    out = tmp_path / "zoo.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--max-new-tokens", "8", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", *draft_kinds()]
    assert all(r["identical_to_transformers"] for r in rows)
