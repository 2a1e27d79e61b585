"""Every registered draft kind, walked through what the registry says of it: trained through the trainer it names,
saved and loaded in its official layout, decoded losslessly by its drafter, and built for every backend: an engine
where the kind has a form for it, the registry's refusal where not. A new kind is one ``register`` call plus its
module; this walk then covers it without an edit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.manifest import BACKENDS, read_manifest
from specdec_kit.runtime.core.trees import DynamicTreeConfig, parse_tree_spec, tree_to_dict
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.loader import load_draft_for, make_drafter
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import (
    SERVER_ENGINES,
    draft_kind,
    draft_kinds,
    head_kinds,
    hybrid_parts,
    lookup_kinds,
    trainable_kinds,
)
from specdec_kit.train.methods import Trainer, trainer_for

LEGACY_RELEASE = "1.2.1"  # a TensorRT-LLM release with the legacy engine route
SERVERS = ("vllm", "sglang", "tensorrt-llm")
# what the two-layer target needs beside a trainer's defaults: EAGLE-3's default taps assume a deep target, and the
# server engines capture layer outputs, so not the hidden states entering layer 0
TINY = {"eagle3": {"feature_layers": [1], "ttt_length": 2}, "peagle": {"feature_layers": [0, 1], "ttt_length": 3}}


@pytest.fixture(scope="module")
def target(demo_checkpoints) -> TargetModel:
    return TargetModel.from_pretrained(demo_checkpoints["target"], dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def heads(demo_checkpoints, target, tmp_path_factory) -> dict[str, Path]:
    """One head per kind that names a trainer, trained a few steps through ``trainer_for``'s dispatch."""
    root = tmp_path_factory.mktemp("walk")
    data = torch.randint(0, target.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for kind in trainable_kinds():
        trainer = trainer_for(kind)
        spec = trainer.make_spec(kind, steps=3, batch=2, seq_len=32, lr=1e-3, warmup=1, **TINY.get(kind, {}))
        trainer.train(target, data, spec, root / kind, base_model=str(demo_checkpoints["target"]), progress=False)
        out[kind] = root / kind
    return out


def tree_of(kind: str, spec: str | None = None):
    """The kind's registered tree (or ``spec``), a small one where it is dynamic (a hybrid: its head's)."""
    tree = parse_tree_spec(spec or draft_kind(hybrid_parts(kind)[0]).default_tree)
    return DynamicTreeConfig(12, 3, 3) if isinstance(tree, DynamicTreeConfig) else tree


def head_of(heads: dict[str, Path], kind: str) -> Path:
    """The kind's head: its own, or (a kind without a trainer) the head of the kind whose weights it shares."""
    return heads.get(kind) or heads[draft_kind(kind).zoo_folder]


def test_every_reference_in_the_registry_resolves_and_every_engine_is_decided():
    for name in draft_kinds():
        kind = draft_kind(name)
        assert callable(kind.builder.resolve()), f"{name}: builder {kind.builder}"
        if kind.trainer is not None:
            assert isinstance(kind.trainer.resolve(), Trainer), f"{name}: trainer {kind.trainer}"
        elif not kind.model_free:  # a kind without a trainer shares the weights of one that has one
            assert draft_kind(kind.zoo_folder).trainer is not None, name
        assert set(kind.engines) <= set(SERVER_ENGINES), name
        assert set(kind.refused_backends) <= set(BACKENDS), name
        for engine in SERVERS:  # an engine either runs the kind (now or on its legacy route) or refuses it
            runs = engine in kind.engines or f"{engine}-legacy" in kind.engines
            assert runs != (engine in kind.refused_backends), f"{name} on {engine}"


@pytest.mark.parametrize("kind", head_kinds())
def test_each_kind_trains_saves_loads_and_decodes_losslessly(heads, target, kind):
    folder = head_of(heads, kind)
    family = draft_kind(kind).family
    config = json.loads((folder / "config.json").read_text())
    module = load_draft_for(target, kind, folder)
    # the saved config says what the family's config of the loaded module says (loading fills in defaults beside)
    again = family.config_dict(module, config.get("base_model_name_or_path", ""))
    assert {k: again.get(k) for k in config if k != "embedding_from_target"} == {
        k: v for k, v in config.items() if k != "embedding_from_target"
    }
    assert any((folder / name).is_file() for name in family.saved_files)
    assert set(family.manifest_keys) <= set(family.manifest_spec(module))
    drafter = make_drafter(target, kind, folder, tree_of(kind))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in (5, 9)]
    results = SpeculativeGenerator(target, drafter).generate(prompts, 20)
    assert [r.tokens for r in results] == [hf_greedy(target.hf_model, p, 20) for p in prompts]


@pytest.mark.parametrize("kind", lookup_kinds())
def test_each_model_free_kind_saves_loads_and_decodes_losslessly(demo_checkpoints, target, tmp_path, kind):
    """A model-free kind's "module" is its settings: written as config.json, read back, refused when wrong; its
    drafter, alone and merged with each head family that can take it, decodes as the target does."""
    family = draft_kind(kind).family
    settings = load_draft_for(target, kind, None)
    save_draft(settings, tmp_path / kind, kind)
    assert load_draft_for(target, kind, tmp_path / kind) == settings
    assert set(family.manifest_keys) <= set(family.manifest_spec(settings))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in (5, 9)]
    references = [hf_greedy(target.hf_model, p, 20) for p in prompts]
    for draft in (kind, f"griffin+{kind}"):
        drafter = make_drafter(target, draft, None if draft == kind else demo_checkpoints["griffin"], tree_of(draft))
        assert [r.tokens for r in SpeculativeGenerator(target, drafter).generate(prompts, 20)] == references


def build(demo_checkpoints, heads, kind: str, backend: str, root: Path, legacy: str | None = None):
    tree = tree_of(kind) if backend in ("onnxruntime", "torch") or legacy else tree_of(kind, "dynamic")
    model_free = draft_kind(kind).model_free
    inputs = BuildInputs(
        draft=kind,
        target=demo_checkpoints["target"],
        draft_path=None if model_free else head_of(heads, kind),
        tokenizer=demo_checkpoints["target"],
        backend=backend,
        dtype="float32",
        tree=tree_to_dict(tree),
        trtllm_legacy_engine=legacy,
        draft_tree=False,
    )
    return build_engine(inputs, root / f"{kind}-{backend}{'-legacy' if legacy else ''}")


@pytest.mark.parametrize("kind", draft_kinds())
def test_each_kind_exports_for_each_server_engine_as_its_form_says(demo_checkpoints, heads, tmp_path, kind):
    entry = draft_kind(kind)
    for engine in SERVERS:
        form = entry.engines.get(engine)
        if form is None:  # refused outright, or (a legacy-only kind) refused on the current release
            with pytest.raises(BuildError) as refused:
                build(demo_checkpoints, heads, kind, engine, tmp_path)
            reason = entry.refusal(engine) or f"--trtllm-legacy-engine {LEGACY_RELEASE}"
            assert reason in str(refused.value), (kind, engine)
            continue
        path = build(demo_checkpoints, heads, kind, engine, tmp_path).path
        manifest = read_manifest(path)
        if entry.model_free:  # no draft weights: the engine's own method, as the form names it
            method = {
                "vllm": lambda m: m["vllm"]["speculative_config"]["method"],
                "sglang": lambda m: m["sglang"]["speculative_algorithm"],
                "tensorrt-llm": lambda m: m["tensorrt_llm"]["serve_config"]["speculative_config"]["decoding_type"],
            }[engine](manifest)
            assert method == form.method and not (path / engine.split("-")[0] / "draft").exists(), (kind, engine)
            continue
        if engine == "vllm":
            assert manifest["vllm"]["architecture"] == form.architecture
            assert manifest["vllm"]["speculative_config"]["method"] == form.method
            assert manifest["vllm"]["weight_map_checked"] == (not form.official_layout)
        elif engine == "sglang":
            assert manifest["sglang"]["architecture"] == form.architecture
            assert manifest["sglang"]["speculative_algorithm"] == form.method
            assert ("sglang_plugin" in manifest["artifacts"]) == form.plugin
        else:
            assert manifest["tensorrt_llm"]["serve_config"]["speculative_config"]["decoding_type"] == form.method
            assert ("trtllm_drafter_package" in manifest["artifacts"]) == form.plugin
            draft = json.loads((path / "trtllm" / "draft" / "config.json").read_text())
            assert draft["architectures"] == [form.architecture or "LlamaForCausalLM"]
    legacy = entry.engines.get("tensorrt-llm-legacy")
    if legacy is not None:
        manifest = read_manifest(build(demo_checkpoints, heads, kind, "tensorrt-llm", tmp_path, LEGACY_RELEASE).path)
        assert manifest["tensorrt_llm"]["serve_config"]["speculative_config"]["decoding_type"] == legacy.method


@pytest.mark.slow
@pytest.mark.parametrize("kind", draft_kinds())
def test_each_kind_builds_an_onnx_runtime_engine_that_decodes_losslessly(
    demo_checkpoints, heads, target, tmp_path, kind
):
    from specdec_kit.runtime.engine import open_engine

    engine = open_engine(build(demo_checkpoints, heads, kind, "onnxruntime", tmp_path).path, device="cpu")
    assert engine.draft_kind == kind
    prompt = torch.randint(0, target.vocab_size, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    assert engine.generator().generate([prompt], 16)[0].tokens == hf_greedy(target.hf_model, prompt, 16)
