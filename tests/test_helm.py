"""The chart, rendered by real Helm (helm-python-sdk, Helm v4's own Go code) without a cluster: lint,
Kubernetes schemas for every manifest (custom resources against their own schemas, by kind), the
essentials of GPU deployments, refused values, golden outputs; and the images' Dockerfiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate as kv
import pytest
import yaml
from helm_python.chart import Chart, lint
from helm_python.errors import HelmError

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm"
EXAMPLES = sorted((CHART / "ci").glob("values-*.yaml"))
GOLDEN = Path(__file__).resolve().parent / "golden" / "helm"
CRD_SCHEMAS = {p.stem: json.loads(p.read_text()) for p in (Path(__file__).resolve().parent / "schemas").glob("*.json")}
K8S_VERSION = "1.33.0"


def render(chart: Chart, values: dict) -> list[dict]:
    out = chart.render(values, name="specdec", namespace="llm")
    docs = []
    for path in sorted(out):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(out[path]) if d]
    return docs


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


def server(spec: dict) -> dict:
    return next(c for c in spec["containers"] if c["name"] == "server")


def test_lint_is_clean():
    report = lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    for path in EXAMPLES:
        report = lint(str(CHART), example(path), strict=True)
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], path.name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_manifest_validates(chart, path):
    docs = render(chart, example(path))
    assert docs
    for doc in docs:
        kind = doc["kind"]
        if kind in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[kind])
            if kind == "LeaderWorkerSet":  # its pod templates are core Pods: check them with Kubernetes' schema
                for part in ("leaderTemplate", "workerTemplate"):
                    tmpl = doc["spec"]["leaderWorkerTemplate"][part]
                    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **tmpl.get("metadata", {})},
                           "spec": tmpl["spec"]}
                    kv.validate(pod, K8S_VERSION, strict=True)
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.SchemaNotFoundError:
            pytest.fail(f"{path.name}: {kind} has neither a Kubernetes schema nor one in tests/schemas")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_output_matches_golden(chart, path):
    text = yaml.safe_dump_all(render(chart, example(path)), sort_keys=True)
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("SPECDEC_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"{golden} missing: run with SPECDEC_UPDATE_GOLDEN=1 and review the diff"
    assert text == golden.read_text(), f"{path.name}: rendering changed; if intended, regenerate with SPECDEC_UPDATE_GOLDEN=1"


def test_defaults_are_the_cpu_demo(chart):
    docs = render(chart, {})
    [(role, spec)] = pods_of(docs)
    c = server(spec)
    assert c["image"] == "specdec:0.1.0-cpu" and "--engine=/opt/specdec/engines/griffin-onnxruntime" in c["args"]
    assert "nvidia.com/gpu" not in json.dumps(spec) and "nodeSelector" not in spec
    assert not any(v["name"] == "shm" for v in spec["volumes"])
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget", "Pod"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_gpu_essentials(chart, path):
    values = example(path)
    docs = render(chart, values)
    merged = chart.merge_values(values)
    tp, pp = merged["parallelism"]["tensor"], merged["parallelism"]["pipeline"]
    gpu_backend = merged["backend"] != "embedded"
    pods = pods_of(docs)
    per_pod = []
    for role, spec in pods:
        c = server(spec)
        assert spec["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep" and spec["terminationGracePeriodSeconds"] >= 30
        if role != "worker":
            assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["path"] in ("/health/ready", "/health_generate", "/health")
        else:
            assert "readinessProbe" not in c
        if gpu_backend:
            gpus = c["resources"]["limits"]["nvidia.com/gpu"]
            assert gpus == c["resources"]["requests"]["nvidia.com/gpu"]
            per_pod.append(gpus)
            assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
            build = next((i for i in spec.get("initContainers", []) if i["name"] == "build-engine"), None)
            if role == "worker":  # the leader builds its group's engine; workers wait for its manifest
                assert build is None
            else:
                assert build is not None and build["resources"]["limits"]["nvidia.com/gpu"] == gpus  # on the GPU node
                assert f"--tp={tp}" in build["args"] and f"--pp={pp}" in build["args"]
        has_shm = any(v["name"] == "shm" and v["emptyDir"]["medium"] == "Memory" for v in spec["volumes"])
        assert has_shm == (tp * pp > 1)
    if gpu_backend:
        lws = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
        nodes = lws[0]["spec"]["leaderWorkerTemplate"]["size"] if lws else 1
        assert per_pod[0] * nodes == tp * pp  # GPUs per replica = TP x PP
        assert bool(lws) == (tp * pp > merged["gpu"]["perNode"])


def test_feature_switches(chart):
    docs = {d["kind"]: d for d in render(chart, example(CHART / "ci" / "values-sglang-a100.yaml"))}
    assert docs["ScaledObject"]["spec"]["triggers"][0]["metadata"]["query"].startswith("sum(sglang:num_queue_reqs{")
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    dashboard = json.loads(docs["ConfigMap"]["data"]["specdec.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Time to first token", "Inter-token latency (per token)", "Throughput", "Acceptance length"} <= titles
    env = server(docs["Deployment"]["spec"]["template"]["spec"])["env"]
    assert {"name": "SPECDEC_API_KEY", "valueFrom": {"secretKeyRef": {"name": "specdec-api-key", "key": "api-key"}}} in env
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]  # shared by 2 replicas
    multi = render(chart, example(CHART / "ci" / "values-multinode-tp16.yaml"))
    leader = next(spec for role, spec in pods_of(multi) if role == "leader")
    assert "--nnodes=2" in server(leader)["args"] and "--node-rank=$(LWS_WORKER_INDEX)" in server(leader)["args"]
    assert any(d["kind"] == "Role" and d["rules"][0]["resources"] == ["pods"] for d in multi)
    worker = next(spec for role, spec in pods_of(multi) if role == "worker")  # one builder per group: the leader
    assert [c["name"] for c in leader["initContainers"]] == ["fetch-models", "build-engine"]
    assert [c["name"] for c in worker["initContainers"]] == ["wait-for-engine"]
    assert "manifest.json" in worker["initContainers"][0]["command"][2]
    spread = leader["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["labelSelector"]["matchLabels"]
    pdb = next(d for d in multi if d["kind"] == "PodDisruptionBudget")  # leaders and workers of every group
    assert pdb["spec"]["selector"]["matchExpressions"] == [{"key": "specdec.io/role", "operator": "In",
                                                           "values": ["leader", "worker"]}]
    trt = {d["kind"]: d for d in render(chart, example(CHART / "ci" / "values-trtllm-tp4.yaml"))}
    assert trt["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    fetch = next(i for i in trt["Deployment"]["spec"]["template"]["spec"]["initContainers"] if i["name"] == "fetch-models")
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in fetch["env"]


def test_engine_cache_key_changes_with_every_build_input(chart):
    def engine_path(values: dict) -> str:
        spec = next(spec for _, spec in pods_of(render(chart, values)))
        return next(a for a in server(spec)["args"] if a.startswith("--engine="))

    base = {"backend": "sglang", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m", "target": "llama-a"}}}
    same = engine_path(base)
    assert engine_path(base) == same and same.startswith("--engine=/engine-cache/griffin-sglang-tp1-pp1-")
    changed = [{"model": {"pvc": {"claimName": "m", "target": "llama-b"}}}, {"engine": {"source": "build", "depth": 4}},
               {"engine": {"source": "build", "dtype": "bfloat16"}},
               {"engine": {"source": "build", "buildArgs": ["--device=cuda"]}}]
    paths = {engine_path({**base, **c}) for c in changed}
    assert same not in paths and len(paths) == len(changed)


def test_network_policy_admits_what_the_enabled_features_need(chart):
    values = {"networkPolicy": {"enabled": True}, "ingress": {"enabled": True, "hosts": [{"host": "llm.example.com"}]},
              "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw", "namespace": "gateway-system"}]},
              "monitoring": {"podMonitor": {"enabled": True}}}
    policy = next(d for d in render(chart, values) if d["kind"] == "NetworkPolicy")
    peers = [p.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
             for p in policy["spec"]["ingress"][0]["from"]]
    assert peers == [None, "ingress-nginx", "gateway-system", "monitoring"]  # None: the release's own namespace
    plain = next(d for d in render(chart, {"networkPolicy": {"enabled": True}}) if d["kind"] == "NetworkPolicy")
    assert plain["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]


@pytest.mark.parametrize("values, message", [
    ({"backend": "sglang", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}},
      "parallelism": {"tensor": 0}}, "tensor"),
    ({"backend": "sglang", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}},
      "parallelism": {"tensor": 1.5}}, "tensor"),
    ({"parallelism": {"tensor": 2}}, "/parallelism/tensor': value must be 1"),  # embedded runs on one device
    ({"backend": "sglang", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}},
      "parallelism": {"tensor": 4, "pipeline": 3}}, "do not fit nodes of gpu.perNode=8"),
    ({"backend": "tensorrt-llm", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}},
      "parallelism": {"tensor": 8, "pipeline": 2}}, "multi-node TensorRT-LLM"),
    ({"backend": "sglang"}, "engine.source=demo"),
    ({"backend": "sglang", "engine": {"source": "build"}}, "model.pvc.claimName"),
    ({"backend": "sglang", "engine": {"source": "build"}, "model": {"source": "huggingface"}}, "model.huggingface.target"),
    ({"backend": "sglang", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}},
      "parallelism": {"tensor": 3}}, "do not divide the 8 GPUs of a node"),
    ({"backend": "sglang", "engine": {"source": "prebuilt", "path": "/engines/x"}}, "needs engine.cache.existingClaim"),
    ({"backend": "sglang", "engine": {"source": "prebuilt", "path": "/engines/x", "cache": {"existingClaim": "e"}}},
     "mounted at /engine-cache"),
    ({"autoscaling": {"enabled": True, "mode": "prometheus-adapter", "minReplicas": 5, "maxReplicas": 2}},
     "minReplicas 5 exceeds maxReplicas 2"),
    ({"autoscaling": {"enabled": True, "mode": "keda"}}, "set monitoring.serviceMonitor.enabled=true"),
    ({"backend": "tensorrt-llm", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}},
      "apiKey": {"existingSecret": "k"}}, "trtllm-serve takes no API key"),
    ({"replicas": 3}, "replicas"),
    ({"router": {"enabled": True}}, "router.enabled"),
    ({"gpu": {"perNode": 0}}, "perNode"),
])
def test_values_that_must_be_refused_are_refused(chart, values, message):
    with pytest.raises(HelmError, match=message):
        chart.render(values, name="specdec", namespace="llm")


def test_helm_tests_speculation_check_passes_a_speculating_server_and_fails_one_without(chart, demo_engine):
    """The `helm test` pod that checks speculation, run as is against the kit's real server (its URL swapped in)."""
    from server_helpers import Server

    docs = render(chart, {"tests": {"speculationDeadlineSeconds": 20}})
    pod = next(d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"] == "specdec-test-speculation")
    script = pod["spec"]["containers"][0]["args"][0]
    assert "http://specdec:8000" in script
    for extra, passes in (((), True), (("--speculation", "off"), False)):
        server = Server(demo_engine, *extra)
        try:
            proc = subprocess.run([sys.executable, "-c", script.replace("http://specdec:8000", server.url)],
                                  capture_output=True, text=True, timeout=120, env={**os.environ, "API_KEY": ""})
        finally:
            server.stop()
        if passes:
            assert proc.returncode == 0 and "acceptance length:" in proc.stdout, proc.stdout + proc.stderr
        else:
            assert proc.returncode != 0 and "never rose above 1" in proc.stderr, proc.stdout + proc.stderr
    trt = render(chart, {"backend": "tensorrt-llm", "engine": {"source": "build"}, "model": {"pvc": {"claimName": "m"}}})
    assert not any(d["metadata"]["name"] == "specdec-test-speculation" for d in trt)  # trtllm-serve reports neither


def test_notes_say_how_to_reach_test_and_load_test(chart):
    notes = chart.render(example(CHART / "ci" / "values-sglang-a100.yaml"), name="specdec", namespace="llm")
    text = next(v for k, v in notes.items() if k.endswith("NOTES.txt"))
    assert "port-forward svc/specdec" in text and "helm test specdec" in text and "locust -f loadtest/chat.py" in text
    assert "2 replica(s) x 1 GPU(s)" in text
    cpu = next(v for k, v in chart.render({}, name="specdec", namespace="llm").items() if k.endswith("NOTES.txt"))
    assert "1 replica(s) on CPU." in cpu and "GPU" not in cpu.split("Engine:")[0]


def test_dockerfiles_are_hadolint_clean_and_pinned():
    hadolint = Path(sys.executable).parent / "hadolint"
    for dockerfile in sorted((REPO / "build").glob("*.Dockerfile")):
        proc = subprocess.run([str(hadolint), str(dockerfile)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{dockerfile.name}: {proc.stdout}{proc.stderr}"
        text = dockerfile.read_text()
        assert "USER 10001" in text and "org.opencontainers.image.version" in text
        assert ":latest" not in text
    assert "lmsysorg/sglang:v0.5.19-cu129" in (REPO / "build" / "sglang.Dockerfile").read_text()
    assert "tensorrt-llm/release:1.3.0rc24" in (REPO / "build" / "tensorrt-llm.Dockerfile").read_text()
    assert "torch==2.13.0" in (REPO / "build" / "cpu.Dockerfile").read_text()


def test_build_script_refuses_without_a_docker_engine(tmp_path):
    env = dict(os.environ, DOCKER_HOST="unix:///nonexistent/docker.sock")
    proc = subprocess.run(["bash", str(REPO / "build" / "build.sh"), "cpu"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "no Docker engine" in proc.stderr


def test_values_files_pass_yamllint():
    proc = subprocess.run([sys.executable, "-m", "yamllint", "-d", "{extends: relaxed, rules: {line-length: {max: 130}}}",
                           str(CHART / "values.yaml"), str(CHART / "Chart.yaml"), *map(str, EXAMPLES)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
