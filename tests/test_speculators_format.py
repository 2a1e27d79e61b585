"""EAGLE-3, P-EAGLE and DFlash heads in the speculators format: vLLM's own config code (``SpeculatorsConfig``, in the
vLLM tier's interpreter) reads the written head as the same draft the official config describes, with the
speculative config the head names, and the weights are the head's under speculators' names; the kit reads such a head
back as the official one; and speculators' own DFlash class (in the interchange tier's interpreter) loads the written
DFlash head with every tensor in place and computes the kit's block."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdec_kit.export.speculators import main, speculators_config
from specdec_kit.paths import default_zoo

VLLM_VIEW = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
config = json.load(open(sys.argv[1]))
print(json.dumps({
    "layer": SpeculatorsConfig.extract_transformers_pre_trained_config(config),
    "speculative": SpeculatorsConfig.extract_vllm_speculative_config(config),
}))
"""


# what vLLM makes of each kind's speculators head: its speculative config and its draft architecture
VLLM_READS = {
    "eagle3": ({"method": "eagle3", "num_speculative_tokens": 3}, "Eagle3LlamaForCausalLM"),
    "peagle": ({"method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}, "PeagleLlamaForCausalLM"),
    "dflash": ({"method": "dflash", "num_speculative_tokens": 3}, "DFlashDraftModel"),
}
LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "rope_parameters",
)


@pytest.mark.vllm
@pytest.mark.parametrize("kind", list(VLLM_READS))
def test_vllm_reads_a_speculators_head_as_the_official_draft(vllm_python, tmp_path, kind):
    zoo = default_zoo()
    assert main([str(zoo / kind), str(tmp_path / "head"), "--target", str(zoo / "target"), "--tokens", "3"]) == 0
    view = subprocess.run(
        [vllm_python, "-c", VLLM_VIEW, str(tmp_path / "head" / "config.json")],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=300,
    )
    assert view.returncode == 0, view.stderr[-3000:]
    read = json.loads(view.stdout.strip().splitlines()[-1])
    official = json.loads((zoo / kind / "config.json").read_text())
    speculative, architecture = VLLM_READS[kind]
    assert read["speculative"] == speculative
    layer = read["layer"]
    assert layer["architectures"] == [architecture]
    for key in LAYER_KEYS:
        assert layer[key] == official[key], key
    written = load_file(str(tmp_path / "head" / "model.safetensors"))
    source = torch.load(zoo / kind / "pytorch_model.bin", weights_only=True)  # the zoo's official layout
    if kind == "dflash":  # the official names are speculators' too; the layers are named as vLLM's DFlash reads them
        dflash = official["dflash_config"]
        assert layer["dflash_config"] == dict(dflash, sample_from_anchor=False, causal=False)
        assert layer["draft_vocab_size"] == official["vocab_size"]
        assert layer["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in dflash["target_layer_ids"]]
    else:
        assert layer["norm_before_residual"] is False and layer["draft_vocab_size"] == official["draft_vocab_size"]
        if kind == "peagle":  # vLLM's proposer takes the mask token from pard_token
            assert layer["pard_token"] == official["mask_token_id"]
        eagle = official["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert layer["eagle_aux_hidden_state_layer_ids"] == eagle
        source = {k.replace("midlayer.", "layers.0."): v for k, v in source.items()}  # speculators' names
    assert written.keys() == source.keys() and all(torch.equal(written[k], source[k]) for k in source)


# a change to a written head's config that makes it another model than the kit's, and what the refusal names
REFUSED = {
    "eagle3": ({"norm_before_residual": True}, "norm_before_residual is True"),
    "peagle": ({"norm_before_residual": True}, "norm_before_residual is True"),
    "dflash": ({"sample_from_anchor": True}, "sample_from_anchor is True; the kit runs plain DFlash"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_the_kit_reads_a_speculators_head_as_the_official_one(tmp_path, kind):
    """The other way: a speculators head loads into the kit (its config and layer names read as the official
    ones; P-EAGLE's mask_hidden in speculators' [1, 1, 3 d] shape; DFlash's tapped layers named as the layers they
    enter) with exactly the official head's weights; a head that computes something else (the other norm order,
    DFlash with a slot for the anchor's own token) is refused."""
    from safetensors.torch import save_file

    from specdec_kit.runtime.checkpoint import load_draft
    from specdec_kit.runtime.drafts.loading import DraftLoadError

    zoo = default_zoo()
    assert main([str(zoo / kind), str(tmp_path / "head"), "--target", str(zoo / "target")]) == 0
    if kind == "peagle":
        written = load_file(str(tmp_path / "head" / "model.safetensors"))
        save_file(dict(written, mask_hidden=written["mask_hidden"][None]), str(tmp_path / "head" / "model.safetensors"))
    shape = (20, 2048)  # the zoo target: 20 layers (its feature layers are checked against them), 2048 tokens
    official, converted = (load_draft(p, kind, 192, 2048, target_shape=shape) for p in (zoo / kind, tmp_path / "head"))
    assert official.feature_layers == converted.feature_layers
    assert getattr(official, "draft_vocab_size", None) == getattr(converted, "draft_vocab_size", None)
    if kind != "eagle3":
        assert (converted.mask_token_id, converted.parallel_tokens) == (
            official.mask_token_id,
            official.parallel_tokens,
        )
    assert list(official.state_dict()) == list(converted.state_dict())
    for (name, a), (_, b) in zip(official.state_dict().items(), converted.state_dict().items()):
        assert torch.equal(a, b), name
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    change, message = REFUSED[kind]
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(DraftLoadError, match=message):
        load_draft(tmp_path / "head", kind, 192, 2048, target_shape=shape)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"projector_type": "domino"}, "projector_type is 'domino'"),
        ({"shift_label": True}, "shift_label is True"),
        ({"draft_vocab_size": 1024}, r"key 'd2t' is missing \(expected shape \[1024\]\); 2 more"),  # and lm_head, t2d
        ({"aux_hidden_state_layer_ids": [0, 9]}, r"aux_hidden_state_layer_ids is \[0, 9\]"),
    ],
)
def test_a_speculators_dflash_head_the_kit_does_not_compute_is_refused_naming_the_key(tmp_path, change, message):
    from specdec_kit.runtime.checkpoint import load_draft
    from specdec_kit.runtime.drafts.loading import DraftLoadError

    zoo = default_zoo()
    assert main([str(zoo / "dflash"), str(tmp_path / "head"), "--target", str(zoo / "target")]) == 0
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(DraftLoadError, match=message):
        load_draft(tmp_path / "head", "dflash", 192, 2048, target_shape=(20, 2048))


def test_a_head_that_is_neither_eagle3_nor_dflash_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not an EAGLE-3 or DFlash head's config"):
        speculators_config({"hidden_size": 8}, 3, "t", "LlamaForCausalLM")
    assert main([str(default_zoo() / "griffin"), str(tmp_path / "x"), "--target", str(default_zoo() / "target")]) == 2
    assert not (tmp_path / "x").exists()


SPECULATORS_DFLASH = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash import DFlashSpeculatorConfig
from speculators.models.dflash.core import DFlashDraftModel
head, inputs, out = sys.argv[1:4]
config = DFlashSpeculatorConfig.from_pretrained(head)  # their pydantic config validates what the kit wrote
config.transformer_layer_config._attn_implementation = "eager"  # their dense float mask: no flex attention on a CPU
model, info = DFlashDraftModel.from_pretrained(head, config=config, output_loading_info=True)
model.load_verifier_weights()  # the embedding and LM head from the verifier, which from_pretrained skips with the info
model = model.float().eval()  # the head's float16 weights in float32, as the kit loads them
x = load_file(inputs)
ids, anchors = x["input_ids"], x["anchors"]
loss_mask = torch.zeros_like(ids)
loss_mask[0, anchors] = 1  # every valid position an anchor: their random choice takes them all
with torch.no_grad():
    _, logits, _, _, _ = model._backbone_forward(
        x["taps"], ids, loss_mask, torch.zeros(*ids.shape, model.hidden_size), torch.zeros_like(ids),
        max_anchors=len(anchors),
    )
loading = {k: sorted(v) for k, v in info.items() if k != "error_msgs"}
read = {"loading": json.dumps(loading), "layers": json.dumps(model.target_layer_ids), "block": str(model.block_size)}
save_file({"logits": logits[0].contiguous()}, out, metadata=read)
"""


@pytest.mark.interchange
@pytest.mark.parametrize("vocabulary", ["full", "reduced"])
def test_speculators_own_dflash_class_loads_the_head_and_computes_the_kits_block(
    interchange_python, tmp_path, vocabulary
):
    """speculators' ``DFlashDraftModel`` (0.9.0 from PyPI) reads the zoo's DFlash head as the kit writes it, also
    over a reduced draft vocabulary with its own LM head (speculators' default way to train one): its config class
    accepts the config, every tensor lands in one of its modules (none missing, none left over), and its anchored-block
    forward over the target's states gives, at each anchor, the kit's drafter's distributions of the block's masked
    slots (the context before the anchor, the anchor's token as the block's root) over the draft's vocabulary."""
    from specdec_kit.runtime.checkpoint import load_draft, save_draft
    from specdec_kit.runtime.core.trees import DynamicTreeConfig
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.runtime.registry import drafter_for
    from specdec_kit.runtime.synthetic import dflash_with_draft_vocab

    zoo = default_zoo()
    target = TargetModel.from_pretrained(zoo / "target", dtype=torch.float32)
    draft = load_draft(zoo / "dflash", "dflash", target.hidden_size, target.vocab_size, target_shape=(20, 0))
    official = zoo / "dflash"
    if vocabulary == "reduced":
        draft, official = dflash_with_draft_vocab(draft, target, 1536), tmp_path / "official"
        save_draft(draft, official, "dflash", safetensors=True)
    assert main([str(official), str(tmp_path / "head"), "--target", str((zoo / "target").resolve())]) == 0
    block = draft.block_size
    ids = torch.randint(0, target.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([3, 17, 30])  # the last anchor leaves a block's room before the end, as theirs must
    with torch.no_grad():
        hidden = target.hf_model(ids, output_hidden_states=True).hidden_states
        taps = torch.cat([hidden[i] for i in draft.feature_layers], dim=-1)  # the states entering those layers
        kit = []
        for a in anchors.tolist():
            drafter = drafter_for("dflash", draft, target, DynamicTreeConfig(block, block - 2, 1))
            drafter.reset(1, 64)
            kit.append(drafter.proposals(taps[:, :a], ids[:, 1 : a + 1], torch.tensor([a]))[0])
    save_file({"input_ids": ids, "anchors": anchors, "taps": taps.contiguous()}, str(tmp_path / "inputs.safetensors"))
    proc = subprocess.run(
        [
            str(interchange_python),
            "-c",
            SPECULATORS_DFLASH,
            str(tmp_path / "head"),
            str(tmp_path / "inputs.safetensors"),
            str(tmp_path / "theirs.safetensors"),
        ],
        capture_output=True,
        text=True,
        cwd="/",
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(str(tmp_path / "theirs.safetensors"), "pt") as f:
        read, logits = f.metadata(), f.get_tensor("logits")
    assert json.loads(read["loading"]) == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    # the layers their data generation taps (hidden states as transformers numbers them) are the kit's
    assert json.loads(read["layers"]) == list(draft.feature_layers) and int(read["block"]) == block
    theirs = torch.log_softmax(logits.view(len(anchors), block, -1)[:, 1:], dim=-1)
    assert logits.abs().max() > 1.0 and theirs.shape[-1] == draft.draft_vocab_size  # a trained head's logits
    kit = torch.stack(kit)[..., draft.target_ids(torch.arange(draft.draft_vocab_size))]  # in draft-id order
    torch.testing.assert_close(kit, theirs, atol=1e-4, rtol=1e-4)
