"""SGLang export: the weight map covers every parameter (SGLang skips unknown keys silently), the
exported weights rebuild the kit's GRIFFIN graph exactly, and the plugin registers under real SGLang (the SGLang
tier: SGLang 0.5.23 in .venv-sglang, made by scripts/setup_sglang.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_sglang_commands import sglang_verdicts

from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.export.weight_maps import (
    WeightMapError,
    check_coverage,
    fuse,
    fused_draft_parameters,
    fused_draft_weight_map,
    unfuse,
)
from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.core.manifest import read_manifest
from specdec_kit.runtime.core.trees import DynamicTreeConfig, parse_tree_spec, tree_to_dict
from specdec_kit.runtime.demo import CHARS
from specdec_kit.runtime.drafts.loading import strict_load

VOCAB = len(CHARS) + 1  # the demo checkpoints' character tokenizer


def build(paths, kind, tmp, tree=DynamicTreeConfig(20, 3, 4)):
    inputs = BuildInputs(
        draft=kind,
        target=paths["target"],
        draft_path=paths[kind],
        tokenizer=paths["target"],
        backend="sglang",
        dtype="float32",
        tree=tree_to_dict(tree),
    )
    return build_engine(inputs, tmp / f"{kind}-sglang")


@pytest.mark.parametrize("kind", ["griffin", "eagle"])
def test_weight_map_covers_every_parameter(demo_checkpoints, kind):
    module = load_draft(demo_checkpoints[kind], kind, 64, VOCAB)
    keys = list(module.state_dict())
    fc_bias = kind == "griffin" or module.fc.bias is not None
    params = fused_draft_parameters(kind, 1, fc_bias, qkv_bias=False)
    check_coverage(fused_draft_weight_map(keys, kind), keys, params, kind)
    with pytest.raises(WeightMapError, match="lacks shard"):  # drop v_proj: qkv_proj half filled
        dropped = [k for k in keys if "v_proj" not in k]
        check_coverage(fused_draft_weight_map(dropped, kind), dropped, params, kind)
    with pytest.raises(WeightMapError, match="is filled by no checkpoint key"):
        dropped = [k for k in keys if "post_attention_layernorm" not in k or k.startswith("fc.")]
        check_coverage(fused_draft_weight_map(dropped, kind), dropped, params, kind)
    with pytest.raises(WeightMapError, match="has no place in the engine"):
        fused_draft_weight_map(keys + ["medusa_head.0.0.linear.weight"], kind)


def test_exported_griffin_weights_rebuild_the_kit_graph(demo_checkpoints, tmp_path):
    result = build(demo_checkpoints, "griffin", tmp_path)
    draft_dir = result.path / "sglang" / "draft"
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == ["GriffinLlamaForCausalLM"]
    saved = load_file(str(draft_dir / "model.safetensors"))
    weight_map = {k: tuple(v) for k, v in json.loads((draft_dir / "weight_map.json").read_text()).items()}
    engine_params = fuse(saved, weight_map)  # what SGLang's loader assembles at TP = 1
    assert engine_params["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == 64 + 2 * 32
    original = load_draft(demo_checkpoints["griffin"], "griffin", 64, config["vocab_size"])
    rebuilt = load_draft(demo_checkpoints["griffin"], "griffin", 64, config["vocab_size"])
    torch.nn.init.zeros_(rebuilt.fc.fc.weight)
    strict_load(rebuilt, unfuse(engine_params, weight_map, (64, 32, 32)), draft_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    feats, toks = torch.randn(2, 4, 64, generator=gen), torch.randint(0, VOCAB, (2, 4), generator=gen)
    ar = torch.arange(4)
    mask = (ar[None, :] <= ar[:, None]).expand(2, 4, 4)
    outs = [m.step(feats, toks, ar.expand(2, 4), mask, m.new_cache(2, 8)) for m in (original, rebuilt)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    serve = (result.path / "sglang" / "serve.sh").read_text()
    for flag in (
        "--speculative-algorithm EAGLE",
        "--speculative-num-steps 4",
        "--speculative-eagle-topk 4",
        "--speculative-num-draft-tokens 20",
        "SGLANG_EXTERNAL_MODEL_PACKAGE=specdec_griffin_sglang",
    ):
        assert flag in serve
    assert (result.path / "sglang" / "plugin" / "specdec_griffin_sglang" / "griffin_llama.py").is_file()
    assert read_manifest(result.path)["sglang"]["weight_map_checked"] is True


def test_eagle_export_uses_sglangs_builtin_class(demo_checkpoints, tmp_path):
    result = build(demo_checkpoints, "hass", tmp_path)
    config = json.loads((result.path / "sglang" / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert "SGLANG_EXTERNAL_MODEL_PACKAGE" not in (result.path / "sglang" / "serve.sh").read_text()


def test_sglang_refuses_what_it_cannot_run(demo_checkpoints, tmp_path):
    with pytest.raises(BuildError, match="SGLang has no Medusa decoding"):
        build(demo_checkpoints, "medusa", tmp_path, tree=parse_tree_spec("static:mc_sim_7b_63:8"))
    with pytest.raises(BuildError, match="dynamic trees only"):
        build(demo_checkpoints, "griffin", tmp_path, tree=parse_tree_spec("static:eagle1_default"))


@pytest.mark.sglang
def test_plugin_registers_under_real_sglang(demo_checkpoints, tmp_path):
    result = build(demo_checkpoints, "griffin", tmp_path)
    (verdict,) = sglang_verdicts(
        [
            {
                "resolve": ["GriffinLlamaForCausalLM"],
                "package": "specdec_griffin_sglang",
                "pythonpath": [str(result.path / "sglang" / "plugin"), str(Path(__file__).resolve().parents[1])],
            }
        ]
    )
    assert verdict == {
        "ok": True,
        "module": "specdec_griffin_sglang.griffin_llama",
        "class": "GriffinLlamaForCausalLM",
        "architecture": "GriffinLlamaForCausalLM",
    }, verdict
