"""TensorRT-LLM's current interface (PyTorch backend, the only one after 1.2): every key the export writes exists
in the recorded ``llm_args.py`` with the type it declares and passes its validators' rules; the kit's drafter
package, run over a CPU stand-in for the TensorRT-LLM pieces it imports (``tests/trtllm_standin.py``), computes
the kit's GRIFFIN and EAGLE drafts on the same weights; the legacy engine route answers only to releases <= 1.2."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trtllm_standin
import yaml
from conftest import left_in
from safetensors.torch import load_file
from transformers import AutoConfig

from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.core.trees import DynamicTreeConfig, parse_tree_spec, tree_to_dict
from specdec_kit.runtime.models.target import TargetModel

SCHEMA = json.loads((Path(__file__).parent / "upstream" / "tensorrt_llm_llm_args.json").read_text())


def build(paths, kind, tree, tmp, legacy=None, tp=1, pp=1):
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
        trtllm_legacy_engine=legacy,
    )
    return build_engine(inputs, tmp / f"{kind}-{tree_to_dict(tree)['type']}-{legacy}")


def fields(cls: str) -> dict[str, dict]:
    """A recorded class's fields, its bases' included."""
    entry = SCHEMA["classes"][cls]
    own = {k: v for k, v in entry.items() if not k.startswith("_")}
    return {**(fields(entry["_base"]) if "_base" in entry else {}), **own}


def conforms(value, kit_type: str) -> bool:
    if kit_type.startswith("literal:"):
        return value == kit_type.split(":", 1)[1]
    if kit_type == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kit_type == "list[int]":
        return isinstance(value, list) and all(conforms(v, "int") for v in value)
    if kit_type == "list[list[int]]":
        return isinstance(value, list) and all(conforms(v, "list[int]") for v in value)
    return isinstance(value, {"bool": bool, "str": str, "float": (int, float), "dict": dict}[kit_type])


def conforms_to(section: dict, cls: str, where: Path) -> None:
    """Every key of ``section`` a field of the recorded class ``cls``, not deprecated, of its declared type."""
    declared = fields(cls)
    for key, value in section.items():
        assert key in declared, f"{where}: {cls} declares no field {key!r}"
        assert not declared[key].get("deprecated"), f"{where}: {key!r} is deprecated upstream"
        assert conforms(value, declared[key]["kit_type"]), f"{key}={value!r} is not {declared[key]['annotation']}"


def check_against_llm_args(serve_yaml: Path) -> dict:
    """Every key of serve.yaml declared upstream with a matching type, no deprecated key, the validators' rules."""
    config = yaml.safe_load(serve_yaml.read_text())
    for key, value in config.items():
        assert key in SCHEMA["top_level"], f"{serve_yaml}: top-level key {key!r} is not an LLM-API field"
        assert conforms(value, SCHEMA["top_level"][key]["kit_type"])
    spec = config["speculative_config"]
    cls = {
        "Eagle": "EagleDecodingConfig",
        "Eagle3": "Eagle3DecodingConfig",
        "NGram": "NGramDecodingConfig",
        "SA": "SADecodingConfig",
    }[spec["decoding_type"]]
    conforms_to(spec, cls, serve_yaml)
    if "sa_config" in spec:
        conforms_to(spec["sa_config"], "SAEnhancerConfig", serve_yaml)
        assert spec["sa_config"]["threshold"] > 0
    assert spec["max_draft_len"] > 0
    if cls == "NGramDecodingConfig":
        assert spec["max_matching_ngram_size"] > 0
        return spec
    if cls == "SADecodingConfig":
        assert spec["max_matching_ngram_size"] == -1 or 1 <= spec["max_matching_ngram_size"] <= 64
        return spec
    assert spec["speculative_model"]
    if spec.get("use_dynamic_tree"):
        assert "eagle_choices" not in spec and spec["dynamic_tree_max_topK"] > 0
        assert (
            spec["max_draft_len"]
            <= spec["max_total_draft_tokens"]
            <= spec["dynamic_tree_max_topK"] * spec["max_draft_len"]
        )
    if "eagle_choices" in spec:
        assert spec["max_draft_len"] == max(len(c) for c in spec["eagle_choices"])
    return spec


@pytest.mark.parametrize(
    "kind,tree",
    [
        ("griffin", DynamicTreeConfig(total_tokens=21, depth=4, top_k=4)),
        ("hass", DynamicTreeConfig(total_tokens=16, depth=3, top_k=4)),
        ("eagle2", parse_tree_spec("static:chain-4")),
        ("eagle", parse_tree_spec("static:eagle1_default")),
    ],
)
def test_pytorch_backend_export_uses_only_current_llm_args(demo_checkpoints, tmp_path, kind, tree):
    result = build(demo_checkpoints, kind, tree, tmp_path)
    trtllm = result.path / "trtllm"
    spec = check_against_llm_args(trtllm / "serve.yaml")
    assert spec["decoding_type"] == "Eagle3" and spec["speculative_model"] == "trtllm/draft"
    assert spec["eagle3_layers_to_capture"] == [1]  # the 2-layer target's last layer, normed by the drafter
    if isinstance(tree, DynamicTreeConfig):
        assert (spec["max_draft_len"], spec["max_total_draft_tokens"]) == (tree.depth + 1, tree.total_tokens - 1)
    elif kind == "eagle2":  # a chain is TensorRT-LLM's linear path
        assert spec["max_draft_len"] == 4 and "eagle_choices" not in spec and "use_dynamic_tree" not in spec
    else:
        assert spec["eagle_choices"] == [list(c) for c in tree.choices]
        assert any("deprecated" in note for note in result.manifest["serve"]["notes"])
    serve = (trtllm / "serve.sh").read_text()
    assert (
        "trtllm-serve ${SPECDEC_MODEL_DIR:-target} --backend pytorch --config trtllm/serve.yaml "
        "--custom_module_dirs trtllm/specdec_trtllm"
    ) in serve
    config = yaml.safe_load((trtllm / "serve.yaml").read_text())  # what the chart's probes, metrics and tests read
    assert config["enable_iter_perf_stats"] is True and config["return_perf_metrics"] is True
    assert not (trtllm / "build.sh").exists() and not (trtllm / "checkpoint").exists()
    cfg = json.loads((trtllm / "draft" / "config.json").read_text())
    expected = "SpecdecGriffinLlama" if kind == "griffin" else "SpecdecEagleLlama"
    assert cfg["architectures"] == [expected] and cfg["draft_vocab_size"] == cfg["vocab_size"]
    assert (trtllm / "specdec_trtllm" / "__init__.py").is_file() and (
        trtllm / "specdec_trtllm" / "drafter.py"
    ).is_file()
    assert result.manifest["tensorrt_llm"]["route"] == "pytorch"


@pytest.mark.parametrize(
    "draft, decoding_type",
    [("ngram", "NGram"), ("suffix", "SA"), ("griffin+suffix", "Eagle3"), ("hass+suffix", "Eagle3")],
)
def test_model_free_and_hybrid_exports_use_only_current_llm_args(demo_checkpoints, tmp_path, draft, decoding_type):
    """Prompt lookup as NGram, suffix trees as the suffix automaton (SA), a head + suffix as the head's EAGLE-3 config
    with the automaton beside it (sa_config): each key declared at the recorded commit, the validators' rules kept."""
    head, _, lookup = draft.partition("+")
    inputs = BuildInputs(
        draft=head,
        target=demo_checkpoints["target"],
        draft_path=demo_checkpoints[head] if lookup else None,
        tokenizer=demo_checkpoints["target"],
        backend="tensorrt-llm",
        dtype="float16",
        tree=tree_to_dict(DynamicTreeConfig(6, 4, 1) if not lookup else DynamicTreeConfig(16, 3, 4)),
        lookup=lookup or None,
    )
    result = build_engine(inputs, tmp_path / draft)
    spec = check_against_llm_args(result.path / "trtllm" / "serve.yaml")
    assert spec["decoding_type"] == decoding_type
    assert (("sa_config" in spec) == bool(lookup)) and (("speculative_model" in spec) == bool(lookup))
    if not lookup:
        assert spec["max_draft_len"] == 5 and not (result.path / "trtllm" / "draft").exists()


def test_legacy_engine_route_only_for_releases_that_have_it(demo_checkpoints, tmp_path):
    chain = parse_tree_spec("static:mc_sim_7b_63:8")
    with pytest.raises(BuildError, match="removed Medusa with its TensorRT engine backend"):
        build(demo_checkpoints, "medusa", chain, tmp_path)
    with pytest.raises(BuildError, match=r"1\.3\.0rc24 cannot run a legacy engine"):
        build(demo_checkpoints, "medusa", chain, tmp_path, legacy="1.3.0rc24")
    with pytest.raises(BuildError, match="--draft griffin runs on the PyTorch backend"):
        build(demo_checkpoints, "griffin", DynamicTreeConfig(16, 3, 4), tmp_path, legacy="1.2.1")
    with pytest.raises(BuildError, match="expected a TensorRT-LLM release"):
        build(demo_checkpoints, "hass", DynamicTreeConfig(16, 3, 4), tmp_path, legacy="latest")
    with pytest.raises(
        BuildError, match=r"max_total_draft_tokens \(19\) <= dynamic_tree_max_topK \* max_draft_len \(8\)"
    ):
        build(demo_checkpoints, "hass", DynamicTreeConfig(total_tokens=20, depth=1, top_k=4), tmp_path)
    assert left_in(tmp_path) == []
    legacy = build(demo_checkpoints, "medusa", chain, tmp_path, legacy="1.2.1")
    assert (legacy.path / "trtllm" / "checkpoint" / "config.json").is_file()
    assert legacy.manifest["tensorrt_llm"]["route"] == "legacy-engine 1.2.1"


@pytest.fixture
def standin():
    trtllm_standin.install()
    yield trtllm_standin
    trtllm_standin.uninstall()
    for name in [n for n in sys.modules if n == "specdec_trtllm" or n.startswith("specdec_trtllm.")]:
        del sys.modules[name]


def import_like_trtllm(package_dir: Path):
    """What ``trtllm-serve --custom_module_dirs DIR`` does: DIR's parent on sys.path, DIR imported as a package."""
    sys.path.insert(0, str(package_dir.parent))
    try:
        return importlib.import_module(package_dir.name)
    finally:
        sys.path.remove(str(package_dir.parent))


def test_drafter_package_names_the_release_it_needs(demo_checkpoints, tmp_path, standin):
    result = build(demo_checkpoints, "griffin", DynamicTreeConfig(16, 3, 4), tmp_path)
    del sys.modules["tensorrt_llm._torch.models.modeling_utils"].register_draft_model  # an older release
    with pytest.raises(ImportError, match="register_draft_model, which this TensorRT-LLM release lacks"):
        import_like_trtllm(result.path / "trtllm" / "specdec_trtllm")


@pytest.mark.parametrize("kind", ["griffin", "hass"])
def test_drafter_package_computes_the_kits_draft(demo_checkpoints, tmp_path, standin, kind):
    result = build(demo_checkpoints, kind, DynamicTreeConfig(16, 3, 4), tmp_path)
    trtllm = result.path / "trtllm"
    package = import_like_trtllm(trtllm / "specdec_trtllm")
    builder = standin.DRAFT_BUILDERS[standin.SpeculativeDecodingMode.EAGLE3_ONE_MODEL]
    assert builder is package.drafter.build_eagle3_one_model_draft

    target = TargetModel.from_pretrained(result.path / "target", dtype="float32", device="cpu")
    hf = target.hf_model
    target_config = SimpleNamespace(pretrained_config=hf.config, mapping=SimpleNamespace(tp_size=1))
    draft_config = SimpleNamespace(
        pretrained_config=AutoConfig.from_pretrained(trtllm / "draft"), mapping=SimpleNamespace(tp_size=1)
    )
    draft_config.pretrained_config.torch_dtype = torch.float32
    drafter = builder(target_config, draft_config, hf.lm_head, hf)
    drafter.load_weights(load_file(str(trtllm / "draft" / "model.safetensors")))
    drafter.load_weights_from_target_model(hf)  # upstream's load_draft_weights does this next

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, target.vocab_size, (1, 12), generator=gen)
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.update(out=o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        normed = hf(prompt, output_hidden_states=True).hidden_states[-1]  # post-final-norm: the kit's feature
    hook.remove()
    tokens = torch.cat([prompt[:, 1:], torch.tensor([[5]])], dim=1)  # feature t pairs with token t + 1
    positions = torch.arange(prompt.shape[1])

    with torch.no_grad():  # the worker's first draft step over a context, as Eagle3OneModelWorker runs it
        features = drafter.apply_eagle3_fc(captured["out"][0])
        to_head, to_next = drafter.model(None, input_ids=tokens[0], position_ids=positions, hidden_states=features)
        logits = drafter.logits_processor(to_head, drafter.lm_head, None, True)
    kit = load_draft(demo_checkpoints[kind], kind, target.hidden_size, target.vocab_size)
    causal = (positions[None, :] <= positions[:, None])[None]
    with torch.no_grad():
        prediction, regression = kit.step(normed, tokens, positions[None], causal, kit.new_cache(1, 16))
        kit_logits = hf.lm_head(prediction)
    assert torch.allclose(features, normed[0], atol=1e-5)
    assert torch.allclose(logits, kit_logits[0], atol=1e-5), (logits - kit_logits[0]).abs().max()
    assert torch.allclose(to_next, regression[0], atol=1e-5)
    assert torch.equal(logits.argmax(-1), kit_logits[0].argmax(-1))

    foreign = SimpleNamespace(pretrained_config=SimpleNamespace(architectures=["LlamaForCausalLMEagle3"]))
    assert package.drafter.kit_kind(draft_config) == ("griffin" if kind == "griffin" else "eagle")
    assert builder(target_config, foreign, hf.lm_head, hf) == "tensorrt-llm's Eagle3ForCausalLM"
    assert standin.BUILTIN_CALLS == [foreign]  # other drafts keep TensorRT-LLM's own builder
