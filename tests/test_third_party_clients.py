"""A third-party benchmark client, guidellm, run for real against the kit's server: every request succeeds, and
its token counts and time to first token agree with what the server's /metrics counted for the same requests.

guidellm lives in its own virtualenv (.venv-guidellm, made by scripts/setup_guidellm.sh, which the README's
test command runs first); SPECDEC_GUIDELLM_VENV points elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from server_helpers import Server
from tiers import missing_tool

pytestmark = pytest.mark.clients

REPO = Path(__file__).resolve().parents[1]
REQUESTS, STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 4, 32, 24


@pytest.fixture(scope="module")
def guidellm() -> Path:
    exe = Path(os.environ.get("SPECDEC_GUIDELLM_VENV", REPO / ".venv-guidellm")) / "bin" / "guidellm"
    if not exe.exists():
        missing_tool(
            f"guidellm not found at {exe}: run `bash scripts/setup_guidellm.sh` "
            "(scripts/test.sh does it before the tests)"
        )
    return exe


def served_totals(server: Server) -> dict[str, float]:
    m = server.metrics()
    return {
        "requests": m["specdec:time_to_first_token_seconds_count"],
        "ttft_sum": m["specdec:time_to_first_token_seconds_sum"],
        "prompt_tokens": m["specdec:prompt_tokens_total"],
        "output_tokens": m["specdec:generation_tokens_total"],
    }


def test_guidellm_concurrent_run_agrees_with_metrics(guidellm, demo_engine, tmp_path):
    server = Server(demo_engine, "--max-num-seqs", "8")
    try:
        before = served_totals(server)
        out = tmp_path / "guidellm.json"
        proc = subprocess.run(
            [
                str(guidellm),
                "run",
                "--backend",
                f"kind=openai_http,target={server.url},model=demo",
                "--profile",
                f"kind=concurrent,streams={STREAMS}",
                "--constraint",
                f"kind=max_requests,count={REQUESTS}",
                "--data",
                f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                "--tokenizer",
                f"kind=huggingface_auto,model={demo_engine / 'tokenizer'}",
                "--output",
                f"kind=json,path={out}",
                "--disable-progress",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        after = served_totals(server)
    finally:
        server.stop()

    requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
    assert not requests["errored"] and not requests["incomplete"], requests["errored"][:1] or requests["incomplete"][:1]
    done = requests["successful"]
    assert len(done) == REQUESTS
    served = {k: after[k] - before[k] for k in after}
    assert served["requests"] == REQUESTS
    # guidellm asks for exactly OUTPUT_TOKENS (ignore_eos) and counts from the usage the server streams
    assert sum(r["output_tokens"] for r in done) == served["output_tokens"] == REQUESTS * OUTPUT_TOKENS
    assert sum(r["prompt_tokens"] for r in done) == served["prompt_tokens"]
    assert all(r["prompt_tokens"] >= PROMPT_TOKENS for r in done)
    # time to first token: the client's includes the HTTP round trip, so it is at least the server's
    # (clock granularity aside) and not far above it on loopback
    client_mean = sum(r["time_to_first_token_ms"] for r in done) / 1000 / REQUESTS
    server_mean = served["ttft_sum"] / REQUESTS
    assert server_mean <= client_mean + 0.005, (server_mean, client_mean)
    assert client_mean - server_mean < 0.25, (server_mean, client_mean)
