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
    python = Path(sys.executable)
    entry = [str(python.parent / "torchrun"), "--nproc-per-node", str(ranks)] if ranks > 1 else [str(python)]
    command = [*entry, "-m", "specdec_kit.train.cli", "--method", method, "--target", str(target)]
    command += ["--sharding", sharding, "--accumulate", str(accumulate)]
    if method == "eagle3":  # the demo target has 2 layers: the inputs of both and the last hidden state
        command += ["--feature-layers", "0,1,2", "--ttt-length", "3"]
    command += ["--steps", str(steps), "--batch", "4", "--seq-len", "32", "--draft-vocab", "48", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stderr


def losses(out: Path) -> list[float]:
    return [h["loss"] for h in torch.load(out / "training_state.pt", weights_only=True)["history"]]


@pytest.mark.parametrize(
    "method, sharding", [("griffin", "ddp"), ("griffin", "fsdp"), ("eagle3", "ddp"), ("eagle3", "fsdp")]
)
def test_two_ranks_follow_one(method, sharding, demo_checkpoints, tmp_path):
    """DDP (a whole head on each rank) and FSDP2 (weights, gradients and AdamW state sharded) alike, for the feature
    heads' trainer and EAGLE-3's."""
    target = demo_checkpoints["target"]
    train(target, tmp_path / "one", STEPS, ranks=1, method=method)
    log = train(target, tmp_path / "two", STEPS, ranks=2, sharding=sharding, method=method)
    assert ("FSDP2 over 2 ranks, this rank holds" in log) == (sharding == "fsdp")
    if sharding == "fsdp":  # half the head's trainable parameters each (the frozen LM head stays whole)
        held, total = (
            int(n.replace(",", ""))
            for n in log.split("this rank holds ")[1].split(" trainable")[0].split(" of the head's ")
        )
        assert abs(held - total / 2) <= total * 0.01
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == STEPS and one[0] != one[-1]
    assert two == pytest.approx(one, rel=1e-4)
    a = torch.load(tmp_path / "one" / "training_state.pt", weights_only=True)["head"]
    b = torch.load(tmp_path / "two" / "training_state.pt", weights_only=True)["head"]
    for key in a:  # the heads agree as their curves do
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_micro_batches_accumulate_to_the_global_batch(method, demo_checkpoints, tmp_path):
    """Two micro-batches of 2 rows per step follow one batch of 4 where each micro-batch's loss has the same
    denominator (EAGLE's one pass counts every position; EAGLE-3 averages over every position), and on 2 ranks (DDP,
    the gradients reduced at the last micro-batch only) they follow one process. (GRIFFIN's and HASS's later passes
    count the positions still aligned, unevenly between micro-batches: each micro-batch averages over its own.)"""
    target = demo_checkpoints["target"]
    train(target, tmp_path / "whole", STEPS, ranks=1, method=method)
    train(target, tmp_path / "micro", STEPS, ranks=1, method=method, accumulate=2)
    train(target, tmp_path / "micro2", STEPS, ranks=2, method=method, accumulate=2)
    whole, micro, micro2 = (losses(tmp_path / name) for name in ("whole", "micro", "micro2"))
    assert whole[0] != whole[-1] and micro == pytest.approx(whole, rel=1e-3)
    assert micro2 == pytest.approx(micro, rel=1e-4)


RESUME = """
import sys, torch
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.heads import HeadSpec, train_head
target = TargetModel.from_pretrained(sys.argv[1], dtype="float32", device="cpu")
data = torch.randint(0, target.vocab_size, (16, 32), generator=torch.Generator().manual_seed(0))
spec = HeadSpec.defaults("hass", steps=int(sys.argv[3]), batch=4, seq_len=32, warmup=1, sharding=sys.argv[4])
train_head(target, data, spec, __import__("pathlib").Path(sys.argv[2]), progress=False)
"""


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_run_resumes_on_another_number_of_ranks(sharding, demo_checkpoints, tmp_path):
    """Half a run on two ranks (DDP, or FSDP2 writing the plain state from its shards), the rest in one process: the
    curve of a run resumed in one process (a resumed run draws its feature noise afresh from the step it resumes at,
    either way)."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    target = str(demo_checkpoints["target"])

    def run(out: str, steps: int, ranks: int) -> None:
        entry = [torchrun, "--nproc-per-node", str(ranks)] if ranks > 1 else [sys.executable]
        command = [*entry, str(script), target, str(tmp_path / out), str(steps), sharding]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run("one", STEPS // 2, 1)
    run("one", STEPS, 1)
    run("mixed", STEPS // 2, 2)
    run("mixed", STEPS, 1)
    assert losses(tmp_path / "mixed") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    if sharding == "fsdp":  # and the other way: a one-process state loaded into two ranks' shards
        run("sharded", STEPS // 2, 1)
        run("sharded", STEPS, 2)
        assert losses(tmp_path / "sharded") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
