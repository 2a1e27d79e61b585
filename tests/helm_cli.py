"""The chart driven by a real Helm CLI (Helm v4, from ``scripts/setup_helm.sh``), without a cluster: what
``helm template`` renders, the notes ``helm install`` prints, and ``helm lint``. Helm reads the cluster's API
versions for ``.Capabilities``; here they are given (``--api-versions``), all the chart's custom resources by
default."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable

import yaml
from tiers import missing_tool

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm"
# The API groups of every custom resource the chart can render, as a cluster with their controllers serves them.
CHART_APIS = (
    "leaderworkerset.x-k8s.io/v1",
    "keda.sh/v1alpha1",
    "custom.metrics.k8s.io/v1beta1",
    "monitoring.coreos.com/v1",
    "gateway.networking.k8s.io/v1",
    "inference.networking.k8s.io/v1",
)


class HelmRefused(Exception):
    """Helm exited non-zero; the message is what it printed."""


def helm_binary() -> str:
    helm = os.environ.get("SPECDEC_HELM") or str(REPO / ".tools" / "helm" / "helm")
    if not Path(helm).exists():
        missing_tool(f"helm not found at {helm}: run `bash scripts/setup_helm.sh` (scripts/test.sh does it first)")
    return helm


def deep_merge(base: dict, override: dict) -> dict:
    """Helm's coalescing of user values over the chart's defaults (a null removes a key)."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class HelmChart:
    def __init__(self, path: Path = CHART, helm: str | None = None):
        self.path = path
        self.helm = helm or helm_binary()
        self.home = Path(tempfile.mkdtemp(prefix="specdec-helm-home-"))
        self.defaults = yaml.safe_load((path / "values.yaml").read_text())

    def _run(self, args: list[str], values: dict) -> subprocess.CompletedProcess:
        with tempfile.NamedTemporaryFile("w", suffix=".json", dir=self.home, delete=False) as f:
            json.dump(values, f)
        env = {
            **os.environ,
            "HOME": str(self.home),
            "KUBECONFIG": str(self.home / "no-cluster"),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        try:
            return subprocess.run([self.helm, *args, "-f", f.name], capture_output=True, text=True, env=env, timeout=60)
        finally:
            os.unlink(f.name)

    def render(
        self, values: dict, api_versions: Iterable[str] = CHART_APIS, name: str = "specdec", namespace: str = "llm"
    ) -> list[dict]:
        """Every object ``helm template`` renders (the release's manifests and its hooks, the ``helm test`` pods)."""
        args = ["template", name, str(self.path), "-n", namespace]
        for api in api_versions:
            args += ["--api-versions", api]
        proc = self._run(args, values)
        if proc.returncode:
            raise HelmRefused(proc.stderr.strip())
        return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]

    def notes(self, values: dict, name: str = "specdec", namespace: str = "llm") -> str:
        """NOTES.txt as ``helm install`` prints it (a client-side dry run: only the cluster's built-in APIs, so no
        values that turn on a custom resource)."""
        proc = self._run(["install", name, str(self.path), "--dry-run=client", "-o", "json", "-n", namespace], values)
        if proc.returncode:
            raise HelmRefused(proc.stderr.strip())
        return json.loads(proc.stdout)["info"]["notes"]

    def lint(self, values: dict, strict: bool = True) -> subprocess.CompletedProcess:
        return self._run(["lint", str(self.path), *(["--strict"] if strict else [])], values)

    def merged_values(self, values: dict) -> dict:
        return deep_merge(self.defaults, values)
