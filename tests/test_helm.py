"""The chart, rendered and linted by a real Helm CLI (v4, scripts/setup_helm.sh) without a cluster: Kubernetes
schemas for every manifest (custom resources against their own schemas, by kind), the essentials of GPU deployments,
refused values (at render time and by `helm lint`), the custom resources' API checks, the build Job's protocol run
for real against the kit's builder, the `helm test` checks run against the kit's server, golden outputs; and the
images' Dockerfiles."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate as kv
import pytest
import yaml
from helm_cli import CHART, CHART_APIS, HelmChart, HelmRefused

pytestmark = pytest.mark.helm

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((CHART / "ci").glob("values-*.yaml"))
GOLDEN = Path(__file__).resolve().parent / "golden" / "helm"
CRD_SCHEMAS = {p.stem: json.loads(p.read_text()) for p in (Path(__file__).resolve().parent / "schemas").glob("*.json")}
K8S_VERSION = "1.33.0"
SGLANG_CHECKED = "0.5.23"  # the SGLang the tier installs and the image is built on
SGLANG_BUILD = {"backend": "sglang", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}}}


def example(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def pods_of(docs: list[dict]) -> list[tuple[str, dict]]:
    """(role, pod spec) of every serving pod template: Deployment, or LeaderWorkerSet leader and worker."""
    out = []
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "specdec":
            out.append(("single", d["spec"]["template"]["spec"]))
        if d["kind"] == "LeaderWorkerSet":
            tmpl = d["spec"]["leaderWorkerTemplate"]
            out += [("leader", tmpl["leaderTemplate"]["spec"]), ("worker", tmpl["workerTemplate"]["spec"])]
    return out


def build_job(docs: list[dict]) -> dict:
    [job] = [d for d in docs if d["kind"] == "Job"]
    return job


def server(spec: dict) -> dict:
    return next(c for c in spec["containers"] if c["name"] == "server")


def render_layout(chart: HelmChart, backend: str, kind: str, tp: int, pp: int) -> list[dict] | str:
    """A GPU backend's build-from-PVC layout: the rendered objects, or the chart's refusal."""
    values = {
        "backend": backend,
        "engine": {"source": "build", "draft": kind},
        "model": {"pvc": {"claimName": "m"}},
        "parallelism": {"tensor": tp, "pipeline": pp},
    }
    try:
        return chart.render(values)
    except HelmRefused as exc:
        return str(exc)


def speculation_script(docs: list[dict]) -> str:
    """The Python the `helm test` speculation pod runs."""
    pod = next(d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"] == "specdec-test-speculation")
    return pod["spec"]["containers"][0]["args"][0]


def check_speculation(script: str, url: str, speculating: bool, timeout: float = 120) -> None:
    """Run the speculation check against the server at ``url``: it passes on a speculating server (at its first
    completion, whatever the deadline), fails on a plain one (at the deadline: the tests give it seconds)."""
    proc = subprocess.run(
        [sys.executable, "-c", script.replace("http://specdec:8000", url)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "API_KEY": ""},
    )
    if speculating:
        assert proc.returncode == 0 and "acceptance length:" in proc.stdout, proc.stdout + proc.stderr
    else:
        assert proc.returncode != 0 and "never rose above 1" in proc.stderr, proc.stdout + proc.stderr


def named(items: list[dict], name: str) -> dict:
    return next(i for i in items if i["name"] == name)


def test_lint_is_clean(chart):
    for values in [{}] + [example(p) for p in EXAMPLES]:
        proc = chart.lint(values)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"autoscaling": {"enabled": True, "mode": "prometheus-adapter", "minReplicas": 5, "maxReplicas": 2}},
            "minReplicas 5 exceeds maxReplicas 2",
        ),
        ({**SGLANG_BUILD, "parallelism": {"tensor": 8, "pipeline": 2}}, "PP + speculative decoding"),
        ({**SGLANG_BUILD, "parallelism": {"tensor": 3}}, "do not divide the 8 GPUs of a node"),
    ],
)
def test_lint_refuses_what_install_refuses(chart, values, message):
    """`helm lint` renders with the chart's `fail` switched off; the chart's refusals reach it all the same."""
    with pytest.raises(HelmRefused, match=re.escape(message)):
        chart.render(values)
    proc = chart.lint(values)
    assert proc.returncode != 0 and "[ERROR]" in proc.stdout and message in " ".join(proc.stdout.split()), proc.stdout


def check_inference_pool_rules(doc: dict) -> None:
    """The CRD's CEL rules: a port for Service references, unique target port numbers."""
    ref = doc["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    numbers = [p["number"] for p in doc["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_manifest_validates(chart, path):
    docs = chart.render(example(path))
    assert docs
    for doc in docs:
        kind = doc["kind"]
        if kind in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[kind])
            if kind == "InferencePool":
                check_inference_pool_rules(doc)
            if kind == "LeaderWorkerSet":  # its pod templates are core Pods: check them with Kubernetes' schema
                for part in ("leaderTemplate", "workerTemplate"):
                    tmpl = doc["spec"]["leaderWorkerTemplate"][part]
                    pod = {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": "x", **tmpl.get("metadata", {})},
                        "spec": tmpl["spec"],
                    }
                    kv.validate(pod, K8S_VERSION, strict=True)
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.SchemaNotFoundError:
            pytest.fail(f"{path.name}: {kind} has neither a Kubernetes schema nor one in tests/schemas")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_output_matches_golden(chart, path):
    text = yaml.safe_dump_all(chart.render(example(path)), sort_keys=True)
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("SPECDEC_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"{golden} missing: run with SPECDEC_UPDATE_GOLDEN=1 and review the diff"
    assert text == golden.read_text(), (
        f"{path.name}: rendering changed; if intended, regenerate with SPECDEC_UPDATE_GOLDEN=1"
    )


def test_server_joined_vocab_false_keeps_the_draft_vocabulary_as_trained(chart):
    """``server.joinedVocab: false`` gives the embedded server ``--joined-vocab=off``, which specdec-serve's own
    parser takes; the default passes nothing (the server's default, on)."""
    from specdec_kit.serving.cli import parse_args

    default = server(pods_of(chart.render({}, api_versions=()))[0][1])["args"]
    fixed = server(pods_of(chart.render({"server": {"joinedVocab": False}}, api_versions=()))[0][1])["args"]
    assert not any(a.startswith("--joined-vocab") for a in default)
    assert [a for a in fixed if a not in default] == ["--joined-vocab=off"]
    assert parse_args(fixed).joined_vocab == "off" and parse_args(default).joined_vocab == "on"


def test_defaults_are_the_cpu_demo(chart):
    docs = chart.render({}, api_versions=())  # the defaults need no custom resource
    [(role, spec)] = pods_of(docs)
    c = server(spec)
    assert c["image"] == "specdec:0.1.0-cpu" and "--engine=/opt/specdec/engines/griffin-onnxruntime" in c["args"]
    assert "nvidia.com/gpu" not in json.dumps(spec) and "nodeSelector" not in spec and "initContainers" not in spec
    assert not any(v["name"] == "shm" for v in spec["volumes"])
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget", "Pod"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_gpu_essentials(chart, path):
    values = example(path)
    docs = chart.render(values)
    merged = chart.merged_values(values)
    tp, pp = merged["parallelism"]["tensor"], merged["parallelism"]["pipeline"]
    gpu_backend = merged["backend"] != "embedded"
    build = merged["engine"]["source"] == "build"
    pods = pods_of(docs)
    per_pod = []
    for role, spec in pods:
        c = server(spec)
        assert spec["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert (
            c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep" and spec["terminationGracePeriodSeconds"] >= 30
        )
        if role != "worker":
            assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["path"] in ("/health/ready", "/health_generate", "/health")
        else:
            assert "readinessProbe" not in c
        # no serving pod builds: each waits for the one build Job's engine
        assert [i["name"] for i in spec.get("initContainers", [])] == (["wait-for-engine"] if build else [])
        if gpu_backend:
            gpus = c["resources"]["limits"]["nvidia.com/gpu"]
            assert gpus == c["resources"]["requests"]["nvidia.com/gpu"]
            per_pod.append(gpus)
            assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        has_shm = any(v["name"] == "shm" and v["emptyDir"]["medium"] == "Memory" for v in spec["volumes"])
        assert has_shm == (tp * pp > 1)
    if build:  # one builder for the release, asking for no GPU (the serving pods hold them while they wait)
        job = build_job(docs)["spec"]["template"]["spec"]
        builder = named(job["containers"], "build-engine")
        assert "nvidia.com/gpu" not in json.dumps(job)
        assert f"--tp={tp}" in builder["args"] and f"--pp={pp}" in builder["args"]
        engine = next(a for a in server(pods[0][1])["args"] if a.startswith("--engine=")).split("=", 1)[1]
        assert f"--output={engine}" in builder["args"]
    if gpu_backend:
        lws = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
        nodes = lws[0]["spec"]["leaderWorkerTemplate"]["size"] if lws else 1
        assert per_pod[0] * nodes == tp * pp  # GPUs per replica = TP x PP
        assert bool(lws) == (tp * pp > merged["gpu"]["perNode"])


def containers_of(docs: list[dict]) -> list[tuple[str, dict]]:
    """(object name, container) of every container and init container in every pod and pod template rendered."""
    specs = []
    for d in docs:
        if d["kind"] == "Pod":
            specs.append((d["metadata"]["name"], d["spec"]))
        elif d["kind"] in ("Deployment", "Job"):
            specs.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "LeaderWorkerSet":
            for part in ("leaderTemplate", "workerTemplate"):
                specs.append((f"{d['metadata']['name']} {part}", d["spec"]["leaderWorkerTemplate"][part]["spec"]))
    return [(name, c) for name, spec in specs for c in spec.get("initContainers", []) + spec["containers"]]


@pytest.mark.parametrize("backend", ["embedded", "sglang", "vllm"])
def test_the_api_key_reaches_every_server_through_its_environment_never_its_arguments(chart, backend):
    """On every backend that checks a key (trtllm-serve takes none: refused), the serving containers and the test
    pods read it from the Secret into their environment, and no container's command or arguments carry it (no key
    flag, no expansion of the variable): specdec-serve hands it to the engine's server through the environment too
    (``serving/cli.py``; the SGLang and vLLM tiers check the servers get it)."""
    values = {"apiKey": {"existingSecret": "llm-key", "key": "token"}}
    if backend != "embedded":
        values = {**SGLANG_BUILD, "backend": backend, **values}
    for layout in ({}, {"parallelism": {"tensor": 16}} if backend != "embedded" else {"replicaCount": 2}):
        docs = chart.render({**values, **layout})
        readers = 0
        for name, container in containers_of(docs):
            words = " ".join(container.get("command", []) + container.get("args", []))
            assert "api-key" not in words and "API_KEY)" not in words and "llm-key" not in words, (name, words)
            for env in container.get("env", []):
                if env.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "llm-key":
                    assert env["valueFrom"]["secretKeyRef"]["key"] == "token"
                    readers += 1
        serving = [c for n, c in containers_of(docs) if c["name"] == "server"]
        assert serving and all(
            any(e["name"] == "SPECDEC_API_KEY" and "valueFrom" in e for e in c["env"]) for c in serving
        )
        assert readers == len(serving) + 4  # and the four helm test pods


def test_feature_switches(chart):
    docs = {d["kind"]: d for d in chart.render(example(CHART / "ci" / "values-sglang-a100.yaml"))}
    assert docs["ScaledObject"]["spec"]["triggers"][0]["metadata"]["query"].startswith("sum(sglang:num_queue_reqs{")
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    dashboard = json.loads(docs["ConfigMap"]["data"]["specdec.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Time to first token", "Inter-token latency (per token)", "Throughput", "Acceptance length"} <= titles
    env = server(docs["Deployment"]["spec"]["template"]["spec"])["env"]
    assert {
        "name": "SPECDEC_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "specdec-api-key", "key": "api-key"}},
    } in env
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]  # the Job writes, replicas read
    assert docs["PersistentVolumeClaim"]["spec"]["storageClassName"] == "standard-rwx"
    multi = chart.render(example(CHART / "ci" / "values-multinode-tp16.yaml"))
    leader = next(spec for role, spec in pods_of(multi) if role == "leader")
    assert "--nnodes=2" in server(leader)["args"] and "--node-rank=$(LWS_WORKER_INDEX)" in server(leader)["args"]
    assert any(d["kind"] == "Role" and d["rules"][0]["resources"] == ["pods"] for d in multi)
    job = build_job(multi)["spec"]["template"]["spec"]  # S3 checkpoints synced into the model cache, then the build
    assert [c["name"] for c in job["initContainers"]] == ["fetch-models"] and job["restartPolicy"] == "Never"
    fetch = job["initContainers"][0]
    assert named(fetch["env"], "TARGET_DIR")["value"] == "/models/s3/models/llama-3-70b-instruct"
    assert named(job["volumes"], "models")["persistentVolumeClaim"]["claimName"] == "specdec-model-cache"
    assert named(job["volumes"], "engine-cache")["persistentVolumeClaim"]["claimName"] == "specdec-engines-rwx"
    model_cache = next(d for d in multi if d["kind"] == "PersistentVolumeClaim")
    assert model_cache["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    spread = leader["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["labelSelector"]["matchLabels"]
    pdb = next(d for d in multi if d["kind"] == "PodDisruptionBudget")  # leaders and workers of every group
    assert pdb["spec"]["selector"]["matchExpressions"] == [
        {"key": "specdec.io/role", "operator": "In", "values": ["leader", "worker"]}
    ]
    trt = {d["kind"]: d for d in chart.render(example(CHART / "ci" / "values-trtllm-tp4.yaml"))}
    assert (
        trt["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == "trtllm_num_requests_waiting"
    )
    assert trt["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["path"] == "/prometheus/metrics"
    fetch = named(trt["Job"]["spec"]["template"]["spec"]["initContainers"], "fetch-models")
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in fetch["env"]
    assert named(fetch["env"], "TARGET_DIR")["value"] == "/models/hf/meta-llama/Meta-Llama-3-8B-Instruct"


def test_vllm_backend(chart):
    docs = chart.render(example(CHART / "ci" / "values-vllm-a100.yaml"))
    kinds = {d["kind"]: d for d in docs}
    [(_, spec)] = pods_of(docs)
    c = server(spec)
    assert c["image"] == "specdec:0.1.0-vllm" and "--served-model-name=llama-3.1-8b-eagle3" in c["args"]
    assert c["args"][c["args"].index("--") + 1 :] == ["--max-model-len", "8192", "--gpu-memory-utilization", "0.9"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    route = kinds["HTTPRoute"]["spec"]["rules"][0]["backendRefs"]
    assert route == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "specdec"}]
    epp = yaml.safe_load(
        next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "specdec-epp")["data"]["epp.yaml"]
    )
    assert (
        next(p for p in epp["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]["defaultEngine"]
        == "vllm"
    )
    # a vLLM replica over two nodes: the leader serves, the workers run headless
    multi = chart.render(
        {
            **example(CHART / "ci" / "values-vllm-a100.yaml"),
            "parallelism": {"tensor": 16, "pipeline": 1},
            "inferencePool": {"enabled": False},
            "httpRoute": {"enabled": False},
        }
    )
    roles = {role: server(spec)["args"] for role, spec in pods_of(multi)}
    for role, args in roles.items():
        assert {"--nnodes=2", "--node-rank=$(LWS_WORKER_INDEX)", "--master-addr=$(LWS_LEADER_ADDRESS)"} <= set(args)
        assert ("--headless" in args) == (role == "worker")


def test_engine_cache_key_changes_with_every_build_input_and_nothing_else(chart):
    def engine_path(values: dict) -> str:
        spec = next(spec for _, spec in pods_of(chart.render(values)))
        return next(a for a in server(spec)["args"] if a.startswith("--engine="))

    base = {
        "backend": "sglang",
        "engine": {"source": "build"},
        "model": {"pvc": {"claimName": "m", "target": "llama-a"}},
    }
    same = engine_path(base)
    assert engine_path(base) == same and same.startswith("--engine=/engine-cache/griffin-sglang-tp1-pp1-")
    changed = [
        {"model": {"pvc": {"claimName": "m", "target": "llama-b"}}},
        {"engine": {"source": "build", "depth": 4}},
        {"engine": {"source": "build", "dtype": "bfloat16"}},
        {"engine": {"source": "build", "buildArgs": ["--device=cuda"]}},
        {"model": {"source": "huggingface", "huggingface": {"target": "org/a", "draft": "org/b"}}},
    ]
    paths = {engine_path({**base, **c}) for c in changed}
    assert same not in paths and len(paths) == len(changed)
    unchanged = [
        {"model": {"pvc": {"claimName": "m", "target": "llama-a"}, "cache": {"size": "1Ti"}}},
        {"engine": {"source": "build", "cache": {"storageClassName": "fast"}}},
        {"engine": {"source": "build", "build": {"backoffLimit": 5}}},
    ]
    assert {engine_path({**base, **c}) for c in unchanged} == {same}


def test_build_job_name_follows_its_pod_template(chart):
    """A Job's template is immutable: changed build settings get a new Job, unchanged ones keep it."""

    def job_name(values: dict) -> str:
        return build_job(chart.render(values))["metadata"]["name"]

    base = job_name(SGLANG_BUILD)
    assert base.startswith("specdec-build-") and job_name(SGLANG_BUILD) == base
    assert (
        job_name({**SGLANG_BUILD, "engine": {"source": "build", "build": {"resources": {"requests": {"cpu": "2"}}}}})
        != base
    )
    assert job_name({**SGLANG_BUILD, "replicaCount": 3}) == base


def test_build_job_and_waiting_pods_run_the_kits_builder(chart, demo_checkpoints, tmp_path):
    """The Job's build script and the pods' wait script, as rendered, run here against the kit's real builder: a
    failed build leaves its last lines for the waiting pods, and a build that succeeds lets them start."""
    docs = chart.render(
        {
            "engine": {"source": "build", "draft": "griffin", "tree": "static:chain-3", "dtype": "float32"},
            "model": {"pvc": {"claimName": "m"}},
        }
    )
    builder = named(build_job(docs)["spec"]["template"]["spec"]["containers"], "build-engine")
    waiter = named(pods_of(docs)[0][1]["initContainers"], "wait-for-engine")
    engine = tmp_path / "cache" / "engine"
    engine.parent.mkdir()  # the engine cache's mount
    local = {
        "/models/target": str(demo_checkpoints["target"]),
        "/models/draft": str(demo_checkpoints["griffin"]),
        named(builder["env"], "ENGINE")["value"]: str(engine),
    }

    def localize(args: list[str]) -> list[str]:
        return [next((a.replace(k, v) for k, v in local.items() if k in a), a) for a in args]

    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "ENGINE": str(engine),
        "JOB": named(waiter["env"], "JOB")["value"],
        "HOME": str(tmp_path),
    }
    wait = waiter["command"]
    broken = localize(builder["args"])
    broken[[i for i, a in enumerate(broken) if a.startswith("--draft-path=")][0]] = (
        f"--draft-path={tmp_path / 'missing'}"
    )

    def run(args):
        return subprocess.run(
            [*builder["command"], *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path
        )

    failed = run(broken)
    assert failed.returncode != 0 and "missing" in Path(f"{engine}.failed").read_text()
    waited = subprocess.run(wait, env=env, capture_output=True, text=True, timeout=60)
    assert waited.returncode == 1 and "the engine build failed" in waited.stderr and "missing" in waited.stderr
    built = run(localize(builder["args"]))
    assert built.returncode == 0, built.stdout + built.stderr
    assert not Path(f"{engine}.failed").exists() and (engine / "manifest.json").is_file()
    waited = subprocess.run(wait, env=env, capture_output=True, text=True, timeout=60)
    assert waited.returncode == 0, waited.stderr


def test_network_policy_admits_what_the_enabled_features_need(chart):
    values = {
        "networkPolicy": {"enabled": True},
        "ingress": {"enabled": True, "hosts": [{"host": "llm.example.com"}]},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw", "namespace": "gateway-system"}]},
        "monitoring": {"podMonitor": {"enabled": True}},
    }
    policy = next(d for d in chart.render(values) if d["kind"] == "NetworkPolicy")
    peers = [
        p.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
        for p in policy["spec"]["ingress"][0]["from"]
    ]
    assert peers == [None, "ingress-nginx", "gateway-system", "monitoring"]  # None: the release's own namespace
    plain = next(d for d in chart.render({"networkPolicy": {"enabled": True}}) if d["kind"] == "NetworkPolicy")
    assert plain["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]


@pytest.mark.parametrize(
    "values, message",
    [
        ({**SGLANG_BUILD, "parallelism": {"tensor": 0}}, "tensor"),
        ({**SGLANG_BUILD, "parallelism": {"tensor": 1.5}}, "tensor"),
        ({"parallelism": {"tensor": 2}}, "/parallelism/tensor': value must be 1"),  # embedded runs on one device
        ({**SGLANG_BUILD, "parallelism": {"tensor": 4, "pipeline": 3}}, "do not fit nodes of gpu.perNode=8"),
        (
            {**SGLANG_BUILD, "backend": "tensorrt-llm", "parallelism": {"tensor": 8, "pipeline": 2}},
            "multi-node TensorRT-LLM",
        ),
        ({"backend": "sglang"}, "engine.source=demo"),
        ({"backend": "sglang", "engine": {"source": "build"}}, "model.pvc.claimName"),
        (
            {"backend": "sglang", "engine": {"source": "build"}, "model": {"source": "huggingface"}},
            "model.huggingface.target",
        ),
        ({**SGLANG_BUILD, "parallelism": {"tensor": 3}}, "do not divide the 8 GPUs of a node"),
        (
            {"backend": "sglang", "engine": {"source": "prebuilt", "path": "/engines/x"}},
            "needs engine.cache.existingClaim",
        ),
        (
            {
                "backend": "sglang",
                "engine": {"source": "prebuilt", "path": "/engines/x", "cache": {"existingClaim": "e"}},
            },
            "mounted at /engine-cache",
        ),
        (
            {"autoscaling": {"enabled": True, "mode": "prometheus-adapter", "minReplicas": 5, "maxReplicas": 2}},
            "minReplicas 5 exceeds maxReplicas 2",
        ),
        ({"autoscaling": {"enabled": True, "mode": "keda"}}, "set monitoring.serviceMonitor.enabled=true"),
        (
            {**SGLANG_BUILD, "backend": "tensorrt-llm", "apiKey": {"existingSecret": "k"}},
            "trtllm-serve takes no API key",
        ),
        (
            {**SGLANG_BUILD, "backend": "tensorrt-llm", "server": {"servedModelName": "meta-llama/Llama-3-8B"}},
            "cannot hold a '/'",
        ),
        ({"replicas": 3}, "replicas"),
        ({"router": {"enabled": True}}, "router.enabled"),
        ({**SGLANG_BUILD, "router": {"enabled": True}, "inferencePool": {"enabled": True}}, "choose one"),
        ({"gpu": {"perNode": 0}}, "perNode"),
        ({"model": {"scratch": {"size": "1Gi"}}}, "scratch"),  # the model cache replaced it
    ],
)
def test_values_that_must_be_refused_are_refused(chart, values, message):
    with pytest.raises(HelmRefused, match=message):
        chart.render(values)


@pytest.mark.parametrize(
    "values, api",
    [
        ({**SGLANG_BUILD, "parallelism": {"tensor": 16}}, "leaderworkerset.x-k8s.io/v1"),
        (
            {"autoscaling": {"enabled": True, "mode": "keda"}, "monitoring": {"serviceMonitor": {"enabled": True}}},
            "keda.sh/v1alpha1",
        ),
        ({"autoscaling": {"enabled": True, "mode": "prometheus-adapter"}}, "custom.metrics.k8s.io/v1beta1"),
        ({"monitoring": {"podMonitor": {"enabled": True}}}, "monitoring.coreos.com/v1"),
        ({"httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]}}, "gateway.networking.k8s.io/v1"),
        ({"inferencePool": {"enabled": True}}, "inference.networking.k8s.io/v1"),
    ],
)
def test_custom_resources_without_their_api_warn_and_refuse_only_when_asked(chart, values, api):
    """Rendered without a cluster (GitOps tools, CI), a custom resource whose API is not known renders and the notes
    name what to install; apiCheck=require refuses to install without it; lint is never refused."""
    others = [a for a in CHART_APIS if a != api]
    kinds = {d["kind"] for d in chart.render(values, api_versions=others)}
    assert kinds & {
        "LeaderWorkerSet",
        "ScaledObject",
        "HorizontalPodAutoscaler",
        "PodMonitor",
        "HTTPRoute",
        "InferencePool",
    }
    notes = chart.notes(values)
    assert "WARNING: " in notes and f"the cluster serves no {api} API" in notes and f"--api-versions {api}" in notes
    strict = {**values, "apiCheck": "require"}
    with pytest.raises(HelmRefused, match=f"the cluster serves no {api} API") as refused:
        chart.render(strict, api_versions=others)
    assert "apiCheck=require" in str(refused.value)
    assert chart.render(strict, api_versions=[api, *others])
    assert "WARNING" not in chart.notes({})  # nothing missing: no warning
    proc = chart.lint(strict)  # lint has no cluster to ask: it leaves the check to install
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_renders_without_a_cluster(chart, path):
    """Plain `helm template` (no --api-versions), as a GitOps tool or a CI pipeline runs it."""
    assert chart.render(example(path), api_versions=())


def test_keda_reads_the_queue_through_whichever_monitor_scrapes_it(chart):
    def query(monitoring: dict) -> str:
        docs = chart.render({"autoscaling": {"enabled": True, "mode": "keda"}, "monitoring": monitoring})
        [scaled] = [d for d in docs if d["kind"] == "ScaledObject"]
        return scaled["spec"]["triggers"][0]["metadata"]["query"]

    assert query({"serviceMonitor": {"enabled": True}}) == (
        'sum(specdec:num_requests_waiting{namespace="llm", service="specdec"})'
    )
    assert (
        query({"podMonitor": {"enabled": True}})
        == 'sum(specdec:num_requests_waiting{namespace="llm", job="llm/specdec"})'
    )


def test_inference_pool_and_its_endpoint_picker(chart, demo_engine):
    """The pool selects the serving pods; the picker's config refers to plugins it declares; and the metrics it reads
    from the kit's own server exist there (checked against the real server)."""
    from server_helpers import Server

    values = {
        "inferencePool": {"enabled": True},
        "replicaCount": 2,
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw", "namespace": "gateway-system"}]},
    }
    docs = chart.render(values)
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    jsonschema.validate(pool, CRD_SCHEMAS["InferencePool"])
    check_inference_pool_rules(pool)
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "specdec")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [
        {"number": server(deployment["spec"]["template"]["spec"])["ports"][0]["containerPort"]}
    ]
    service = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"]
    )
    assert service["spec"]["ports"][0]["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"]
    picker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "specdec-epp")
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--pool-name=specdec" in args and "--pool-namespace=llm" in args
    config = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["epp.yaml"])
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = {r["pluginRef"] for prof in config["schedulingProfiles"] for r in prof["plugins"]}
    refs |= {s["pluginRef"] for s in config["dataLayer"]["sources"]}
    refs |= {e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]}
    assert refs <= declared
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    [engine] = extractor["engineConfigs"]
    assert engine["name"] == extractor["defaultEngine"] == "specdec"
    route = next(d for d in docs if d["kind"] == "HTTPRoute")["spec"]["rules"][0]["backendRefs"][0]
    assert (route["kind"], route["name"]) == ("InferencePool", pool["metadata"]["name"])
    srv = Server(demo_engine)
    try:
        srv.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        names = {
            line.split("{")[0].split(" ")[0]
            for line in httpx.get(srv.url + "/metrics").text.splitlines()
            if line and not line.startswith("#")
        }
        metrics = srv.metrics()
    finally:
        srv.stop()
    for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        assert engine[spec] in names, f"{engine[spec]} is not among the server's metrics"
    usage = next(v for k, v in metrics.items() if k.startswith("specdec:kv_cache_usage_perc"))
    assert 0.0 <= usage <= 1.0


def test_endpoint_picker_replicas_elect_a_leader(chart):
    """Several pickers elect one leader: the flag, the lease rights, probes the picker answers per role (readiness on the
    leader alone, so the Service reaches only it), a disruption budget; one picker runs without any of it. The pool
    fails open by default (serving goes on while no picker answers)."""

    def picker_docs(replicas: int) -> tuple[dict, dict, list[dict]]:
        docs = chart.render({"inferencePool": {"enabled": True, "endpointPicker": {"replicas": replicas}}})
        picker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "specdec-epp")
        role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "specdec-epp")
        budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "specdec-epp"]
        pool = next(d for d in docs if d["kind"] == "InferencePool")
        assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
        return picker, role, budgets

    picker, role, budgets = picker_docs(2)
    container = picker["spec"]["template"]["spec"]["containers"][0]
    assert picker["spec"]["replicas"] == 2 and "--ha-enable-leader-election" in container["args"]
    assert (container["livenessProbe"]["grpc"]["service"], container["readinessProbe"]["grpc"]["service"]) == (
        "liveness",
        "readiness",
    )
    leases = [r for r in role["rules"] if r["apiGroups"] == ["coordination.k8s.io"]]
    assert leases and {"get", "create", "update"} <= set(leases[0]["verbs"])
    [budget] = budgets
    assert budget["spec"]["selector"]["matchLabels"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    assert budget["spec"]["minAvailable"] == 1

    picker, role, budgets = picker_docs(1)
    container = picker["spec"]["template"]["spec"]["containers"][0]
    assert "--ha-enable-leader-election" not in container["args"] and not budgets
    assert container["readinessProbe"]["grpc"]["service"] == "inference-extension"
    assert not [r for r in role["rules"] if r["apiGroups"] == ["coordination.k8s.io"]]


def test_helm_tests_speculation_check_passes_a_speculating_server_and_fails_one_without(chart, demo_engine):
    """The `helm test` pod that checks speculation, run as is against the kit's real server (its URL swapped in)."""
    from server_helpers import Server

    script = speculation_script(chart.render({"tests": {"speculationDeadlineSeconds": 5}}))
    assert "http://specdec:8000" in script
    for extra, speculating in (((), True), (("--speculation", "off"), False)):
        srv = Server(demo_engine, *extra)
        try:
            check_speculation(script, srv.url, speculating)
        finally:
            srv.stop()


class RouterStandIn:
    """What the `helm test` pods see of SGLang's router on the service port: the OpenAI routes, forwarded to a worker;
    no /server_info and no /metrics (404: the router serves its metrics on a port of its own)."""

    def __init__(self, worker: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                if not self.path.startswith("/v1/"):
                    self.send_error(404)
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                reply = httpx.request(method, worker + self.path, content=body, headers=headers, timeout=120)
                self.send_response(reply.status_code)
                self.send_header("Content-Type", reply.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


def test_helm_tests_speculation_check_passes_through_the_router(chart, demo_engine):
    """With the router on, the `helm test` pods send their traffic through it and read /server_info and the metrics
    from the servers' own Service (the router answers neither): the SGLang + router check, run against a stand-in
    router in front of the kit's real server, with the kit's server's metric names swapped in for SGLang's."""
    from server_helpers import Server

    docs = chart.render({**SGLANG_BUILD, "router": {"enabled": True}, "tests": {"speculationDeadlineSeconds": 5}})
    script = speculation_script(docs)
    assert "http://specdec-router:8000" in script and "http://specdec:8000" in script
    sglang = json.dumps(json.dumps(speculation_check(chart, {**SGLANG_BUILD, "router": {"enabled": True}})))
    kit = json.dumps(json.dumps(speculation_check(chart, {})))
    assert sglang in script
    script = script.replace(sglang, kit)
    srv = Server(demo_engine)
    router = RouterStandIn(srv.url)
    try:
        assert httpx.get(router.url + "/metrics").status_code == 404
        check_speculation(script.replace("http://specdec-router:8000", router.url), srv.url, speculating=True)
        # the check as it was, reading everything through the router, cannot pass
        blind = script.replace("base=direct", "base=url").replace("http://specdec-router:8000", router.url)
        proc = subprocess.run(
            [sys.executable, "-c", blind.replace("http://specdec:8000", srv.url)], capture_output=True, text=True
        )
        assert proc.returncode != 0 and "404" in proc.stderr, proc.stdout + proc.stderr
    finally:
        router.stop()
        srv.stop()


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"replicaCount": 2, "inferencePool": {"enabled": True}},
        {**SGLANG_BUILD, "router": {"enabled": True}, "replicaCount": 2},
        *[example(p) for p in EXAMPLES],
    ],
    ids=["defaults", "inference-pool", "sglang-router", *[p.stem for p in EXAMPLES]],
)
def test_helm_test_pods_are_never_selected_for_traffic(chart, values):
    """No Service, workload, InferencePool or router discovery selects the `helm test` pods (they would be sent live
    requests); each serving pod template is selected by its workload."""
    docs = chart.render(values)
    selectors = []
    for d in docs:
        spec = d.get("spec", {})
        if d["kind"] == "Service":
            selectors.append(spec.get("selector") or {})
        elif d["kind"] in ("Deployment", "InferencePool"):
            selectors.append(spec["selector"]["matchLabels"])
        if d["kind"] == "Deployment":
            for c in spec["template"]["spec"]["containers"]:
                args = c.get("args", [])
                if "--selector" in args:  # the router's service discovery: key=value pairs up to the next flag
                    pairs = list(
                        itertools.takewhile(lambda a: not a.startswith("--"), args[args.index("--selector") + 1 :])
                    )
                    selectors.append(dict(p.split("=", 1) for p in pairs))
    tests = [
        d for d in docs if d["kind"] == "Pod" and d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    assert tests and selectors
    for pod in tests:
        labels = pod["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "specdec"
        for selector in selectors:
            assert selector and not selector.items() <= labels.items(), (pod["metadata"]["name"], selector)


def test_pod_labels_and_annotations_reach_every_serving_pod(chart):
    """podLabels and podAnnotations (a Multus network for RDMA, say) on single pods, leaders and workers alike."""
    values = {
        **SGLANG_BUILD,
        "parallelism": {"tensor": 16},
        "podLabels": {"team": "llm"},
        "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
    }
    for extra in ({}, {"parallelism": {"tensor": 4}}):
        docs = chart.render({**values, **extra})
        templates = []
        for d in docs:
            if d["kind"] == "Deployment" and d["metadata"]["name"] == "specdec":
                templates.append(d["spec"]["template"])
            if d["kind"] == "LeaderWorkerSet":
                lws = d["spec"]["leaderWorkerTemplate"]
                templates += [lws["leaderTemplate"], lws["workerTemplate"]]
        assert len(templates) == (1 if extra else 2)
        for tmpl in templates:
            assert tmpl["metadata"]["labels"]["team"] == "llm"
            assert tmpl["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
            assert tmpl["metadata"]["annotations"]["specdec.io/engine"].startswith("/engine-cache/")


def test_multi_node_replicas_get_rdma_nccl_settings_placement_and_rollout(chart):
    """RDMA devices and IPC_LOCK (the one capability added to those dropped) on leaders and workers, the NCCL
    environment, LWS exclusive placement and rollout; none of it on single-node replicas."""
    values = {
        **SGLANG_BUILD,
        "parallelism": {"tensor": 16},
        "rollout": {"maxUnavailable": 0, "maxSurge": 1},
        "multiNode": {
            "exclusiveTopology": "network.example.com/ib-domain",
            "rdma": {"enabled": True, "resourceName": "rdma/ib", "count": 2},
            "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
        },
    }
    docs = chart.render(values)
    [lws] = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    assert (
        lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"]
        == "network.example.com/ib-domain"
    )
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 0, "maxSurge": 1}
    pods = pods_of(docs)
    assert [role for role, _ in pods] == ["leader", "worker"]
    for _, spec in pods:
        container = server(spec)
        for part in ("requests", "limits"):
            assert container["resources"][part]["rdma/ib"] == 2 and container["resources"][part]["nvidia.com/gpu"] == 8
        assert container["resources"]["limits"]["memory"] == "256Gi"  # the limits' own, not the requests'
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in container["env"]
    single = server(pods_of(chart.render({**values, "parallelism": {"tensor": 8}}))[0][1])
    assert "rdma/ib" not in single["resources"]["requests"] and "add" not in single["securityContext"]["capabilities"]
    assert all(e["name"] != "NCCL_IB_HCA" for e in single["env"])


def test_upgrades_roll_replicas_on_every_backend(chart):
    """No backend's upgrade recreates every replica at once: GPU backends roll one replica at a time without spare
    GPUs (or with a surge where asked), the CPU one surges; the rollout waits out an engine build without being
    declared stalled; an update that could replace nothing is refused."""

    def strategy(values: dict) -> tuple[dict, int]:
        [deployment] = [
            d for d in chart.render(values) if d["kind"] == "Deployment" and d["metadata"]["name"] == "specdec"
        ]
        return deployment["spec"]["strategy"], deployment["spec"]["progressDeadlineSeconds"]

    for backend in ("sglang", "vllm", "tensorrt-llm"):
        rolling, deadline = strategy({**SGLANG_BUILD, "backend": backend})
        assert rolling == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        assert deadline > 14400 + 3600  # the build's deadline and the start-up probe's budget
    assert strategy({})[0]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    surge = {**SGLANG_BUILD, "rollout": {"maxSurge": 1, "maxUnavailable": 0}}
    assert strategy(surge)[0]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    with pytest.raises(HelmRefused, match="could never replace a replica"):
        chart.render({**SGLANG_BUILD, "rollout": {"maxSurge": 0, "maxUnavailable": 0}})


def speculation_check(chart: HelmChart, values: dict) -> dict:
    """What the speculation check of a backend reads (its configuration, embedded in the test pod's script)."""
    script = speculation_script(chart.render(values))
    return json.loads(json.loads(script.split("spec, deadline = json.loads(", 1)[1].split("), time.time()", 1)[0]))


def test_every_backend_has_a_speculation_check(chart):
    checks = {
        backend: speculation_check(chart, {**SGLANG_BUILD, "backend": backend})
        for backend in ("sglang", "vllm", "tensorrt-llm")
    }
    assert checks["sglang"] == {"info": "/server_info", "metrics": "/metrics", "gauge": "sglang:spec_accept_length"}
    assert checks["tensorrt-llm"]["metrics"] == "/prometheus/metrics"  # mounted by the export's return_perf_metrics
    assert checks["tensorrt-llm"]["gauge"] == "trtllm_spec_decode_acceptance_length"
    assert checks["vllm"]["accepted"] == "vllm:spec_decode_num_accepted_tokens_total"


def test_notes_say_how_to_reach_test_and_load_test(chart):
    text = chart.notes(example(CHART / "ci" / "values-sglang-a100.yaml"))
    assert "port-forward svc/specdec" in text and "helm test specdec" in text and "locust -f loadtest/chat.py" in text
    assert "2 replica(s) x 1 GPU(s)" in text and "logs -f job/specdec-build-" in text
    cpu = chart.notes({})
    assert "1 replica(s) on CPU." in cpu and "GPU" not in cpu.split("Engine:")[0]


def test_dockerfiles_are_hadolint_clean_and_pinned():
    hadolint = Path(sys.executable).parent / "hadolint"
    for dockerfile in sorted((REPO / "build").glob("*.Dockerfile")):
        proc = subprocess.run([str(hadolint), str(dockerfile)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{dockerfile.name}: {proc.stdout}{proc.stderr}"
        text = dockerfile.read_text()
        assert "USER 10001" in text and "org.opencontainers.image.version" in text
        assert ":latest" not in text
    sglang_base = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", (REPO / "build" / "sglang.Dockerfile").read_text(), re.M)
    assert sglang_base and sglang_base.group(1) == f"lmsysorg/sglang:v{SGLANG_CHECKED}"
    assert "tensorrt-llm/release:1.3.0rc24" in (REPO / "build" / "tensorrt-llm.Dockerfile").read_text()
    assert "vllm/vllm-openai:v0.32.0" in (REPO / "build" / "vllm.Dockerfile").read_text()
    assert "torch==2.13.0" in (REPO / "build" / "cpu.Dockerfile").read_text()


def test_one_sglang_version_across_image_launcher_and_tier():
    """The SGLang image's base, the version the engine's launcher checks for and the SGLang tier's pin agree (the
    tier's checks stand for what the image runs); another version gets the launcher's warning."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sglang_launch", REPO / "export" / "plugins" / "sglang" / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    assert launch.CHECKED_VERSION == SGLANG_CHECKED
    pin = re.search(r"SGLANG_SPEC:-sglang==([\w.]+)", (REPO / "scripts" / "setup_sglang.sh").read_text())
    assert pin and pin.group(1) == SGLANG_CHECKED
    assert launch.version_note(SGLANG_CHECKED) is None
    note = launch.version_note("0.5.19")
    assert note and "0.5.19" in note and SGLANG_CHECKED in note


def test_build_script_refuses_without_a_docker_engine(tmp_path):
    env = dict(os.environ, DOCKER_HOST="unix:///nonexistent/docker.sock")
    proc = subprocess.run(["bash", str(REPO / "build" / "build.sh"), "cpu"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "no Docker engine" in proc.stderr


def test_values_files_pass_yamllint():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "yamllint",
            "-d",
            "{extends: relaxed, rules: {line-length: {max: 130}}}",
            str(CHART / "values.yaml"),
            str(CHART / "Chart.yaml"),
            *map(str, EXAMPLES),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


def test_the_chart_readme_lists_every_value():
    """helm/README.md's values table is the one generated from the schema (and every value has a description)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "helm_values_table.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    schema = json.loads((CHART / "values.schema.json").read_text())
    undescribed = [k for k, v in schema["properties"].items() if "description" not in v]
    assert undescribed == [], undescribed


@pytest.mark.parametrize("source", ["pvc", "huggingface", "s3"])
@pytest.mark.parametrize("backend", ["vllm", "sglang", "tensorrt-llm"])
def test_a_model_free_draft_builds_from_the_target_alone(chart, backend, source):
    """``engine.draft: ngram`` (or suffix) needs no draft checkpoint: the chart asks for none, fetches none and builds
    without ``--draft-path``; a head still needs its own."""
    where = {"pvc": {"claimName": "m"}, "huggingface": {"target": "org/model"}, "s3": {"target": "s3://b/model"}}
    values = {
        "backend": backend,
        "engine": {"source": "build", "draft": "ngram"},
        "model": {"source": source, source: where[source]},
    }
    docs = chart.render(values)
    args = next(c for c in build_job(docs)["spec"]["template"]["spec"]["containers"] if c["name"] == "build-engine")[
        "args"
    ]
    assert "--draft=ngram" in args and not any(a.startswith("--draft-path") for a in args)
    fetch = [
        c for c in build_job(docs)["spec"]["template"]["spec"].get("initContainers", []) if c["name"] == "fetch-models"
    ]
    if source != "pvc":
        env = {e["name"]: e.get("value") for e in fetch[0]["env"]}
        assert env["DRAFT"] == ""  # the fetch skips an empty draft
    if source != "pvc":
        with pytest.raises(
            HelmRefused, match=f"model.source={source} needs model.{source}.target and model.{source}.draft"
        ):
            chart.render({**values, "engine": {"source": "build", "draft": "griffin"}})


def test_the_hugging_face_fetch_takes_the_checkpoint_not_the_repositorys_other_copies(chart, monkeypatch, tmp_path):
    """The build Job's fetch script, run as rendered (the Hub itself is out of reach here: snapshot_download records
    its call), filtered by huggingface_hub's own pattern matching over a Llama repository's files: the safetensors
    checkpoint and its configs come, Meta's original/*.pth do not; a second run finds both models cached."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    values = {**SGLANG_BUILD, "model": {"source": "huggingface", "huggingface": {"target": "org/t", "draft": "org/d"}}}
    [fetch] = [c for c in build_job(chart.render(values))["spec"]["template"]["spec"]["initContainers"]]
    repo_files = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "original/consolidated.00.pth",
        "original/params.json",
    ]
    calls = []

    def snapshot_download(repo, local_dir, token=None, ignore_patterns=None):
        calls.append(repo)
        kept = list(filter_repo_objects(repo_files, ignore_patterns=ignore_patterns))
        assert kept == repo_files[:4], kept
        Path(local_dir).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    for e in fetch["env"]:
        if "value" in e:
            monkeypatch.setenv(
                e["name"], str(tmp_path / e["value"].lstrip("/")) if e["name"].endswith("_DIR") else e["value"]
            )
    for _ in range(2):
        exec(fetch["args"][0], {})
    assert calls == ["org/t", "org/d"]


def test_trees_an_engine_refuses_are_refused_at_render_time_as_the_builder_refuses_them(chart):
    """TensorRT-LLM's dynamic-tree bounds and SGLang's dynamic trees only (and model-free drafts' budgets), checked by
    the chart before any Job runs, on the same grid as the builder's own checks."""
    from specdec_kit.export.inputs import BuildError
    from specdec_kit.export.servers.common import engine_form
    from specdec_kit.export.trtllm_pytorch import speculative_config
    from specdec_kit.runtime.core.trees import DynamicTreeConfig

    form = engine_form("eagle3", "tensorrt-llm")
    for total, depth, top_k in ((60, 5, 10), (80, 5, 10), (4, 5, 10), (7, 5, 1), (8, 5, 1), (13, 5, 2)):
        values = {**SGLANG_BUILD, "backend": "tensorrt-llm", "engine": {"source": "build", "draft": "eagle3"}}
        values["engine"].update(totalTokens=total, depth=depth, topK=top_k)
        try:
            speculative_config(DynamicTreeConfig(total, depth, top_k), [1], form)
            builder = None
        except (BuildError, ValueError) as exc:  # the tree's own bounds, then TensorRT-LLM's
            builder = str(exc)
        try:
            chart.render(values)
            rendered = None
        except HelmRefused as exc:
            rendered = str(exc)
        assert (builder is None) == (rendered is None), (total, depth, top_k, builder, rendered)
        if builder:  # the same reason
            reason = (
                "candidates that depth" if "candidates" in builder else "max_draft_len (6) <= max_total_draft_tokens"
            )
            assert reason in builder and reason in rendered, (builder, rendered)
    static = {"engine": {"source": "build", "tree": "static:mc_sim_7b_63"}}
    with pytest.raises(HelmRefused, match="SGLang drafts dynamic trees only"):
        chart.render({**SGLANG_BUILD, **static})
    with pytest.raises(HelmRefused, match="draft ngram drafts dynamic trees only"):
        chart.render({**SGLANG_BUILD, "backend": "vllm", "engine": {**static["engine"], "draft": "ngram"}})
    assert chart.render({**SGLANG_BUILD, "backend": "vllm", **static})  # a head on vLLM: its tree's longest path


def dashboard_series(chart: HelmChart, values: dict) -> dict[str, set[str]]:
    """Per panel of the rendered Grafana dashboard, the series its queries read."""
    docs = chart.render({**values, "monitoring": {"dashboard": {"enabled": True}}})
    dashboard = json.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["specdec.json"])
    return {
        p["title"]: {m for t in p["targets"] for m in re.findall(r"[a-z_]+:[a-z_]+|trtllm_[a-z_]+", t["expr"])}
        for p in dashboard["panels"]
    }


def test_the_dashboard_reads_each_backends_own_metrics(chart, vllm_python):
    """vLLM's and SGLang's dashboards read series those engines define (their names found in the installed engines'
    metric code, less the _total / _bucket a counter or histogram adds); TensorRT-LLM's read only trtllm_ series;
    each keeps its latency, throughput, acceptance and queue panels."""
    from conftest import sglang_python

    sources = {}
    for backend, python, package in (("vllm", vllm_python, "vllm"), ("sglang", sglang_python(), "sglang")):
        where = subprocess.run(
            [python, "-c", f"import {package}, os; print(os.path.dirname({package}.__file__))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        metric_code = [p for p in Path(where).rglob("*.py") if "metric" in str(p.relative_to(where))]
        sources[backend] = "\n".join(p.read_text(errors="ignore") for p in metric_code)
    for backend in ("vllm", "sglang", "tensorrt-llm"):
        panels = dashboard_series(chart, {**SGLANG_BUILD, "backend": backend})
        assert {"Time to first token", "Throughput", "Acceptance length", "Requests running / waiting"} <= set(panels)
        series = set().union(*panels.values())
        assert not any(s.startswith("specdec:") for s in series), series
        for s in series:
            base = re.sub(r"_(total|bucket)$", "", s)
            if backend == "tensorrt-llm":
                assert s.startswith("trtllm_"), s
            else:
                named = f'"{base}"' in sources[backend] or f'"{s}"' in sources[backend]  # a counter's _total, or not
                assert named, f"{backend}: {s} is not among the engine's metrics"
    assert all(s.startswith("specdec:") for s in set().union(*dashboard_series(chart, {}).values()))


def test_priority_env_from_volumes_and_placement_of_router_and_picker(chart):
    """priorityClassName on the serving pods (leaders and workers too), the router and the endpoint picker; the
    server's envFrom and extra volumes; the router's and picker's own nodeSelector, tolerations and affinity."""
    tolerate = [{"key": "cpu-only", "operator": "Exists", "effect": "NoSchedule"}]
    values = {
        **SGLANG_BUILD,
        "priorityClassName": "llm-serving",
        "server": {"envFrom": [{"secretRef": {"name": "server-env"}}]},
        "extraVolumes": [{"name": "ca", "configMap": {"name": "ca-bundle"}}],
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/custom", "readOnly": True}],
        "router": {"enabled": True, "nodeSelector": {"pool": "cpu"}, "tolerations": tolerate},
    }
    for layout in ({}, {"parallelism": {"tensor": 16}}):
        docs = chart.render({**values, **layout})
        for _, spec in pods_of(docs):
            assert spec["priorityClassName"] == "llm-serving"
            assert {"name": "ca", "configMap": {"name": "ca-bundle"}} in spec["volumes"]
            assert {"name": "ca", "mountPath": "/etc/ssl/custom", "readOnly": True} in server(spec)["volumeMounts"]
            assert server(spec)["envFrom"] == [{"secretRef": {"name": "server-env"}}]
        router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "specdec-router")
        spec = router["spec"]["template"]["spec"]
        assert spec["priorityClassName"] == "llm-serving" and spec["nodeSelector"] == {"pool": "cpu"}
        assert spec["tolerations"] == tolerate
    pool = {"inferencePool": {"enabled": True, "endpointPicker": {"affinity": {"podAntiAffinity": {}}}}}
    picker = next(
        d
        for d in chart.render({**pool, "priorityClassName": "p"})
        if d["metadata"]["name"] == "specdec-epp" and d["kind"] == "Deployment"
    )
    assert picker["spec"]["template"]["spec"]["priorityClassName"] == "p"
    assert picker["spec"]["template"]["spec"]["affinity"] == {"podAntiAffinity": {}}


def test_a_gpu_engine_built_on_a_cpu_node_keeps_the_checkpoints_precision(chart):
    """engine.dtype auto: the GPU backends' build Job asks the builder for the checkpoint's precision (the Job runs on
    a CPU node, where the builder's own auto would pick float32 for vLLM); the CPU backend keeps auto."""

    def dtype(values: dict) -> str:
        args = next(c for c in build_job(chart.render(values))["spec"]["template"]["spec"]["containers"])["args"]
        return next(a for a in args if a.startswith("--dtype="))

    for backend in ("sglang", "vllm", "tensorrt-llm"):
        assert dtype({**SGLANG_BUILD, "backend": backend}) == "--dtype=checkpoint"
        assert dtype({**SGLANG_BUILD, "backend": backend, "engine": {"source": "build", "dtype": "float16"}}) == (
            "--dtype=float16"
        )
    assert dtype({"engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}}}) == "--dtype=auto"
