"""Server processes for the serving benchmarks: the kit's server and vLLM's OpenAI server, each in a process
group of its own so that stopping it stops vLLM's engine and worker processes too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SERVED_NAME = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """One running server: its label, base URL, process (group leader) and log file."""

    label: str
    url: str
    proc: subprocess.Popen
    log: Path

    def wait_ready(self, route: str, seconds: float) -> None:
        import httpx

        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label}: server exited ({self.proc.returncode}); log {self.log}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + route, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.label}: {self.url}{route} not ready within {seconds:.0f} s; log {self.log}")

    def counters(self, prefix: str) -> dict[str, float]:
        """Every ``prefix*`` sample of /metrics, summed over labels (counters and gauges alike)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for sample in family.samples:
                if sample.name.startswith(prefix):
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        return sums

    def stop(self) -> None:
        stop_group(self.proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM to the process group a server leads (vLLM's engine and workers too), SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _spawn(label: str, cmd: list[str], env: dict[str, str], log: Path, port: int) -> ServerProcess:
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return ServerProcess(label, f"http://127.0.0.1:{port}", proc, log)


def start_kit(label: str, engine: Path, speculation: str, max_num_seqs: int, log: Path) -> ServerProcess:
    """``specdec-serve`` over an embedded (ONNX Runtime or PyTorch) engine; returns before it is ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "specdec_kit.serving", "--engine", str(engine), "--port", str(port),
           "--served-model-name", SERVED_NAME, "--speculation", speculation, "--max-num-seqs", str(max_num_seqs),
           "--log-level", "warning"]
    return _spawn(label, cmd, dict(os.environ), log, port)


def start_vllm(label: str, engine: Path, python: str, speculative: bool, max_model_len: int, kv_cache_gib: int,
               log: Path, extra: list[str]) -> ServerProcess:
    """vLLM's OpenAI server on a ``--backend vllm`` engine: with the engine's draft through ``specdec-serve`` (the
    user's path, the engine's ``vllm/serve.sh``), or plain on the engine's target with the same settings."""
    port = free_port()
    env = dict(os.environ, SPECDEC_VLLM_PYTHON=python, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    if speculative:
        cmd = [sys.executable, "-m", "specdec_kit.serving", "--engine", str(engine), "--port", str(port),
               "--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len), "--", *extra]
    else:
        from specdec_kit.runtime.manifest import read_manifest

        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(engine / "target"),
               "--dtype", read_manifest(engine)["dtype"], "--served-model-name", SERVED_NAME,
               "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port), *extra]
    return _spawn(label, cmd, env, log, port)
