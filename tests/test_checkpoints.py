"""Official checkpoint layouts load strictly; drafts that do not fit are refused with precise errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdec_kit.runtime.checkpoint import load_draft, save_draft
from specdec_kit.runtime.drafts import DraftLoadError, EagleDraft, MedusaHeads
from specdec_kit.runtime.synthetic import draft_config, random_eagle, random_griffin, random_medusa, tiny_target

GRIFFIN_KEYS = {  # the official GRIFFIN layout: 15 tensors for one layer
    "embed_tokens.weight",
    "fc.fc.weight",
    "fc.fc.bias",
    "fc.post_attention_layernorm.weight",
    "fc.mlp.input_layernorm.weight",
    "fc.mlp.up_proj.weight",
    "fc.mlp.down_proj.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}


@pytest.fixture(scope="module")
def target():
    return tiny_target(hidden_size=32, layers=1, heads=4, kv_heads=2, intermediate=48, vocab=50)


def outputs_equal(a, b, target):
    torch.manual_seed(0)
    if isinstance(a, MedusaHeads):
        x = torch.randn(3, target.hidden_size)
        return torch.equal(a(x), b(x))
    feats, toks = torch.randn(2, 5, target.hidden_size), torch.randint(0, target.vocab_size, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool)).expand(2, 5, 5)
    out_a = a.step(feats, toks, pos, mask, a.new_cache(2, 8))
    out_b = b.step(feats, toks, pos, mask, b.new_cache(2, 8))
    return all(torch.equal(x, y) for x, y in zip(out_a, out_b))


def test_griffin_keys_and_shapes_follow_the_reference(target):
    draft = random_griffin(target)
    state = draft.state_dict()
    assert set(state) == GRIFFIN_KEYS
    d, inter = target.hidden_size, target.config.intermediate_size
    assert state["fc.fc.weight"].shape == (d, 2 * d)
    assert state["fc.mlp.up_proj.weight"].shape == (inter, 2 * d)
    assert state["fc.mlp.down_proj.weight"].shape == (d, inter)
    assert state["layers.0.mlp.down_proj.weight"].shape == (2 * d, inter)  # TEH: widened


def test_eagle_keys_follow_the_reference(target):
    keys = set(EagleDraft(draft_config(target), fc_bias=False).state_dict())
    assert "fc.bias" not in keys and "fc.weight" in keys and "layers.0.input_layernorm.weight" not in keys
    cfg = draft_config(target)
    cfg.num_hidden_layers = 2
    keys2 = set(EagleDraft(cfg, qkv_bias=True).state_dict())
    assert {"layers.1.input_layernorm.weight", "layers.0.self_attn.q_proj.bias", "fc.bias"} <= keys2


@pytest.mark.parametrize(
    "kind,safetensors",
    [
        ("griffin", False),
        ("griffin", True),
        ("eagle", False),
        ("eagle2", True),
        ("hass", False),
        ("medusa", False),
        ("medusa", True),
    ],
)
def test_official_layouts_round_trip(tmp_path, target, kind, safetensors):
    if kind == "griffin":
        draft = random_griffin(target)
    elif kind == "medusa":
        draft = random_medusa(target, heads=3, layers=2)
    else:
        draft = random_eagle(target)
    file = save_draft(draft, tmp_path, kind, safetensors=safetensors)
    expected_name = {("medusa", False): "medusa_lm_head.pt", ("medusa", True): "medusa_lm_head.safetensors"}.get(
        (kind, safetensors), "model.safetensors" if safetensors else "pytorch_model.bin"
    )
    assert file.name == expected_name
    if kind == "medusa":  # legacy layout: keys without the medusa_head. prefix
        state = torch.load(file, weights_only=True) if not safetensors else None
        if state is not None:
            assert all(not k.startswith("medusa_head.") for k in state) and "0.0.linear.weight" in state
    loaded = load_draft(tmp_path, kind, target.hidden_size, target.vocab_size)
    assert outputs_equal(draft, loaded, target)


def test_eagle_without_fc_bias_and_with_qkv_bias(tmp_path, target):
    torch.manual_seed(0)
    draft = EagleDraft(draft_config(target), fc_bias=False, qkv_bias=True)
    save_draft(draft, tmp_path, "eagle")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["bias"] is False and cfg["qkv_bias"] is True
    assert outputs_equal(draft, load_draft(tmp_path, "eagle", 32, 50), target)


def test_medusa_full_model_layout(tmp_path, target):
    """A full HF model file with medusa_head.* keys beside the base weights (the newer Medusa layout)."""
    heads = random_medusa(target, heads=2, layers=1)
    state = {k: v.contiguous() for k, v in heads.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.zeros(50, 32)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "hidden_size": 32, "vocab_size": 50})
    )
    assert outputs_equal(heads, load_draft(tmp_path, "medusa", 32, 50), target)


def written(tmp_path: Path, target, kind="griffin") -> Path:
    save_draft(random_griffin(target) if kind == "griffin" else random_eagle(target), tmp_path, kind)
    return tmp_path


def expect_error(fragments, *args):
    with pytest.raises(DraftLoadError) as info:
        load_draft(*args)
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} not in {info.value}"


def test_hidden_size_mismatch(tmp_path, target):
    written(tmp_path, target)
    expect_error(["config.json", "hidden_size", "expected 64", "found 32"], tmp_path, "griffin", 64, 50)


def test_vocab_mismatch(tmp_path, target):
    written(tmp_path, target, "eagle")
    expect_error(["config.json", "vocab_size", "expected 51", "found 50"], tmp_path, "eagle", 32, 51)


def test_missing_key(tmp_path, target):
    written(tmp_path, target)
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    del state["fc.mlp.up_proj.weight"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    expect_error(["pytorch_model.bin", "'fc.mlp.up_proj.weight'", "missing", "[48, 64]"], tmp_path, "griffin", 32, 50)


def test_extra_key(tmp_path, target):
    written(tmp_path, target)
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    state["lm_head.weight"] = torch.zeros(50, 32)
    torch.save(state, tmp_path / "pytorch_model.bin")
    expect_error(["pytorch_model.bin", "unexpected key 'lm_head.weight'"], tmp_path, "griffin", 32, 50)


def test_wrong_shape(tmp_path, target):
    written(tmp_path, target)
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    state["layers.0.mlp.down_proj.weight"] = torch.zeros(32, 48)  # an EAGLE-shaped down_proj in a GRIFFIN file
    torch.save(state, tmp_path / "pytorch_model.bin")
    expect_error(
        ["pytorch_model.bin", "'layers.0.mlp.down_proj.weight'", "[32, 48]", "expected [64, 48]"],
        tmp_path,
        "griffin",
        32,
        50,
    )


def test_eagle_checkpoint_loaded_as_griffin(tmp_path, target):
    written(tmp_path, target, "eagle")
    expect_error(["pytorch_model.bin", "missing"], tmp_path, "griffin", 32, 50)


def test_missing_and_broken_files(tmp_path, target):
    expect_error(["does not exist"], tmp_path / "nope", "eagle", 32, 50)
    written(tmp_path, target)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    expect_error(["pytorch_model.bin", "cannot read weights"], tmp_path, "griffin", 32, 50)
    (tmp_path / "pytorch_model.bin").unlink()
    expect_error(["no weights file", "pytorch_model.bin", "model.safetensors"], tmp_path, "griffin", 32, 50)
    (tmp_path / "config.json").write_text("{broken")
    expect_error(["config.json", "not JSON"], tmp_path, "griffin", 32, 50)
    (tmp_path / "config.json").unlink()
    expect_error(["config.json", "missing"], tmp_path, "griffin", 32, 50)


def test_unknown_kind_and_missing_config_key(tmp_path, target):
    written(tmp_path, target)
    expect_error(["unknown draft kind 'eagle9'"], tmp_path, "eagle9", 32, 50)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expect_error(["config.json", "'intermediate_size'", "missing"], tmp_path, "griffin", 32, 50)


def test_pickle_code_is_never_executed(tmp_path, target):
    """weights-only loading: a pickle that would run code is refused, not executed."""
    written(tmp_path, target)

    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    torch.save({"x": Evil()}, tmp_path / "pytorch_model.bin")
    expect_error(["pytorch_model.bin", "cannot read weights"], tmp_path, "griffin", 32, 50)
    assert not (tmp_path / "pwned").exists()
