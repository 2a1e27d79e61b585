"""Mixture of Attentions: TLI machinery, checkpoint layout, continuous batching; (greedy and sampling
losslessness run in test_greedy_lossless.py and test_sampling_distribution.py with the other drafts)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import NEW_TOKENS

from specdec_kit.runtime.checkpoint import load_draft, save_draft
from specdec_kit.runtime.core.choices import EAGLE1_DEFAULT
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import StaticTree
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.moa_drafting import MoATreeDrafter, TorchMoAStep
from specdec_kit.runtime.drafts.loading import DraftLoadError
from specdec_kit.runtime.loader import make_drafter
from specdec_kit.runtime.synthetic import oracle_moa, random_moa


def test_tli_equal_to_depth_of_target_drafts_the_target_itself(random_case):
    """With TLI = L and a pass-through body the draft is the target: every greedy draft path is accepted
    in full (tau = tree depth + 1), which only holds if the draft-time target K/V, positions and masks
    (root entry, tree levels after it) are exactly right."""
    case = random_case
    tree = StaticTree.from_choices(EAGLE1_DEFAULT)
    gen = SpeculativeGenerator(case.target, MoATreeDrafter(TorchMoAStep(oracle_moa(case.target), case.target), tree))
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
    assert (
        cfg["moa_tli"] == 1 and cfg["target_num_layers"] == target.num_layers and cfg["architectures"] == ["MoADraft"]
    )
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
    gen = SpeculativeGenerator(
        case.target,
        MoATreeDrafter(TorchMoAStep(oracle_moa(case.target), case.target), StaticTree.from_choices(EAGLE1_DEFAULT)),
        eos_token_ids=[],
    )
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


def test_training_learns_the_target_and_stays_lossless(predictable_case, tmp_path):
    """K-step bounded training with KL + Smooth-L1, TLI 0 and 1, on sequences the target itself wrote."""
    from specdec_kit.runtime.core.trees import DynamicTreeConfig
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.train.moa import MoASpec, train_moa

    case = predictable_case
    plain = SpeculativeGenerator(case.target, NoDrafter(), eos_token_ids=[])
    starts = [[i] for i in range(0, 64, 2)]
    data = torch.tensor([s + r.tokens for s, r in zip(starts, plain.generate(starts, 47))])
    for tli in (0, 1):
        spec = MoASpec(tli=tli, steps=60, batch=8, seq_len=48, lr=3e-3, warmup=5)
        log = train_moa(case.target, data, spec, tmp_path / f"tli{tli}", progress=False)
        assert log["last"]["top1"] > 0.5 and log["last"]["kl"] < 1.0
        drafter = make_drafter(case.target, "moa", tmp_path / f"tli{tli}", DynamicTreeConfig(16, 3, 4))
        assert drafter.step.draft.tli == tli
        results = SpeculativeGenerator(case.target, drafter).generate(case.prompts[:4], NEW_TOKENS)
        assert [r.tokens for r in results] == case.references[:4]
        tau = sum(r.stats.acceptance_length for r in results) / 4
        assert tau > 1.8, f"a trained MoA draft (TLI={tli}) should be accepted; tau={tau:.2f}"


def test_engine_export_with_a_stated_reason_for_server_backends(predictable_case, tmp_path):
    from specdec_kit.export.builder import build_engine
    from specdec_kit.export.inputs import BuildError, BuildInputs
    from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_to_dict
    from specdec_kit.runtime.engine import open_engine

    case = predictable_case
    case.hf.save_pretrained(tmp_path / "target")
    from specdec_kit.runtime.demo import write_char_tokenizer

    write_char_tokenizer(tmp_path / "target")
    save_draft(random_moa(case.target, tli=1), tmp_path / "moa", "moa", safetensors=True)
    inputs = dict(
        draft="moa",
        target=tmp_path / "target",
        draft_path=tmp_path / "moa",
        tokenizer=tmp_path / "target",
        dtype="float32",
        tree=tree_to_dict(DynamicTreeConfig(12, 3, 3)),
    )
    engine = open_engine(build_engine(BuildInputs(backend="torch", **inputs), tmp_path / "engine").path)
    assert engine.draft_kind == "moa" and engine.manifest["draft"]["moa_tli"] == 1
    res = engine.generator().generate(case.prompts[:2], 24)
    plain = engine.generator(speculative=False).generate(case.prompts[:2], 24)
    assert [r.tokens for r in res] == [r.tokens for r in plain]
    for backend in ("tensorrt-llm", "sglang"):
        with pytest.raises(BuildError, match="onnxruntime or torch. TensorRT-LLM and SGLang would need"):
            build_engine(BuildInputs(backend=backend, **inputs), tmp_path / backend)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["oracle-tli-L", "random-tli0"])
def test_onnx_engine_drafts_exactly_what_pytorch_drafts(predictable_case, tmp_path, which):
    """The MoA graphs (LSA memory, draft step, target tail or LM head) on ONNX Runtime: same tokens and the
    same accepted drafts as the PyTorch drafter; the TLI = L oracle must still be accepted in full."""
    from specdec_kit.export.builder import build_engine
    from specdec_kit.export.inputs import BuildInputs
    from specdec_kit.runtime.core.trees import tree_to_dict
    from specdec_kit.runtime.demo import write_char_tokenizer
    from specdec_kit.runtime.engine import open_engine

    case = predictable_case
    case.hf.save_pretrained(tmp_path / "target")
    write_char_tokenizer(tmp_path / "target")
    draft = oracle_moa(case.target) if which == "oracle-tli-L" else random_moa(case.target, tli=0)
    save_draft(draft, tmp_path / "moa", "moa", safetensors=True)
    tree = StaticTree.from_choices(EAGLE1_DEFAULT)
    inputs = BuildInputs(
        draft="moa",
        target=tmp_path / "target",
        draft_path=tmp_path / "moa",
        tokenizer=tmp_path / "target",
        backend="onnxruntime",
        dtype="float32",
        tree=tree_to_dict(tree),
    )
    engine = open_engine(build_engine(inputs, tmp_path / "engine").path)
    assert {"moa_memory", "moa_step"} <= set(engine.manifest["artifacts"])
    got = engine.generator().generate(case.prompts[:4], 32)
    ref = SpeculativeGenerator(
        case.target, MoATreeDrafter(TorchMoAStep(draft, case.target), tree), eos_token_ids=engine.target.eos_token_ids()
    ).generate(case.prompts[:4], 32)
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert [r.stats.accepted_per_depth for r in got] == [r.stats.accepted_per_depth for r in ref]
    if which == "oracle-tli-L":
        assert all(r.stats.accepted_per_depth[-1] >= r.stats.cycles - 1 for r in got)
