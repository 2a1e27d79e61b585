"""The draft-vocabulary measurement: a head re-ranked over another set of the target's LM head rows, and the count of
answer tokens a draft vocabulary leaves out."""

from __future__ import annotations

import torch

from specdec_kit.bench.draft_vocab import answer_coverage, vocabulary_head
from specdec_kit.runtime.drafts.layers import TargetRowsHead
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.synthetic import random_griffin, tiny_hf_model, with_draft_vocab


def test_a_head_over_other_rows_ranks_the_targets_logits_of_those_ids_and_leaves_the_trained_head_alone():
    target = TargetModel(tiny_hf_model(hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=96))
    head = TargetRowsHead(target.lm_head, with_draft_vocab(random_griffin(target), 40))
    trained_ids = head.ids.clone()
    outside = sorted(set(range(96)) - set(trained_ids.tolist()))[:5]
    ids = torch.tensor(sorted(set(trained_ids.tolist()) | set(outside)))
    widened = vocabulary_head(head, target.lm_head.weight.detach(), ids)
    prediction = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    logits = widened(prediction)
    full = target.lm_head(prediction)
    assert torch.equal(torch.isfinite(logits[0, 0]).nonzero()[:, 0], ids)
    torch.testing.assert_close(logits[..., ids], full[..., ids])
    assert torch.isinf(head(prediction)[..., outside]).all()  # the trained head still ranks its own vocabulary only
    assert torch.equal(head.ids, trained_ids)


def test_answer_coverage_counts_tokens_outside_the_draft_vocabulary_and_those_the_prompt_holds():
    assert answer_coverage(prompt=[1, 7, 9], answer=[1, 7, 8, 9, 9, 5], draft_ids={1, 5}) == (6, 4, 3)
    assert answer_coverage(prompt=[], answer=[], draft_ids={1}) == (0, 0, 0)
