"""The SGLang tier: every SGLang launch command the builder writes, and every one the chart leads to, goes through
SGLang's own server-argument code (argument parsing, the resolution pipeline that reads the model's config, and
``check_server_args``; ``tests/sglang_harness.py`` in SGLang 0.5.23's virtualenv), and must pass; the layouts
SGLang refuses are exactly the ones the builder and the chart refuse, with SGLang's reason."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import SMALL_DEMO, sglang_python
from helm_cli import HelmChart
from test_helm import build_job, pods_of, render_layout
from test_helm import server as server_container

from specdec_kit.export.builder import build_engine
from specdec_kit.export.engine_rules import SGLANG_DFLASH_PP, SGLANG_PP_SPEC
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_to_dict
from specdec_kit.runtime.demo import write_demo
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.synthetic import random_dflash, random_eagle3
from specdec_kit.serving.cli import external_flags, key_environment

pytestmark = [pytest.mark.sglang, pytest.mark.helm]

REPO = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).resolve().parent / "sglang_harness.py"
# ngram and suffix: SGLang's own NGRAM; dflash: its DFLASH (the official DFlashDraftModel layout)
KINDS = ("griffin", "eagle", "eagle2", "hass", "eagle3", "dflash", "ngram", "suffix")
CHART_KINDS = ("griffin", "eagle", "eagle2", "hass")  # the chart's engine.draft choices that SGLang runs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A 4-layer demo target with every kind's draft; the EAGLE-3 head taps layers 1-3 (SGLang cannot tap 0)."""
    root = tmp_path_factory.mktemp("sglang-tier")
    paths = write_demo(root / "demo", shape=dict(SMALL_DEMO, layers=4))
    target = TargetModel.from_pretrained(paths["target"], dtype="float32")
    save_draft(random_eagle3(target, draft_vocab=30, layers=(1, 2, 3)), root / "eagle3", "eagle3")
    save_draft(random_dflash(target), root / "dflash", "dflash")
    return {**paths, "eagle3": root / "eagle3", "dflash": root / "dflash"}


def build(paths, kind: str, out: Path, tree: DynamicTreeConfig, tp: int = 1, pp: int = 1):
    inputs = BuildInputs(
        draft=kind,
        target=paths["target"],
        draft_path=paths.get(kind),  # none for a model-free kind
        tokenizer=paths["target"],
        backend="sglang",
        dtype="float16",
        tree=tree_to_dict(tree),
        tp=tp,
        pp=pp,
    )
    return build_engine(inputs, out / f"{kind}-{tree.total_tokens}-{tree.depth}-{tree.top_k}-tp{tp}-pp{pp}").path


def serve_command(engine: Path, extra: list[str] = ()) -> dict:
    """What ``sglang/serve.sh`` (then ``specdec-serve``'s extra arguments) hands to the engine's SGLang launcher."""
    script = (engine / "sglang" / "serve.sh").read_text()
    env = dict(re.findall(r"^export (\w+)=(\S+)$", script, flags=re.M))
    pythonpath = [str(engine / "sglang" / "plugin"), str(REPO)] if "PYTHONPATH" in env else []
    env.pop("PYTHONPATH", None)
    exec_line = next(line for line in script.splitlines() if line.startswith("exec "))
    argv = shlex.split(exec_line.replace("${PORT:-30000}", "30000").replace(' "$@"', ""))
    argv = argv[argv.index("sglang/launch.py") + 1 :]
    return {"argv": [*argv, *extra], "env": env, "pythonpath": pythonpath, "cwd": str(engine)}


def sglang_verdicts(commands: list[dict]) -> list[dict]:
    """SGLang's verdict on each entry (see tests/sglang_harness.py)."""
    proc = subprocess.run(
        [sglang_python(), str(HARNESS)], input=json.dumps(commands), capture_output=True, text=True, timeout=900
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VERDICTS ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("VERDICTS ") :])


def with_parallelism(argv: list[str], tp: int, pp: int) -> list[str]:
    out = list(argv)
    out[out.index("--tp-size") + 1], out[out.index("--pp-size") + 1] = str(tp), str(pp)
    return out


def test_every_command_the_builder_writes_passes_sglangs_checks_with_the_key_kept_secret(checkpoints, tmp_path):
    """Every kind's launch command passes SGLang's checks; the API key, handed over as specdec-serve hands it (in
    the environment), reaches SGLang's arguments, is on no command line, shows in none of SGLang's reports of its
    arguments (the start-up log's, /server_info's, the launch command) and is not inherited by SGLang's children."""
    key = "sk-test-never-shown"
    commands, labels = [], []
    launcher = external_flags("sglang", "0.0.0.0", "demo", 512)  # what specdec-serve adds
    for kind in KINDS:
        for tree in (DynamicTreeConfig(60, 5, 10), DynamicTreeConfig(16, 3, 4)):
            for tp in (1, 2):
                engine = build(checkpoints, kind, tmp_path, tree, tp=tp)
                command = serve_command(engine, launcher)
                command["env"].update(key_environment("sglang", key))
                assert not any(key in a for a in command["argv"])
                commands.append(command)
                labels.append(f"{kind} tree {tree} tp {tp}")
    verdicts = sglang_verdicts(commands)
    refused = [f"{label}: {v['error']}" for label, v in zip(labels, verdicts) if not v["ok"]]
    assert refused == [], "\n".join(refused)
    for label, verdict in zip(labels, verdicts):
        assert verdict["version_note"] is None, f"{label}: {verdict['version_note']}"
        assert verdict["key_in_effect"], f"{label}: SGLang did not get the API key"
        assert not verdict["key_shown"], f"{label}: SGLang reports the API key"
        assert not verdict["key_inherited"], f"{label}: the key stays in the environment SGLang's children inherit"


def chart_layout(chart: HelmChart, kind: str, tp: int, pp: int) -> dict | str:
    """The chart's server and build arguments for an SGLang layout, or its refusal."""
    docs = render_layout(chart, "sglang", kind, tp, pp)
    if isinstance(docs, str):
        return docs
    _, spec = pods_of(docs)[0]  # the Deployment's pod, or the LeaderWorkerSet's leader
    builder = next(c for c in build_job(docs)["spec"]["template"]["spec"]["containers"] if c["name"] == "build-engine")
    return {"server": server_container(spec)["args"], "build": builder["args"]}


def chart_sglang_command(checkpoints, layout: dict, tmp_path: Path, tp: int, pp: int, kind: str) -> dict:
    """The SGLang command a chart layout leads to: the engine its build Job builds (here on the demo target at
    TP 1, the chart's TP and PP put back), plus specdec-serve's flags and the arguments after ``--``."""
    build_args = dict(a[2:].split("=", 1) for a in layout["build"] if a.startswith("--") and "=" in a)
    tree = DynamicTreeConfig(int(build_args["total-tokens"]), int(build_args["depth"]), int(build_args["top-k"]))
    engine = build(checkpoints, kind, tmp_path, tree)
    server = layout["server"]
    head, extra = (server[: server.index("--")], server[server.index("--") + 1 :]) if "--" in server else (server, [])
    options = dict(a[2:].split("=", 1) for a in head if "=" in a)
    extra = [a.replace("$(LWS_WORKER_INDEX)", "0").replace("$(LWS_LEADER_ADDRESS)", "10.0.0.1") for a in extra]
    launcher = external_flags("sglang", options["host"], options["served-model-name"], None)
    command = serve_command(engine, [*launcher, *extra])
    command["argv"] = with_parallelism(command["argv"], tp, pp)
    return command


def test_sglang_refuses_exactly_what_the_builder_and_chart_refuse(checkpoints, chart, tmp_path):
    cases, commands = [], []
    for kind in KINDS:
        base = serve_command(build(checkpoints, kind, tmp_path, DynamicTreeConfig(16, 3, 4)))
        for tp, pp in ((1, 1), (8, 1), (16, 1), (1, 2), (8, 2)):
            try:
                build(checkpoints, kind, tmp_path, DynamicTreeConfig(16, 3, 4), tp=1, pp=pp)
                builder = None
            except BuildError as exc:
                builder = str(exc)
            layout = chart_layout(chart, kind, tp, pp) if kind in CHART_KINDS else None
            if isinstance(layout, dict):  # the chart renders it: check the command it leads to
                command = chart_sglang_command(checkpoints, layout, tmp_path, tp, pp, kind)
            else:
                command = dict(base, argv=with_parallelism(base["argv"], tp, pp))
            cases.append((kind, tp, pp, builder, layout))
            commands.append(command)
    verdicts = sglang_verdicts(commands)
    for (kind, tp, pp, builder, layout), verdict in zip(cases, verdicts):
        where = f"{kind} tp {tp} pp {pp}"
        if verdict["ok"]:
            assert builder is None, f"{where}: SGLang accepts it, the builder refuses: {builder}"
            assert layout is None or isinstance(layout, dict), (
                f"{where}: SGLang accepts it, the chart refuses: {layout}"
            )
        else:
            sglang_reason = verdict["error"].split(": ", 1)[1]
            assert sglang_reason in SGLANG_PP_SPEC + SGLANG_DFLASH_PP, (
                f"{where}: SGLang refuses with a reason the kit does not give: {verdict}"
            )
            assert builder is not None and sglang_reason in builder, f"{where}: SGLang refuses, the builder does not"
            if kind in CHART_KINDS:
                assert isinstance(layout, str) and sglang_reason in layout, (
                    f"{where}: SGLang refuses, the chart renders it"
                )
    assert sum(not v["ok"] for v in verdicts) == 2 * len(KINDS)  # every pp=2 layout, nothing else


def test_the_regeneration_workers_engine_arguments_pass_sglangs_checks(checkpoints):
    """``train/sglang_generate_worker.py`` (SGLang's offline engine for the kit's data regeneration, GPUs only)
    builds ``sglang.Engine``'s arguments; SGLang's own ``ServerArgs`` takes them and its checks pass, at one GPU and at
    tensor parallelism 2 (the worker cannot run here: SGLang's kernels need a GPU)."""
    from specdec_kit.train import sglang_generate_worker as worker

    target = str(checkpoints["target"])
    commands = [
        {"engine_kwargs": worker.engine_kwargs(worker.parse([target, "--dtype", "float16", *extra]))}
        for extra in ([], ["--tp", "2", "--enforce-eager"])
    ]
    too_long = worker.engine_kwargs(worker.parse([target, "--max-model-len", "100000"]))  # beyond the model's 2048
    verdicts = sglang_verdicts([*commands, {"engine_kwargs": too_long}])
    assert verdicts[:2] == [{"ok": True}, {"ok": True}], verdicts
    assert not verdicts[2]["ok"] and "context_length (100000)" in verdicts[2]["error"]  # the checks do refuse
