"""Mixture of Attentions: TLI machinery, checkpoint layout, continuous batching; (greedy and sampling
losslessness run in test_greedy_lossless.py and test_sampling_distribution.py with the other drafts)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_kit.runtime.choices import EAGLE1_DEFAULT
from specdec_kit.runtime.drafts.loading import DraftLoadError, load_draft, save_draft
from specdec_kit.runtime.generate import SpeculativeGenerator
from specdec_kit.runtime.loader import make_drafter
from specdec_kit.runtime.moa_drafting import MoAStep, MoATreeDrafter
from specdec_kit.runtime.sampling import SamplingParams
from specdec_kit.runtime.synthetic import oracle_moa, random_moa
from specdec_kit.runtime.trees import StaticTree

from conftest import NEW_TOKENS


def test_tli_equal_to_depth_of_target_drafts_the_target_itself(random_case):
    """With TLI = L and a pass-through body the draft is the target: every greedy draft path is accepted
    in full (tau = tree depth + 1), which only holds if the draft-time target K/V, positions and masks
    (root entry, tree levels after it) are exactly right."""
    case = random_case
    tree = StaticTree.from_choices(EAGLE1_DEFAULT)
    gen = SpeculativeGenerator(case.target, MoATreeDrafter(MoAStep(oracle_moa(case.target), case.target), tree))
    results = gen.generate(case.prompts[:6], NEW_TOKENS)
    depth = tree.buffers.max_depth
    for res, ref in zip(results, case.references[:6]):
        assert res.tokens == ref
        full_cycles = res.stats.cycles - 1  # the last cycle may stop at the token budget
        assert res.stats.accepted_per_depth[depth - 1] >= full_cycles


def test_checkpoint_round_trip_and_mismatches(random_case, tmp_path):
    target = random_case.target
    draft = random_moa(target, tli=1)
    save_draft(draft, tmp_path / "moa", "moa", safetensors=True)
    cfg = json.loads((tmp_path / "moa" / "config.json").read_text())
    assert cfg["moa_tli"] == 1 and cfg["target_num_layers"] == target.num_layers and cfg["architectures"] == ["MoADraft"]
    drafter = make_drafter(target, "moa", tmp_path / "moa", StaticTree.from_choices(EAGLE1_DEFAULT))
    loaded = drafter.step.draft
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), draft.state_dict().values()))
    (tmp_path / "moa" / "config.json").write_text(json.dumps({**cfg, "target_num_layers": 7}))
    with pytest.raises(DraftLoadError, match="target_num_layers does not fit the target: expected 2, found 7"):
        make_drafter(target, "moa", tmp_path / "moa", StaticTree.from_choices(EAGLE1_DEFAULT))
    (tmp_path / "moa" / "config.json").write_text(json.dumps({**cfg, "moa_tli": 5}))
    with pytest.raises(DraftLoadError, match="moa_tli = 5, expected 0..2"):
        load_draft(tmp_path / "moa", "moa", target.hidden_size, target.vocab_size)


def test_requests_joining_mid_flight_with_moa(predictable_case):
    case = predictable_case
    gen = SpeculativeGenerator(case.target, MoATreeDrafter(MoAStep(oracle_moa(case.target), case.target),
                                                           StaticTree.from_choices(EAGLE1_DEFAULT)), eos_token_ids=[])
    greedy = SamplingParams()
    batch = gen.admit(None, gen.prefill(case.prompts[:2], [NEW_TOKENS] * 2, [greedy] * 2, tags=[0, 1]))
    rows = {row.tag: row for row in batch.rows}
    for cycle in range(12):
        if cycle == 3:
            new = gen.prefill(case.prompts[2:4], [NEW_TOKENS] * 2, [greedy] * 2, tags=[2, 3])
            rows.update({row.tag: row for row in new.rows})
            batch = gen.admit(batch, new)
        if batch.size:
            gen.cycle(batch, speculate=cycle % 4 != 1)
            gen.retire(batch)
    while batch.size:
        gen.cycle(batch)
        gen.retire(batch)
    assert [rows[i].tokens for i in range(4)] == case.references[:4]
