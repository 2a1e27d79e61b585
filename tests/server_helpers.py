"""A real server process on localhost for the serving and load tests."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from specdec_kit.bench.servers import free_port, wait_until_ready  # noqa: F401 (the tests import them from here)

KEY = "test-key"


class Server:
    def __init__(self, engine: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specdec_kit.serving",
                "--engine",
                str(engine),
                "--port",
                str(self.port),
                "--served-model-name",
                "demo",
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_until_ready(
            self.url + "/health/ready",
            120,
            lambda: self.proc.poll() is not None and f"server exited: {self.proc.stdout.read()}",
        )

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


class InProcessServer:
    """The app under uvicorn in a thread of this process, so a test can reach into its scheduler (fault
    injection) and read its log records."""

    def __init__(self, engine_dir: Path, **scheduler_options):
        import threading

        import uvicorn

        from specdec_kit.runtime.engine import open_engine
        from specdec_kit.serving.app import ServerConfig, create_app
        from specdec_kit.serving.metrics import ServerMetrics
        from specdec_kit.serving.policy import SpeculationPolicy, default_schedule
        from specdec_kit.serving.scheduler import Scheduler

        self.engine = open_engine(engine_dir)
        self.metrics_registry = ServerMetrics("demo")
        self.scheduler = Scheduler(
            self.engine,
            self.metrics_registry,
            SpeculationPolicy(default_schedule(self.engine.tree)),
            **scheduler_options,
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(self.engine, ServerConfig("demo"), self.scheduler, self.metrics_registry)
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until_ready(self.url + "/health/ready", 120, interval=0.1)

    def metrics(self) -> dict[str, float]:
        return Server.metrics(self)  # same parsing, same URL layout

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
