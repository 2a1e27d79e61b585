"""vLLM export (no vLLM needed): the engine directory's layout, the chain the tree maps to, the plugin's entry
point and weight table, and the refusals. The vLLM tier (tests/test_vllm_engine.py) runs these engines in vLLM."""

from __future__ import annotations

import json
import shlex
import sys
from importlib.metadata import distributions
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.export.servers.vllm import PLUGIN, PLUGIN_SOURCE, chain_length
from specdec_kit.export.weight_maps import fused_draft_weight_map
from specdec_kit.paths import default_zoo
from specdec_kit.runtime.core.manifest import read_manifest
from specdec_kit.runtime.core.trees import DynamicTreeConfig, parse_tree_spec, tree_to_dict

sys.path.insert(0, str(PLUGIN_SOURCE.parent))  # the plugin's vLLM-free modules import without vLLM
from specdec_vllm import cpu_sampling_fixes  # noqa: E402
from specdec_vllm.weights import parameter_for  # noqa: E402


def build(paths, kind, tmp: Path, tree=DynamicTreeConfig(12, 3, 3), draft_path=None, **options):
    inputs = BuildInputs(
        draft=kind,
        target=paths["target"],
        draft_path=draft_path or paths[kind],
        tokenizer=paths["target"],
        backend="vllm",
        dtype="float32",
        tree=tree_to_dict(tree),
        **options,
    )
    return build_engine(inputs, tmp / f"{kind}-vllm")


@pytest.mark.parametrize(
    "kind,architecture",
    [
        ("griffin", "EagleSpecdecGriffinForCausalLM"),
        ("eagle2", "EagleSpecdecLlamaForCausalLM"),
        ("hass", "EagleSpecdecLlamaForCausalLM"),
    ],
)
def test_engine_layout_and_chain(demo_checkpoints, tmp_path, kind, architecture):
    result = build(demo_checkpoints, kind, tmp_path)
    engine = result.path
    manifest = read_manifest(engine)
    assert manifest["backend"] == "vllm" and manifest["vllm"]["architecture"] == architecture
    config = json.loads((engine / "vllm" / "draft" / "config.json").read_text())
    assert config["architectures"] == [architecture] and "bias" not in config  # vLLM reads `bias` as attention bias
    assert config["specdec_fc_bias"] is True
    spec = manifest["vllm"]["speculative_config"]
    assert spec == {"method": "eagle", "model": "vllm/draft", "num_speculative_tokens": 4}  # depth 3 -> 4 tokens
    serve = (engine / "vllm" / "serve.sh").read_text()
    command = shlex.split(serve.splitlines()[-1])
    assert command[command.index("--speculative-config") + 1] == json.dumps(spec, separators=(",", ":"))
    assert "PYTHONPATH=vllm/plugin" in serve and "-m specdec_vllm.serve target" in serve
    assert any("num_speculative_tokens=4" in note for note in manifest["serve"]["notes"])
    # the plugin's entry point is visible to importlib.metadata from the engine's plugin directory
    found = [d for d in distributions(path=[str(engine / "vllm" / "plugin")]) if d.metadata["Name"] == PLUGIN]
    assert [(e.group, e.value) for e in found[0].entry_points] == [("vllm.general_plugins", f"{PLUGIN}:register")]
    # every tensor of the exported draft lands where the exporter's weight map says, in the plugin too
    saved = load_file(str(engine / "vllm" / "draft" / "model.safetensors"))
    expected = fused_draft_weight_map(saved, kind)
    assert {key: parameter_for(key) for key in saved} == expected


def test_tree_shapes_map_to_their_longest_path():
    assert chain_length(DynamicTreeConfig(60, 5, 10)) == 6
    assert chain_length(parse_tree_spec("static:chain-3")) == 3
    assert chain_length(parse_tree_spec("static:eagle1_default")) == 5


@pytest.mark.parametrize("kind,reason", [("medusa", "top-1 only"), ("moa", "per-layer KV cache")])
def test_drafts_vllm_cannot_run_are_refused_with_the_reason(demo_checkpoints, tmp_path, kind, reason):
    tree = parse_tree_spec("static:mc_sim_7b_63:12") if kind == "medusa" else DynamicTreeConfig(12, 3, 3)
    head = demo_checkpoints.get(kind) or default_zoo() / kind  # refused before the head is loaded
    with pytest.raises(BuildError, match=reason):
        build(demo_checkpoints, kind, tmp_path, tree, draft_path=head)
    assert not (tmp_path / f"{kind}-vllm").exists()


def test_a_speculators_format_engine_holds_the_speculators_head_and_the_same_chain(tmp_path):
    """``--draft-format speculators``: the draft is the speculators export of the head (config and weights as
    ``export/speculators.py`` writes them for the engine's target), the speculative config is the official engine's,
    and the format is part of the engine's identity."""
    from specdec_kit.export.speculators import speculators_config

    zoo = default_zoo()
    paths = {"target": zoo / "target", "dflash": zoo / "dflash"}
    tree = parse_tree_spec("dynamic:4:2:1")
    official = build(paths, "dflash", tmp_path / "official", tree).path
    result = build(paths, "dflash", tmp_path / "speculators", tree, draft_format="speculators")
    manifest, before = read_manifest(result.path), read_manifest(official)
    assert manifest["vllm"]["speculative_config"] == before["vllm"]["speculative_config"]
    assert manifest["vllm"]["draft_format"] == "speculators" and before["vllm"]["draft_format"] == "official"
    assert manifest["inputs"]["sha256"] != before["inputs"]["sha256"]
    draft = result.path / "vllm" / "draft"
    config = json.loads((draft / "config.json").read_text())
    official_config = json.loads((official / "vllm" / "draft" / "config.json").read_text())
    assert config == speculators_config(official_config, 3, "target", "LlamaForCausalLM")
    written, source = (load_file(str(p / "model.safetensors")) for p in (draft, official / "vllm" / "draft"))
    assert written.keys() == source.keys() and all(torch.equal(written[k], source[k]) for k in source)


@pytest.mark.parametrize(
    "kind, backend, message",
    [
        ("griffin", "vllm", "vLLM reads eagle3, peagle, dflash drafts in the speculators format, not griffin"),
        ("dflash", "onnxruntime", "--backend onnxruntime reads the official layout"),
    ],
)
def test_a_speculators_format_vllm_cannot_read_is_refused(tmp_path, kind, backend, message):
    zoo = default_zoo()
    inputs = BuildInputs(
        draft=kind,
        target=zoo / "target",
        draft_path=zoo / kind,
        tokenizer=zoo / "target",
        backend=backend,
        dtype="float32",
        tree=tree_to_dict(DynamicTreeConfig(4, 2, 1)),
        draft_format="speculators",
    )
    with pytest.raises(BuildError, match=message):
        build_engine(inputs, tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def test_a_head_with_a_tensor_the_engine_would_drop_is_refused(demo_checkpoints, tmp_path):
    """A checkpoint tensor with no place in the plugin's model must stop the export, not vanish in vLLM."""
    import shutil

    import torch

    head = tmp_path / "eagle2-extra"
    shutil.copytree(demo_checkpoints["eagle2"], head)
    weights = next(p for p in head.iterdir() if p.suffix in (".bin", ".safetensors"))
    if weights.suffix == ".bin":
        state = torch.load(weights, weights_only=True)
        state["fc.extra_scale"] = torch.ones(1)
        torch.save(state, weights)
    else:
        from safetensors.torch import save_file

        state = load_file(str(weights))
        state["fc.extra_scale"] = torch.ones(1)
        save_file(state, str(weights))
    with pytest.raises(Exception, match="extra_scale"):
        build(demo_checkpoints, "eagle2", tmp_path, draft_path=head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_the_expand_mend_spreads_each_request_value_over_its_tokens(dtype):
    """The kernel's contract: request r's value (``replace_from`` -> ``replace_to``) on each of its tokens."""
    output = torch.full((7,), 99, dtype=dtype)
    values = torch.tensor([3, 0, 5, 8], dtype=dtype)
    cu_num_tokens = torch.tensor([2, 5, 5, 6], dtype=torch.int32)  # the third request has no draft tokens
    cpu_sampling_fixes.expand_to_tokens(output, values, cu_num_tokens, 0, 1)
    assert output.tolist() == [3, 3, 1, 1, 1, 8, 99]  # the buffer's tail beyond the tokens is left alone


def test_the_mends_are_applied_only_where_the_defects_show():
    def writes_a_converted_copy(output, values, cu, replace_from, replace_to):  # the defect: output never written
        cpu_sampling_fixes.expand_to_tokens(
            output.to(torch.int64), values.to(torch.int64), cu, replace_from, replace_to
        )

    assert cpu_sampling_fixes.expand_is_broken(writes_a_converted_copy)
    assert not cpu_sampling_fixes.expand_is_broken(cpu_sampling_fixes.expand_to_tokens)

    def top_k(logits, k, p):
        return logits.masked_fill(logits < logits.topk(int(k.max()), dim=-1).values[:, -1:], float("-inf"))

    assert cpu_sampling_fixes.top_k_fails_on_no_rows(top_k)
    mended = cpu_sampling_fixes.passing_no_rows_through(top_k)
    assert not cpu_sampling_fixes.top_k_fails_on_no_rows(mended)
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert torch.equal(mended(logits, torch.tensor([2]), None), top_k(logits, torch.tensor([2]), None))


def test_serving_a_vllm_engine_without_vllm_says_so(demo_checkpoints, tmp_path, monkeypatch, capsys):
    """``specdec-serve`` on a vLLM engine with an interpreter that lacks vLLM names what is missing and how to
    point at it, instead of the engine folder's ``vllm/`` shadowing the package."""
    from specdec_kit.serving.cli import main

    engine = build(demo_checkpoints, "griffin", tmp_path).path
    monkeypatch.setenv("SPECDEC_VLLM_PYTHON", sys.executable)  # the kit's own interpreter: no vLLM in it
    assert main(["--engine", str(engine)]) == 2
    err = capsys.readouterr().err
    assert f"vLLM is not installed for {sys.executable}" in err and "SPECDEC_VLLM_PYTHON" in err


@pytest.mark.parametrize("backend", ["vllm", "sglang", "tensorrt-llm"])
def test_server_exports_keep_a_half_precision_checkpoints_dtype_wherever_built(backend, tmp_path):
    """`--dtype checkpoint` on a CPU build node (the chart's build Job for GPU serving): a bfloat16 checkpoint stays
    bfloat16 (float32 would double a 70B target's memory and never serve on the GPUs), a float32 one gets float16."""
    from specdec_kit.export.cli import resolve_dtype_name

    cpu = torch.device("cpu")
    half, full = tmp_path / "half", tmp_path / "full"
    for folder, saved in ((half, "bfloat16"), (full, "float32")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"torch_dtype": saved}))
    assert resolve_dtype_name(backend, "checkpoint", cpu, half) == "bfloat16"
    assert resolve_dtype_name(backend, "checkpoint", cpu, full) == "float16"
    # auto: SGLang and TensorRT-LLM serve on GPUs only; a vLLM engine built on a CPU is for vLLM's CPU build
    assert resolve_dtype_name(backend, "auto", cpu, half) == ("float32" if backend == "vllm" else "bfloat16")
    assert resolve_dtype_name("onnxruntime", "auto", cpu, half) == "float32"  # a CPU engine computes in float32
    with pytest.raises(BuildError, match="ONNX Runtime engines are float32 or float16"):
        resolve_dtype_name("onnxruntime", "checkpoint", cpu, half)
