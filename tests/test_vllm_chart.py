"""The vLLM tier's chart checks. Every vLLM launch command the chart leads to (each draft kind; tensor parallelism
1, 2, 8 and 16, the last over two nodes as a leader and a headless worker) goes through vLLM's own argument parsing,
validation and engine configuration (tests/vllm_harness.py, in .venv-vllm). The layouts the kit refuses on vLLM
(pipeline parallelism with EAGLE-style drafts) are refused alike by the builder and the chart; vLLM's argument checks
let them through, and vLLM itself then fails to start, as the rule says. The chart's `helm test` speculation check
passes against vLLM speculating and fails against vLLM plain."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from helm_cli import HelmChart
from test_helm import build_job, check_speculation, pods_of, render_layout, server, speculation_script
from test_vllm_engine import ONE_PROCESS_ARGS, ONE_PROCESS_ENV, STARTUP_S
from test_vllm_engine import build as build_zoo_engine

from specdec_kit.bench.servers import start_vllm
from specdec_kit.export.builder import build_engine
from specdec_kit.export.engine_rules import VLLM_PP_SPEC
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.trees import parse_tree_spec, tree_to_dict
from specdec_kit.runtime.demo import write_demo
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.synthetic import random_eagle3
from specdec_kit.serving.cli import external_flags, key_environment

pytestmark = [pytest.mark.vllm, pytest.mark.helm]

HARNESS = Path(__file__).resolve().parent / "vllm_harness.py"
KINDS = ("griffin", "eagle", "eagle2", "hass", "eagle3")
WIDE_KINDS = ("griffin", "eagle3")  # the plugin's class and vLLM's own, at every layout
LAYOUTS = ((1, 1), (2, 1), (8, 1), (16, 1), (1, 2), (8, 2))


KEY = "sk-test-never-shown"


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A 4-layer demo target with 16 attention heads (8 KV heads), which tensor parallelism up to 16 splits, and every
    kind's draft; the EAGLE-3 head taps layers 1-3."""
    root = tmp_path_factory.mktemp("vllm-chart")
    paths = write_demo(root / "demo", shape=dict(hidden_size=256, layers=4, heads=16, kv_heads=8, intermediate=256))
    target = TargetModel.from_pretrained(paths["target"], dtype="float32")
    save_draft(random_eagle3(target, draft_vocab=30, layers=(1, 2, 3)), root / "eagle3", "eagle3")
    return {**paths, "eagle3": root / "eagle3"}


def inputs(paths: dict[str, Path], kind: str, pp: int = 1) -> BuildInputs:
    return BuildInputs(
        draft=kind,
        target=paths["target"],
        draft_path=paths[kind],
        tokenizer=paths["target"],
        backend="vllm",
        dtype="float32",
        tree=tree_to_dict(parse_tree_spec("static:chain-3")),
        pp=pp,
    )


def serve_argv(engine: Path) -> list[str]:
    """What ``vllm/serve.sh`` hands to the kit's vLLM launcher."""
    line = next(x for x in (engine / "vllm" / "serve.sh").read_text().splitlines() if x.startswith("exec "))
    argv = shlex.split(line.replace("${PORT:-8000}", "8000").replace(' "$@"', ""))
    return argv[argv.index("specdec_vllm.serve") + 1 :]


def with_parallelism(argv: list[str], tp: int, pp: int) -> list[str]:
    out = list(argv)
    out[out.index("--tensor-parallel-size") + 1], out[out.index("--pipeline-parallel-size") + 1] = str(tp), str(pp)
    return out


def chart_commands(chart: HelmChart, engine: Path, kind: str, tp: int, pp: int) -> list[tuple[str, list[str]]] | str:
    """The vLLM command of every serving pod a chart layout renders (the engine's serve.sh at the Job's --tp/--pp,
    then specdec-serve's flags and the arguments after ``--``), or the chart's refusal."""
    docs = render_layout(chart, "vllm", kind, tp, pp)
    if isinstance(docs, str):
        return docs
    build = dict(a[2:].split("=", 1) for a in build_job(docs)["spec"]["template"]["spec"]["containers"][0]["args"])
    commands = []
    for role, spec in pods_of(docs):
        args = server(spec)["args"]
        head, extra = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
        options = dict(a[2:].split("=", 1) for a in head if "=" in a)
        rank = "1" if role == "worker" else "0"
        extra = [a.replace("$(LWS_WORKER_INDEX)", rank).replace("$(LWS_LEADER_ADDRESS)", "10.0.0.1") for a in extra]
        flags = external_flags("vllm", options["host"], options["served-model-name"], None)
        commands.append(
            (role, with_parallelism(serve_argv(engine), int(build["tp"]), int(build["pp"])) + flags + extra)
        )
    return commands


def vllm_verdicts(python: str, commands: list[dict], plugin: Path) -> list[dict]:
    """vLLM's verdict on each command; ``plugin``: an engine's ``vllm/plugin``, put on the path as serve.sh does."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(plugin))
    proc = subprocess.run(
        [python, str(HARNESS)], input=json.dumps(commands), capture_output=True, text=True, timeout=1200, env=env
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VERDICTS ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("VERDICTS ") :])


def test_every_vllm_command_the_chart_leads_to_passes_vllms_checks(vllm_python, chart, wide_checkpoints, tmp_path):
    """vLLM's own argument and engine-configuration checks on every layout the chart leads to; the API key reaches
    vLLM's middleware through the environment (never the command line)."""
    cases, commands = [], []
    for kind in KINDS:
        engine = build_engine(inputs(wide_checkpoints, kind), tmp_path / kind).path
        for tp, pp in LAYOUTS if kind in WIDE_KINDS else LAYOUTS[:1] + LAYOUTS[4:5]:
            try:
                build_engine(inputs(wide_checkpoints, kind, pp), tmp_path / f"{kind}-pp{pp}")
                builder = None
            except BuildError as exc:
                builder = str(exc)
            layout = chart_commands(chart, engine, kind, tp, pp)
            if isinstance(layout, str):  # refused: vLLM's own checks see the same command at that layout
                layout_commands = [("refused", with_parallelism(serve_argv(engine), tp, pp))]
            else:
                layout_commands = layout
            for role, argv in layout_commands:
                cases.append((kind, tp, pp, role, builder, layout))
                assert not any(KEY in a for a in argv)
                commands.append(
                    {"argv": argv, "cwd": str(engine), "api_key": key_environment("vllm", KEY)["VLLM_API_KEY"]}
                )
    verdicts = vllm_verdicts(vllm_python, commands, tmp_path / "griffin" / "vllm" / "plugin")
    for (kind, tp, pp, role, builder, layout), verdict in zip(cases, verdicts):
        where = f"{kind} tp {tp} pp {pp} ({role})"
        assert verdict["ok"], f"{where}: vLLM refuses the command: {verdict['error']}"
        assert verdict["world_size"] == tp * pp and verdict["method"] == ("eagle3" if kind == "eagle3" else "eagle")
        # the key as specdec-serve hands it over (VLLM_API_KEY, on no command line) is what vLLM checks
        assert verdict["statuses"] == {"none": 401, "wrong": 401, "right": 200}, where
        if pp > 1:  # the kit's rule, not vLLM's argument checks: vLLM fails at start-up instead (next test)
            assert builder is not None and VLLM_PP_SPEC in builder, where
            assert role == "refused" and VLLM_PP_SPEC[:100] in " ".join(layout.split()), where
        else:
            assert builder is None and role != "refused", f"{where}: refused: {builder or layout}"
    roles = {(kind, tp): [c[3] for c in cases if c[:2] == (kind, tp)] for kind, tp, *_ in cases}
    assert roles[("griffin", 16)] == ["leader", "worker"]  # a replica over two nodes: the worker runs headless


def test_vllm_fails_to_start_with_pipeline_parallelism_as_the_kits_rule_says(vllm_python, tmp_path):
    """The zoo's GRIFFIN engine on vLLM-CPU at --pipeline-parallel-size 2 (two worker processes, one core each)."""
    engine = build_zoo_engine("griffin", tmp_path / "griffin-vllm")
    log = tmp_path / "vllm-pp2.log"
    server_process = start_vllm(
        "vllm-pp2",
        engine,
        vllm_python,
        speculative=True,
        max_model_len=1024,
        kv_cache_gib=1,
        log=log,
        extra=["--enforce-eager", "--pipeline-parallel-size", "2"],
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    with pytest.raises(RuntimeError, match="server exited"):
        server_process.wait_ready("/health", STARTUP_S)
    text = log.read_text()
    assert "object has no attribute 'drafter'" in text, text[-3000:]
    assert "'CPUModelRunner' object has no attribute 'drafter'" in VLLM_PP_SPEC


def test_helm_tests_speculation_check_on_vllm(vllm_python, chart, tmp_path):
    """The chart's `helm test` speculation check for backend vllm, run as rendered against vLLM's own server: it
    passes with the kit's GRIFFIN head proposing, and fails on the same engine served without speculation."""
    script = speculation_script(
        chart.render(
            {
                "backend": "vllm",
                "engine": {"source": "build"},
                "model": {"pvc": {"claimName": "m"}},
                "tests": {"speculationDeadlineSeconds": 5},
            }
        )
    )
    engine = build_zoo_engine("griffin", tmp_path / "griffin-vllm")
    for speculative in (True, False):
        srv = start_vllm(
            f"vllm-{speculative}",
            engine,
            vllm_python,
            speculative=speculative,
            max_model_len=1024,
            kv_cache_gib=1,
            log=tmp_path / f"vllm-{speculative}.log",
            extra=["--enforce-eager", *ONE_PROCESS_ARGS],
            extra_env=ONE_PROCESS_ENV,
        )
        try:
            srv.wait_ready("/health", STARTUP_S)
            check_speculation(script, srv.url, speculative, timeout=300)
        finally:
            srv.stop()


def test_vllms_own_configuration_takes_the_model_free_exports(vllm_python, wide_checkpoints, tmp_path):
    """The n-gram and suffix exports (no draft weights) through vLLM's own engine configuration: prompt lookup is
    vLLM's ``ngram`` method as written; ``suffix`` passes every check up to the Arctic Inference package vLLM needs for
    it (a source-only package of CUDA ops, not installed in vLLM's CPU environment), which vLLM names."""
    commands = []
    for kind in ("ngram", "suffix"):
        engine = build_engine(
            BuildInputs(
                draft=kind,
                target=wide_checkpoints["target"],
                draft_path=None,
                tokenizer=wide_checkpoints["target"],
                backend="vllm",
                dtype="float32",
                tree=tree_to_dict(parse_tree_spec("dynamic:8:6:1")),
            ),
            tmp_path / kind,
        ).path
        commands.append({"argv": serve_argv(engine), "cwd": str(engine)})
    ngram, suffix = vllm_verdicts(vllm_python, commands, tmp_path / "ngram" / "vllm" / "plugin")
    assert ngram == {"ok": True, "world_size": 1, "method": "ngram"}
    assert not suffix["ok"] and "Arctic Inference is required for suffix decoding" in suffix["error"]
