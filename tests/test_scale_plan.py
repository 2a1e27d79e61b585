"""Plans for 8B-70B targets, checked on the meta device: the targets have Llama-3.1's sizes, the trainer's FSDP2
sharding splits every head parameter across the plan's ranks, and what each GPU holds fits (or is refused where it
cannot: a 70B target replicated for online hidden states)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from specdec_kit.train.scale_plan import GIB, PLANS, Plan, check_plan, main

SIZES = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9}  # Llama-3.1's published parameter counts


@pytest.mark.parametrize("path", sorted(PLANS.glob("*.json")), ids=lambda p: p.stem)
def test_each_plan_shards_its_head_across_its_ranks_and_fits(path):
    plan = Plan.read(path)
    check = check_plan(plan)
    size = next(v for k, v in SIZES.items() if plan.name.startswith(k + "-"))
    assert check.target_params == pytest.approx(size, rel=0.01)
    embed = check.shard_shapes["draft.embed_tokens.weight"]
    assert embed[0] == (128256, plan.target["hidden_size"])
    assert embed[1] == (math.ceil(128256 / plan.world), plan.target["hidden_size"])  # FSDP2's dim-0 shards
    assert check.shard_params == pytest.approx(check.head_params / plan.world, rel=0.01)
    assert check.memory["AdamW state shards (2 x fp32)"] == 2 * check.memory["gradient shards (fp32)"]
    assert check.fits and sum(check.memory.values()) < 0.9 * plan.gpu_memory_gib * GIB
    assert check.hours > 0 and check.training_tokens == plan.conversations * plan.answer_tokens


def test_a_70b_target_cannot_be_replicated_for_online_hidden_states_but_fits_sharded():
    """Replicated, the 70B target alone outgrows a GPU; its decoder layers sharded over the 16 GPUs by the trainer's
    own code (each holding a sixteenth of them, the embedding and LM head whole) fit beside the head."""
    plan = Plan.read(PLANS / "llama-3.1-70b-eagle3-2x8xa100.json")
    online = check_plan(dataclasses.replace(plan, hidden_states="online"))
    assert online.memory["target weights (bf16, online)"] > plan.gpu_memory_gib * GIB and not online.fits
    sharded = check_plan(Plan.read(PLANS / "llama-3.1-70b-eagle3-2x8xa100-online.json"))
    whole = sharded.memory["target embed, norm, LM head (bf16)"]
    assert whole == pytest.approx(2 * 2 * 128256 * 8192, rel=1e-3)  # the embedding and the LM head, bf16
    layers = 2 * sharded.target_params - whole
    assert sharded.memory["target layer shards (bf16)"] == pytest.approx(layers / plan.world, rel=1e-3)
    assert sharded.fits and sharded.hours > check_plan(plan).hours  # the target's forward every epoch


def test_the_command_prints_every_plan_and_refuses_a_broken_one(tmp_path, capsys):
    assert main(["--json"]) == 0
    checks = json.loads(capsys.readouterr().out)
    assert set(checks) == {p.stem for p in PLANS.glob("*.json")}
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"name": "x", "target": {}}))
    assert main([str(broken)]) == 2
    assert "broken.json: " in capsys.readouterr().err
