"""A non-editable install builds and serves the demo engine, as the CPU image does: the wheel goes into a scratch
location, and the image's commands run from an empty directory with only ``SPECDEC_ZOO`` pointing at a zoo.
Nothing of the source tree is importable there (no Docker needed). The zoo is the tests' small demo zoo (the same
layout as the committed one, a 2-layer target): the install is under test here, and the committed zoo's 20-layer
target takes minutes to export, which the ONNX and load tests pay already."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_wheel_install_builds_and_serves_the_demo_engine(demo_checkpoints, tmp_path):
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            *map(str, wheels.glob("*.whl")),
        ],
        check=True,
        capture_output=True,
    )
    # the installed copy comes first on the path; the dependencies come from this interpreter
    zoo = demo_checkpoints["target"].parent
    env = dict(os.environ, PYTHONPATH=str(site), SPECDEC_ZOO=str(zoo))
    where = subprocess.run(
        [sys.executable, "-c", "import specdec_kit; print(specdec_kit.__file__)"],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(site)), where
    engine = work / "engines" / "griffin-onnxruntime"
    build = subprocess.run(
        # level-by-level drafting: the one-call draft graph (an unrolled tree search, slow to export) is the ONNX
        # tests' part
        [
            sys.executable,
            "-m",
            "specdec_kit.export.cli",
            "--draft",
            "griffin",
            "--no-draft-tree",
            "--output",
            str(engine),
        ],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["inputs"]["demo_zoo"] and manifest["draft"]["kind"] == "griffin"
    assert manifest["inputs"]["target"] == str(zoo / "target")
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdec_kit.serving",
            "--engine",
            str(engine),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 180
        while time.time() < deadline and server.poll() is None:
            try:
                if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert server.poll() is None, server.stdout.read()
        body = {"model": "griffin-onnxruntime", "prompt": "def fibonacci(n):", "max_tokens": 16}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert reply["usage"]["completion_tokens"] == 16 and reply["choices"][0]["text"]
        assert reply["usage"]["spec_decoding"]["cycles"] >= 1
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert sorted(p.name for p in work.iterdir()) == ["engines"]  # nothing else written beside the run
