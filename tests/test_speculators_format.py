"""EAGLE-3 and P-EAGLE heads in the speculators format: vLLM's own config code (``SpeculatorsConfig``, in the vLLM tier's
interpreter) reads the written head as the same EAGLE-3 draft the official config describes, with the speculative
config the head names, and the weights are the head's under speculators' names; the kit reads such a head back as
the official one."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

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
}


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
    assert layer["architectures"] == [architecture] and layer["norm_before_residual"] is False
    if kind == "peagle":  # vLLM's proposer takes the mask token from pard_token
        assert layer["pard_token"] == official["mask_token_id"]
    assert layer["eagle_aux_hidden_state_layer_ids"] == official["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "draft_vocab_size",
        "rope_parameters",
    ):
        assert layer[key] == official[key], key
    written = load_file(str(tmp_path / "head" / "model.safetensors"))
    source = torch.load(zoo / kind / "pytorch_model.bin", weights_only=True)  # the zoo's official layout
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in source.items()}  # speculators' names
    assert written.keys() == renamed.keys() and all(torch.equal(written[k], renamed[k]) for k in renamed)


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_the_kit_reads_a_speculators_head_as_the_official_one(tmp_path, kind):
    """The other way: a speculators head loads into the kit (its config and layer names read as the official
    ones; P-EAGLE's mask_hidden in speculators' [1, 1, 3 d] shape) and drafts exactly what the official head drafts;
    a head with the other norm order is refused."""
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
    assert (
        official.feature_layers == converted.feature_layers and official.draft_vocab_size == converted.draft_vocab_size
    )
    if kind == "peagle":
        assert (converted.mask_token_id, converted.parallel_tokens) == (
            official.mask_token_id,
            official.parallel_tokens,
        )
    for (name, a), (_, b) in zip(official.state_dict().items(), converted.state_dict().items()):
        assert torch.equal(a, b), name
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    with pytest.raises(DraftLoadError, match="norm_before_residual is True"):
        load_draft(tmp_path / "head", kind, 192, 2048, target_shape=shape)


def test_a_head_that_is_not_eagle3_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not an EAGLE-3 head's config"):
        speculators_config({"hidden_size": 8}, 3, "t", "LlamaForCausalLM")
    assert main([str(default_zoo() / "griffin"), str(tmp_path / "x"), "--target", str(default_zoo() / "target")]) == 2
    assert not (tmp_path / "x").exists()
