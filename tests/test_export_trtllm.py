"""TensorRT-LLM's legacy engine route (``--trtllm-legacy-engine``, releases <= 1.2), checked without TensorRT-LLM:
shards reassemble to the original weights, names and shapes follow the documented checkpoint layout, configs
parse, trees obey the engine's limits. The default PyTorch-backend export: tests/test_trtllm_interface.py."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import left_in
from safetensors.torch import load_file

from specdec_kit.export import trtllm_export as trt
from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.core.choices import EAGLE1_DEFAULT, MC_SIM_7B_63
from specdec_kit.runtime.core.manifest import read_manifest
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree, parse_tree_spec, tree_to_dict
from specdec_kit.runtime.synthetic import tiny_hf_model


def build(paths, kind, tree, tmp, tp=1, pp=1):
    inputs = BuildInputs(
        draft=kind,
        target=paths["target"],
        draft_path=paths[kind],
        tokenizer=paths["target"],
        backend="tensorrt-llm",
        dtype="float32",
        tree=tree_to_dict(tree),
        tp=tp,
        pp=pp,
        trtllm_legacy_engine="1.2.1",
    )
    return build_engine(inputs, tmp / f"{kind}-tp{tp}-pp{pp}")


def reassemble_qkv(shards: list[torch.Tensor], q_rows: int, kv_rows: int, tp: int):
    q, k, v = [], [], []
    for s in shards:
        q.append(s[: q_rows // tp])
        k.append(s[q_rows // tp : q_rows // tp + kv_rows])
        v.append(s[q_rows // tp + kv_rows :])
    return torch.cat(q), torch.cat(k), torch.cat(v)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_target_shards_reassemble_to_the_original_weights(tp):
    hf = tiny_hf_model(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=101, seed=3)
    state = hf.state_dict()
    cfg = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16}
    shards = [trt.convert_target(state, cfg, tp, 1, r) for r in range(tp)]
    kv_rows_per_rank = max(2 // tp, 1) * 16  # KV heads are duplicated when TP exceeds them
    for layer in range(2):
        p, h = f"transformer.layers.{layer}.", f"model.layers.{layer}."
        q, k, v = reassemble_qkv([s[p + "attention.qkv.weight"] for s in shards], 64, kv_rows_per_rank, tp)
        assert torch.equal(q, state[h + "self_attn.q_proj.weight"])
        if tp <= 2:
            assert torch.equal(k, state[h + "self_attn.k_proj.weight"]) and torch.equal(
                v, state[h + "self_attn.v_proj.weight"]
            )
        else:  # each KV head serves tp / kv_heads ranks
            dup = trt.dup_kv(state[h + "self_attn.k_proj.weight"], 2, 16, tp)
            assert torch.equal(k, dup)
            assert torch.equal(dup[16:32], state[h + "self_attn.k_proj.weight"][:16])  # head 0 repeated
        assert torch.equal(
            torch.cat([s[p + "attention.dense.weight"] for s in shards], 1), state[h + "self_attn.o_proj.weight"]
        )
        assert torch.equal(torch.cat([s[p + "mlp.fc.weight"] for s in shards]), state[h + "mlp.gate_proj.weight"])
        assert torch.equal(torch.cat([s[p + "mlp.gate.weight"] for s in shards]), state[h + "mlp.up_proj.weight"])
        assert torch.equal(torch.cat([s[p + "mlp.proj.weight"] for s in shards], 1), state[h + "mlp.down_proj.weight"])
        assert all(
            torch.equal(s[p + "post_layernorm.weight"], state[h + "post_attention_layernorm.weight"]) for s in shards
        )
    head = torch.cat([s["lm_head.weight"] for s in shards])
    assert head.shape[0] % tp == 0 and torch.equal(head[:101], state["lm_head.weight"])
    assert not head[101:].any()  # vocabulary padded to a multiple of TP with zero rows
    assert all(torch.equal(s["transformer.vocab_embedding.weight"], state["model.embed_tokens.weight"]) for s in shards)


def test_pipeline_parallel_splits_layers_and_places_embedding_and_head(demo_checkpoints, tmp_path):
    result = build(demo_checkpoints, "medusa", parse_tree_spec("static:mc_sim_7b_63:20"), tmp_path, tp=1, pp=2)
    ckpt = result.path / "trtllm" / "checkpoint"
    first, last = load_file(str(ckpt / "rank0.safetensors")), load_file(str(ckpt / "rank1.safetensors"))
    assert "transformer.vocab_embedding.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "transformer.ln_f.weight" in last and "medusa_heads.0.lm_head.weight" in last
    assert {k for k in first if k.startswith("transformer.layers.")} == {
        k for k in last if k.startswith("transformer.layers.")
    }
    assert json.loads((ckpt / "config.json").read_text())["mapping"] == {"world_size": 2, "tp_size": 1, "pp_size": 2}


def test_eagle_checkpoint_names_shapes_and_config(demo_checkpoints, tmp_path):
    tree = StaticTree.from_choices(EAGLE1_DEFAULT)
    result = build(demo_checkpoints, "eagle", tree, tmp_path, tp=2)
    ckpt = result.path / "trtllm" / "checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert (
        config["architecture"] == "EagleForCausalLM"
        and config["eagle_net_config"]["architecture"] == "LlamaForCausalLM"
    )
    assert config["num_eagle_layers"] == max(len(c) for c in EAGLE1_DEFAULT)
    assert config["max_draft_len"] == len(EAGLE1_DEFAULT)
    assert config["max_non_leaves_per_layer"] == max(trt.non_leaves_per_level(EAGLE1_DEFAULT))
    assert config["mapping"]["tp_size"] == 2 and config["dtype"] == "float32"
    draft = load_draft(demo_checkpoints["eagle"], "eagle", 64, config["vocab_size"]).state_dict()
    ranks = [load_file(str(ckpt / f"rank{r}.safetensors")) for r in range(2)]
    assert set(ranks[0]) == set(ranks[1])
    for i in range(config["num_eagle_layers"]):
        p = f"eagle_nets.{i}."
        assert torch.equal(torch.cat([r[p + "drafter.fc.weight"] for r in ranks]), draft["fc.weight"])
        assert torch.equal(torch.cat([r[p + "drafter.fc.bias"] for r in ranks]), draft["fc.bias"])
        assert torch.equal(
            torch.cat([r[p + "drafter.layers.0.mlp.fc.weight"] for r in ranks]), draft["layers.0.mlp.gate_proj.weight"]
        )
        net = config["eagle_net_config"]
        qkv_rows = (net["num_attention_heads"] + 2 * net["num_key_value_heads"]) * net["head_size"] // 2
        assert ranks[0][p + "drafter.layers.0.attention.qkv.weight"].shape == (qkv_rows, 64)
        assert ranks[0][p + "lm_head.weight"].shape[1] == 64
        assert (p + "drafter.layers.0.input_layernorm.weight") not in ranks[0]  # EAGLE's layer 0 has no input norm
    serve = yaml.safe_load((result.path / "trtllm" / "serve.yaml").read_text())
    assert serve["speculative_config"]["decoding_type"] == "Eagle"
    assert serve["speculative_config"]["eagle_choices"] == [list(c) for c in tree.choices]
    build_sh = (result.path / "trtllm" / "build.sh").read_text()
    assert (
        "trtllm-build --checkpoint_dir trtllm/checkpoint" in build_sh
        and "--speculative_decoding_mode eagle" in build_sh
    )
    m = read_manifest(result.path)
    assert m["tensorrt_llm"]["engine_built"] is False  # no TensorRT-LLM on this machine: commands only


def test_eagle2_dynamic_tree_settings(demo_checkpoints, tmp_path):
    result = build(demo_checkpoints, "hass", DynamicTreeConfig(total_tokens=60, depth=5, top_k=10), tmp_path)
    config = json.loads((result.path / "trtllm" / "checkpoint" / "config.json").read_text())
    assert (config["max_draft_len"], config["num_eagle_layers"], config["max_non_leaves_per_layer"]) == (59, 6, 10)
    spec = yaml.safe_load((result.path / "trtllm" / "serve.yaml").read_text())["speculative_config"]
    assert spec["use_dynamic_tree"] is True and spec["dynamic_tree_max_topK"] == 10 and "eagle_choices" not in spec


def test_medusa_checkpoint_and_choices(demo_checkpoints, tmp_path):
    tree = parse_tree_spec("static:mc_sim_7b_63")
    result = build(demo_checkpoints, "medusa", tree, tmp_path, tp=2)
    ckpt = result.path / "trtllm" / "checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architecture"] == "MedusaForCausalLM" and config["num_medusa_heads"] == 4
    assert config["max_draft_len"] == len(MC_SIM_7B_63) == 63
    heads = torch.load(demo_checkpoints["medusa"] / "medusa_lm_head.pt")
    ranks = [load_file(str(ckpt / f"rank{r}.safetensors")) for r in range(2)]
    for h in range(4):
        w = torch.cat([r[f"medusa_heads.{h}.medusa_layers.0.linear.weight"] for r in ranks])
        assert torch.equal(w, heads[f"{h}.0.linear.weight"])
        lm = torch.cat([r[f"medusa_heads.{h}.lm_head.weight"] for r in ranks])
        assert torch.equal(lm[: heads[f"{h}.1.weight"].shape[0]], heads[f"{h}.1.weight"])
    spec = yaml.safe_load((result.path / "trtllm" / "serve.yaml").read_text())["speculative_config"]
    assert spec["decoding_type"] == "Medusa" and spec["medusa_choices"] == [list(c) for c in tree.choices]


def test_tree_constraints_are_enforced():
    ok = trt.tree_settings(StaticTree.from_choices(EAGLE1_DEFAULT))
    trt.check_tree(ok)
    with pytest.raises(trt.TrtllmExportError, match="deepest choice path has depth 5, num_eagle_layers = 3"):
        trt.check_tree({**ok, "num_eagle_layers": 3})
    with pytest.raises(trt.TrtllmExportError, match="non-leaf nodes at depth"):
        trt.check_tree({**ok, "max_non_leaves_per_layer": 1})
    with pytest.raises(trt.TrtllmExportError, match="max_draft_len = 300"):
        trt.check_tree({**ok, "max_draft_len": 300})
    dyn = trt.tree_settings(DynamicTreeConfig(total_tokens=20, depth=2, top_k=3))
    trt.check_tree(dyn)
    with pytest.raises(trt.TrtllmExportError, match="exceeds the 21 nodes EAGLE-2 produces"):
        trt.check_tree({**dyn, "max_draft_len": 22})


def test_unsupported_combinations_are_refused(demo_checkpoints, tmp_path):
    with pytest.raises(BuildError, match="pp_size 1"):
        build(demo_checkpoints, "hass", DynamicTreeConfig(10, 2, 3), tmp_path, pp=2)
    with pytest.raises(BuildError, match="exceeds the 4 Medusa heads"):
        build(demo_checkpoints, "medusa", parse_tree_spec("static:chain-5"), tmp_path)
    assert left_in(tmp_path) == []
