"""Training under ``torchrun``: two ranks (gloo, on this CPU) follow one process's loss curve at the same global
batch, and a run resumes on another number of ranks. The CLI is run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STEPS = 8


def train(
    target: Path, out: Path, steps: int, ranks: int, sharding: str = "ddp", method: str = "griffin", accumulate: int = 1
) -> str:
    """The CLI's run; FSDP2 runs shard the online target's decoder layers too (``--target-sharding fsdp``)."""
    python = Path(sys.executable)
    entry = (
        [str(python.parent / "torchrun"), "--standalone", "--nproc-per-node", str(ranks)]
        if ranks > 1
        else [str(python)]
    )
    command = [*entry, "-m", "specdec_kit.train.cli", "--method", method, "--target", str(target)]
    command += ["--sharding", sharding, "--accumulate", str(accumulate)]
    if sharding == "fsdp" and ranks > 1 and method != "moa":
        command += ["--target-sharding", "fsdp"]
    if method == "eagle3":  # the demo target has 2 layers: the inputs of both and the last hidden state
        command += ["--feature-layers", "0,1,2", "--ttt-length", "3"]
    if method not in ("medusa", "moa"):  # they predict over the target's whole vocabulary
        command += ["--draft-vocab", "48"]
    command += ["--steps", str(steps), "--batch", "4", "--seq-len", "32", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stderr


def losses(out: Path) -> list[float]:
    return [h["loss"] for h in torch.load(out / "training_state.pt", weights_only=True)["history"]]


def held_share(log: str, what: str = "the head's") -> tuple[int, int]:
    """(parameters this rank holds, all of them) from an FSDP2 run's log: of ``what`` (the head's trainable
    parameters, or the target's decoder-layer parameters)."""
    line = next(line for line in log.splitlines() if f" of {what} " in line)
    held, total = line.split("this rank holds ")[1].split(f" of {what} ")
    return int(held.replace(",", "")), int(total.split()[0].replace(",", ""))


def assert_same_run(one: Path, other: Path) -> None:
    a, b = losses(one), losses(other)
    assert len(a) == len(b) == STEPS and a[0] != a[-1]
    assert b == pytest.approx(a, rel=1e-4)
    heads = [torch.load(out / "training_state.pt", weights_only=True)["head"] for out in (one, other)]
    for key in heads[0]:  # the heads agree as their curves do
        torch.testing.assert_close(heads[0][key], heads[1][key], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("method", ["griffin", "eagle3"])
def test_two_ranks_follow_one_with_either_sharding_and_micro_batches(method, demo_checkpoints, tmp_path):
    """The feature heads' trainer and EAGLE-3's on 2 ranks: DDP (a whole head on each, the online target replicated)
    and FSDP2 (weights, gradients and AdamW state sharded, the frozen LM head whole, and the online target's decoder
    layers sharded too) follow one process's curve; each rank runs its share of the rows through the target, replicated
    or sharded. EAGLE-3 also in two micro-batches
    per step: they follow one batch (each averages over the same number of positions), on 1 rank and on 2 (the
    gradients reduced at the last micro-batch only). (GRIFFIN's and HASS's later passes count the positions still
    aligned, unevenly between micro-batches, each averaging over its own: close, not equal.)"""
    target = demo_checkpoints["target"]
    train(target, tmp_path / "one", STEPS, ranks=1, method=method)
    log = train(target, tmp_path / "fsdp", STEPS, ranks=2, sharding="fsdp", method=method)
    for what in ("the head's", "the target's"):  # half of each on each rank
        held, total = held_share(log, what)
        assert abs(held - total / 2) <= total * 0.01
    assert_same_run(tmp_path / "one", tmp_path / "fsdp")
    if method == "griffin":
        assert "FSDP2" not in train(target, tmp_path / "ddp", STEPS, ranks=2, method=method)
        assert_same_run(tmp_path / "one", tmp_path / "ddp")
    else:  # EAGLE-3's DDP run is the one in micro-batches
        train(target, tmp_path / "micro", STEPS, ranks=1, method=method, accumulate=2)
        assert "FSDP2" not in train(target, tmp_path / "micro2", STEPS, ranks=2, method=method, accumulate=2)
        assert losses(tmp_path / "micro") == pytest.approx(losses(tmp_path / "one"), rel=1e-3)
        assert losses(tmp_path / "micro2") == pytest.approx(losses(tmp_path / "micro"), rel=1e-4)


@pytest.mark.parametrize("method, sharding", [("medusa", "ddp"), ("moa", "fsdp")])
def test_medusa_and_moa_follow_one_process_on_two_ranks(method, sharding, demo_checkpoints, tmp_path):
    """The other trainers share their batches too: Medusa's heads under DDP, MoA's draft under FSDP2 (its frozen
    target an argument of the step, not part of the sharded unit)."""
    target = demo_checkpoints["target"]
    train(target, tmp_path / "one", STEPS, ranks=1, method=method)
    train(target, tmp_path / "two", STEPS, ranks=2, sharding=sharding, method=method)
    assert_same_run(tmp_path / "one", tmp_path / "two")


RESUME = """
import sys, torch
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.heads import HeadSpec, train_head
target = TargetModel.from_pretrained(sys.argv[1], dtype="float32", device="cpu")
data = torch.randint(0, target.vocab_size, (16, 32), generator=torch.Generator().manual_seed(0))
spec = HeadSpec.defaults("hass", steps=int(sys.argv[3]), batch=4, seq_len=32, warmup=1, sharding=sys.argv[4])
train_head(target, data, spec, __import__("pathlib").Path(sys.argv[2]), progress=False)
"""


def test_a_run_resumes_on_another_number_of_ranks(demo_checkpoints, tmp_path):
    """Half a run on two FSDP2 ranks (the plain state written from their shards), the rest in one process, and the
    other way (a one-process state loaded into the shards): the curve of a run resumed in one process (a resumed run
    draws its feature noise afresh from the step it resumes at, either way). (A DDP rank 0 writes its whole head as
    one process does.)"""
    sharding = "fsdp"
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    target = str(demo_checkpoints["target"])

    def run(out: str, steps: int, ranks: int) -> None:
        entry = [torchrun, "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else [sys.executable]
        command = [*entry, str(script), target, str(tmp_path / out), str(steps), sharding]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run("one", STEPS // 2, 1)
    run("one", STEPS, 1)
    run("mixed", STEPS // 2, 2)
    run("mixed", STEPS, 1)
    assert losses(tmp_path / "mixed") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    run("sharded", STEPS // 2, 1)  # and the other way
    run("sharded", STEPS, 2)
    assert losses(tmp_path / "sharded") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
