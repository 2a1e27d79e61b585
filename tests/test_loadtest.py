"""The Locust load test: stream metering on hand-made streams, then the real thing, ``locust -f
loadtest/chat.py --headless -u 8 -r 8 -t 30s`` against the kit's server, checked for consistency."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import Server

from specdec_kit.loadtest.metrics import StreamMeter, summarize
from specdec_kit.loadtest.prompts import default_prompt_file, load_prompts
from specdec_kit.loadtest.report import draw_max_tokens

pytestmark = pytest.mark.clients

REPO = Path(__file__).resolve().parents[1]


def frame(text: str, tokens_so_far: int | None = None, finish: str | None = None, usage: dict | None = None) -> str:
    chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    if tokens_so_far is not None:
        chunk["usage"] = {"completion_tokens": tokens_so_far}
    if usage is not None:
        chunk = {"choices": [], "usage": usage}
    return "data: " + json.dumps(chunk)


def meter(lines: list[tuple[float, str]], requested: int = 0):
    m = StreamMeter(0.0, requested)
    for t, line in lines:
        m.feed(line, t)
    return m.finish(lines[-1][0] if lines else 0.0)


def test_chunks_with_several_tokens_count_as_several_and_itl_is_per_token():
    rec = meter(
        [(0.1, frame("a", 1)), (0.4, frame("bcd", 4)), (0.5, frame("e", 5, "length")), (0.5, "data: [DONE]")], 5
    )
    assert rec.ok and rec.output_tokens == 5 and rec.token_count_source == "continuous_usage" and rec.text == "abcde"
    assert rec.ttft == pytest.approx(0.1)
    assert rec.itl == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 0.3 s for 3 tokens, then 0.1 s for 1
    assert rec.tpot == pytest.approx(0.4 / 4)


def test_final_usage_distributes_tokens_by_text_share():
    rec = meter(
        [
            (0.1, frame("ab")),
            (0.3, frame("abcdef", finish="length")),
            (0.3, frame("", usage={"completion_tokens": 8, "prompt_tokens": 3})),
            (0.3, "data: [DONE]"),
        ],
        8,
    )
    assert rec.ok and rec.output_tokens == 8 and rec.token_count_source == "final_usage"
    assert len(rec.itl) == 6  # 2 tokens in the first chunk (one is the first token), 6 in the second


def test_failures_in_band_error_missing_done_and_short_output():
    assert (
        "in-band error"
        in meter([(0.1, frame("a", 1)), (0.2, 'data: {"error": {"message": "boom"}}'), (0.2, "data: [DONE]")]).error
    )
    assert "without data: [DONE]" in meter([(0.1, frame("a", 1, "length"))], 1).error
    short = meter([(0.1, frame("a", 1)), (0.2, frame("b", 2, "length")), (0.2, "data: [DONE]")], 10)
    assert not short.ok and "does not explain it" in short.error
    stopped = meter([(0.1, frame("a", 1)), (0.2, frame("b", 2, "stop")), (0.2, "data: [DONE]")], 10)
    assert stopped.ok  # a stop explains fewer tokens


def test_summary_goodput_and_distributions():
    import random

    recs = [
        meter([(t, frame("x", 1)), (t + 0.5, frame("y", 2, "length")), (t + 0.5, "data: [DONE]")], 2)
        for t in (0.1, 0.2, 0.9)
    ]
    s = summarize(recs, wall_s=2.0, ttft_slo_ms=500, tpot_slo_ms=1000)
    assert s["succeeded"] == 3 and s["goodput"]["good_requests"] == 2 and s["throughput_tokens_per_s"] == 3.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    rng = random.Random(0)
    for dist in ("constant", "uniform", "normal", "exponential"):
        draws = [draw_max_tokens(rng, dist, 64, 1, 256) for _ in range(200)]
        assert all(1 <= d <= 256 for d in draws)
        assert (len(set(draws)) == 1) == (dist == "constant")


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"turns": ["hello"]}\n{"question": 1}\n')
    with pytest.raises(ValueError, match="q.jsonl:2"):
        load_prompts(bad)
    with pytest.raises(FileNotFoundError, match="give --prompts"):
        load_prompts(tmp_path / "missing.jsonl")


@pytest.fixture(scope="module")
def zoo_engine(zoo_engines) -> Path:
    """The demo engine, built (or, built already by another test, reused) by the user's own command:
    python export/build_engine.py --draft griffin."""
    out = zoo_engines / "griffin-onnxruntime"
    proc = subprocess.run(
        [sys.executable, str(REPO / "export" / "build_engine.py"), "--draft", "griffin", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_locust_headless_against_the_kits_server(zoo_engine, tmp_path):
    server = Server(zoo_engine, "--max-num-seqs", "8")
    try:
        before = server.metrics()
        prefix = tmp_path / "run"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(REPO / "loadtest" / "chat.py"),
                "--headless",
                "-u",
                "8",
                "-r",
                "8",
                "-t",
                "30s",
                "--stop-timeout",
                "60",
                "--host",
                server.url,
                "--csv",
                str(prefix),
                "--max-tokens",
                "32",
                "--max-prompt-chars",
                "1500",
                "--ttft-slo-ms",
                "10000",
                "--tpot-slo-ms",
                "2000",
                "--api-key",
                "unused",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
        after = server.metrics()
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(Path(f"{prefix}_llm_summary.json").read_text())
    rows = list(csv.DictReader(open(f"{prefix}_llm_requests.csv")))
    assert summary["failed"] == 0 and summary["requests"] == len(rows) >= 8
    assert all(r["ok"] == "True" and float(r["ttft"]) < float(r["e2e"]) for r in rows)
    assert all(int(r["output_tokens"]) == 32 for r in rows)  # ignore_eos: exactly what was asked
    asked = set(load_prompts(default_prompt_file(), 1500))
    assert all(r["prompt"] in asked and r["text"].strip() for r in rows)  # each request's prompt and reply recorded
    shown = proc.stdout[proc.stdout.index("replies (2 of") :]
    assert f"  > {' '.join(rows[0]['prompt'].split())[:40]}" in shown and "[32 tokens, length]" in shown
    assert summary["token_count_sources"] == ["continuous_usage"]
    served = after["specdec:generation_tokens_total"] - before["specdec:generation_tokens_total"]
    assert served == sum(int(r["output_tokens"]) for r in rows)  # our count equals the server's
    finished = after["specdec:request_success_total{finished_reason=length}"] - before.get(
        "specdec:request_success_total{finished_reason=length}", 0
    )
    assert finished == len(rows)  # every request completed
    assert summary["acceptance_length_mean"] > 1.0 and summary["goodput"]["good_requests"] <= len(rows)
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert summary[name]["p50"] is not None and summary[name]["p50"] <= summary[name]["p99"]
    stats = {row["Name"]: row for row in csv.DictReader(open(f"{prefix}_stats.csv"))}
    assert stats["/v1/chat/completions (stream)"]["Failure Count"] == "0"
    posts = int(stats["/v1/chat/completions (stream)"]["Request Count"])
    # Locust's final table is taken when the run stops; requests finishing within --stop-timeout come after it
    assert int(stats["ttft_ms"]["Request Count"]) == posts and 0 < posts <= len(rows) and "itl_ms_per_token" in stats


def test_report_of_a_run_without_requests_writes_nothing(tmp_path, capsys):
    from specdec_kit.loadtest.report import RunCollector

    summary = RunCollector().report(str(tmp_path / "run"), None, None, None)
    assert summary == {"requests": 0} and list(tmp_path.iterdir()) == []
    assert "no requests were made" in capsys.readouterr().out


def test_locustfile_has_a_default_host_and_the_sweep_plots_levels_without_requests(tmp_path):
    import ast

    tree = ast.parse((REPO / "loadtest" / "chat.py").read_text())
    user = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ChatUser")
    hosts = [n.value.value for n in user.body if isinstance(n, ast.Assign) and n.targets[0].id == "host"]
    assert hosts == ["http://127.0.0.1:8000"]
    from specdec_kit.loadtest.sweep import plot

    empty = {"p50": None, "p90": None, "p99": None, "mean": None}
    rows = [
        {
            "users": 1,
            "requests": 4,
            "throughput_tokens_per_s": 50.0,
            "ttft_ms": {"p50": 20.0, "p99": 30.0},
            "itl_ms": {"p50": 5.0, "p99": 9.0},
        },
        {"users": 8, "requests": 0, "throughput_tokens_per_s": None, "ttft_ms": empty, "itl_ms": empty},
    ]
    plot(rows, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 1000
