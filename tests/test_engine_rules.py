"""One table of refused layouts for the builder and the chart: the chart's copy is the generated one, and every rule
that touches a layout the chart can express is refused by both, with the same reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helm_cli import HelmRefused

from specdec_kit.export.builder import build_engine
from specdec_kit.export.engine_rules import ALWAYS, CHART_RULES, WITH_PIPELINE, chart_rules_text, engine_rules
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.core.trees import DynamicTreeConfig, parse_tree_spec, tree_to_dict
from specdec_kit.runtime.registry import hybrid_parts

REPO = Path(__file__).resolve().parents[1]
CHART_DRAFTS = json.loads((REPO / "helm" / "values.schema.json").read_text())["properties"]["engine"]["properties"][
    "draft"
]["enum"]
CHART_BACKENDS = ("sglang", "vllm", "tensorrt-llm")


def test_the_charts_copy_is_the_builders_table():
    assert (REPO / CHART_RULES).read_text() == chart_rules_text(), (
        f"{CHART_RULES} is stale: run python -m specdec_kit.export.engine_rules --write {CHART_RULES}"
    )


def chart_cases() -> list[tuple[str, str, int, str]]:
    return [
        (rule.backend, draft, 2 if rule.when == WITH_PIPELINE else 1, rule.reason)
        for rule in engine_rules()
        for draft in rule.drafts
        if rule.backend in CHART_BACKENDS and draft in CHART_DRAFTS
    ]


def test_the_table_covers_the_engines_refusals():
    cases = {(backend, draft, pp) for backend, draft, pp, _ in chart_cases()}
    assert {
        ("sglang", "griffin", 2),
        ("sglang", "hass", 2),
        ("tensorrt-llm", "griffin", 2),
        ("sglang", "medusa", 1),
        ("tensorrt-llm", "medusa", 1),
        ("vllm", "griffin+suffix", 1),
        ("sglang", "eagle3+ngram", 1),
        ("tensorrt-llm", "griffin+ngram", 1),
        ("vllm", "ngram", 2),
    } <= cases
    assert ("tensorrt-llm", "griffin+suffix", 1) not in cases
    assert {r.when for r in engine_rules()} >= {ALWAYS, WITH_PIPELINE}


@pytest.mark.parametrize("backend,draft,pp,reason", chart_cases(), ids=lambda v: str(v)[:20])
def test_chart_and_builder_refuse_alike(chart, demo_checkpoints, request, tmp_path, backend, draft, pp, reason):
    values = {
        "backend": backend,
        "engine": {"source": "build", "draft": draft},
        "model": {"pvc": {"claimName": "m"}},
        "parallelism": {"tensor": 1, "pipeline": pp},
    }
    with pytest.raises(HelmRefused) as refused:
        chart.render(values)
    assert reason[:120] in " ".join(str(refused.value).split())
    tree = parse_tree_spec("static:mc_sim_7b_63:8") if draft == "medusa" else DynamicTreeConfig(16, 3, 4)
    head, lookup = hybrid_parts(draft)
    draft_path = request.getfixturevalue("eagle3_checkpoint") if head == "eagle3" else demo_checkpoints.get(head)
    inputs = BuildInputs(
        draft=head,
        lookup=lookup,
        target=demo_checkpoints["target"],
        draft_path=draft_path,
        tokenizer=demo_checkpoints["target"],
        backend=backend,
        dtype="float32",
        tree=tree_to_dict(tree),
        pp=pp,
    )
    with pytest.raises(BuildError) as built:
        build_engine(inputs, tmp_path / "engine")
    assert reason[:120] in str(built.value)
    assert not (tmp_path / "engine").exists()
