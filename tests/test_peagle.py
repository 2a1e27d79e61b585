"""P-EAGLE drafts: the layout vLLM's EAGLE-3 class loads with parallel drafting, loaded strictly; one draft forward
computes what vLLM's parallel-drafting proposer computes; training sees what drafting sees.

vLLM's proposer (``parallel_drafting``) extends each request's draft input after its last verified token with K - 1
slots of ``mask_token_id``, whose hidden input is ``combine_hidden_states(mask_hidden)`` (the EAGLE-3 ``fc`` of the
learned ``mask_hidden``), at the next positions, and samples the K proposals from the last real position and the
slots, in one causal forward. The reference here is the recreated official EAGLE-3 draft (``test_eagle3.RefModel``)
run over exactly that input.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_eagle3 import CONFIG, TARGET_HIDDEN, TARGET_SHAPE, reference_checkpoint

from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.drafting import TorchFeatureStep
from specdec_kit.runtime.decoding.parallel_drafting import ParallelDrafter, parallel_tree
from specdec_kit.runtime.drafts.layers import DraftVocabHead
from specdec_kit.runtime.drafts.loading import DraftLoadError
from specdec_kit.runtime.synthetic import random_peagle, tiny_target
from specdec_kit.train.eagle3 import TrainingTimeTest, tapped_outputs

MASK_TOKEN, K = 7, 4


def peagle_checkpoint(path, seed=0):
    """The recreated reference's EAGLE-3 weights plus ``mask_hidden`` [1, 3 d_target] and vLLM's config keys."""
    ref = reference_checkpoint(path, seed=seed)
    mask = torch.randn(1, 3 * TARGET_HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    state = dict(ref.state_dict(), mask_hidden=mask)
    torch.save(state, path / "pytorch_model.bin")
    config = json.loads((path / "config.json").read_text())
    config.update(mask_token_id=MASK_TOKEN, parallel_draft_tokens=K)
    (path / "config.json").write_text(json.dumps(config))
    return ref, mask


def load_peagle(path):
    return load_draft(path, "peagle", TARGET_HIDDEN, CONFIG["vocab_size"], target_shape=TARGET_SHAPE)


@torch.no_grad()
def test_one_forward_proposes_what_vllms_parallel_drafting_proposes(tmp_path):
    ref, mask = peagle_checkpoint(tmp_path / "peagle")
    draft = load_peagle(tmp_path / "peagle")
    assert (draft.mask_token_id, draft.parallel_tokens) == (MASK_TOKEN, K)
    drafter = ParallelDrafter(
        TorchFeatureStep(draft, DraftVocabHead(draft)), DynamicTreeConfig(4, 3, 1), None, mask, MASK_TOKEN, K
    )
    torch.manual_seed(2)
    b, n = 2, 6
    feats, ids = torch.randn(b, n, 3 * TARGET_HIDDEN), torch.randint(0, CONFIG["vocab_size"], (b, n))
    drafter.reset(b, 32)
    got = drafter.proposals(feats, ids, torch.full((b,), n))  # [B, K, V] over the target's vocabulary
    # vLLM's input: the pairs, then K - 1 masked slots (mask_hidden through fc, the mask token) at the next positions
    full_feats = torch.cat([ref.fc(feats), ref.fc(mask).expand(b, K - 1, -1)], dim=1)
    full_ids = torch.cat([ids, torch.full((b, K - 1), MASK_TOKEN)], dim=1)
    out, _ = ref(full_feats, full_ids, torch.arange(n + K - 1).expand(b, -1))
    want = torch.log_softmax(ref.lm_head(ref.norm(out[:, n - 1 :])), dim=-1)  # over the draft vocabulary
    ids_in_target = torch.nonzero(ref.t2d).flatten()
    assert (got[..., ids_in_target] - want).abs().max() < 1e-5
    assert torch.isinf(got[..., ~ref.t2d]).all()  # nothing outside the draft vocabulary is proposed
    # only the pairs join the draft's cache: the next cycle's pairs take the slots' positions
    assert drafter.cache.lengths.tolist() == [n, n]


@torch.no_grad()
def test_training_sees_what_one_draft_forward_computes():
    """Training-time test's step j at position t is slot j of a forward whose last pair is t."""
    target = tiny_target(layers=4)
    draft = random_peagle(target).float()
    tokens = torch.randint(0, target.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    taps, logits = tapped_outputs(target, tokens, draft.feature_layers)
    ttt = TrainingTimeTest(draft, taps, tokens, logits)
    steps = []
    for j in range(draft.parallel_tokens):
        ttt.step(j)
        steps.append(torch.log_softmax(draft.logits(ttt.hidden), dim=-1))
    drafter = ParallelDrafter(
        TorchFeatureStep(draft, DraftVocabHead(draft)),
        DynamicTreeConfig(4, 3, 1),
        None,
        draft.mask_hidden,
        draft.mask_token_id,
        draft.parallel_tokens,
    )
    ids = draft.target_ids(torch.arange(draft.draft_vocab_size))
    for t in (3, 11):  # pairs 0..t: (taps of x_i, x_{i+1})
        drafter.reset(1, 64)
        got = drafter.proposals(taps[:, : t + 1], tokens[:, 1 : t + 2], torch.tensor([t + 1]))
        for j, want in enumerate(steps):
            assert (got[0, j, ids] - want[0, t]).abs().max() < 1e-5, (t, j)


def test_a_tree_from_one_forward_is_bounded_by_its_proposals():
    assert parallel_tree(DynamicTreeConfig(24, 5, 4), 4) == DynamicTreeConfig(24, 3, 4)
    assert parallel_tree(DynamicTreeConfig(40, 5, 3), 3) == DynamicTreeConfig(22, 2, 3)  # 1 + 3 + 2 x 9 candidates
    target = tiny_target(layers=4)
    with pytest.raises(ValueError, match="dynamic trees only"):
        ParallelDrafter(
            TorchFeatureStep(random_peagle(target), target.lm_head), object(), None, torch.zeros(1, 3), 0, 3
        )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c, s: s.pop("mask_hidden"), "key 'mask_hidden' is missing"),
        (lambda c, s: c.pop("mask_token_id"), "key 'mask_token_id' is missing"),
        (lambda c, s: c.update(mask_token_id=CONFIG["vocab_size"]), "mask_token_id is 120, expected a token id"),
        (lambda c, s: c.update(parallel_draft_tokens=1), "parallel_draft_tokens is 1, expected an integer >= 2"),
        (lambda c, s: s.update(mask_hidden=torch.zeros(1, 5)), "key 'mask_hidden' has shape [1, 5], expected [1, 96]"),
    ],
)
def test_a_wrong_checkpoint_is_refused_naming_the_file_and_key(tmp_path, change, message):
    path = tmp_path / "peagle"
    peagle_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    state = torch.load(path / "pytorch_model.bin")
    change(config, state)
    (path / "config.json").write_text(json.dumps(config))
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(DraftLoadError, match="peagle") as refused:
        load_peagle(path)
    assert message in str(refused.value)
