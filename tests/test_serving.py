"""The OpenAI-compatible server, as a real process on localhost, driven by the real ``openai`` client
(and raw HTTP where the wire format itself is the point)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import KEY, InProcessServer, Server

from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildInputs
from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_to_dict
from specdec_kit.runtime.engine import open_engine
from specdec_kit.serving.app import ensure_chat_template

PROMPTS = [
    "The quick brown fox",
    "Hello, world! ",
    "Speculative decoding is",
    "def main():",
    "abc abc abc",
    "Once upon a time",
    "1, 2, 3, 4,",
    "To be or not",
]


@pytest.fixture(scope="module")
def engine_dir(demo_engine) -> Path:
    return demo_engine


@pytest.fixture(scope="module")
def server(engine_dir):
    srv = Server(engine_dir, "--api-key", KEY, "--max-num-seqs", "16")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def runtime_engine(engine_dir):
    return open_engine(engine_dir)


def runtime_greedy(engine, prompt_ids: list[int], n: int) -> str:
    res = engine.generator().generate([prompt_ids], n)[0]
    return engine.tokenizer.decode(res.tokens, skip_special_tokens=True)


def test_completions_are_the_runtimes_greedy_output(server, runtime_engine):
    client = server.client()
    for prompt in PROMPTS[:4]:
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0)
        ids = runtime_engine.tokenizer(prompt)["input_ids"]
        assert r.choices[0].text == runtime_greedy(runtime_engine, ids, 32)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 32
        spec = r.usage.model_extra["spec_decoding"]
        assert spec["cycles"] >= 1 and spec["accepted_tokens"] <= spec["draft_tokens"]
        assert r.choices[0].finish_reason == "length"


def test_chat_streaming_equals_non_streaming_and_ends_with_done(server, runtime_engine):
    client = server.client()
    messages = [{"role": "user", "content": "Write a haiku about trees."}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=40, temperature=0)
    parts, usage = [], None
    for chunk in client.chat.completions.create(
        model="demo",
        messages=messages,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens == 40
    ensure_chat_template(runtime_engine.tokenizer)
    prompt_ids = runtime_engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert whole.choices[0].message.content == runtime_greedy(runtime_engine, list(prompt_ids), 40)
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "demo", "prompt": "abc", "max_tokens": 5, "stream": True},
    ) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sixteen_concurrent_streams_match_their_sequential_runs(server):
    client = server.client()
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]

    def sequential(p):
        return client.completions.create(model="demo", prompt=p, max_tokens=24, temperature=0).choices[0].text

    def streamed(p):
        return "".join(
            c.choices[0].text
            for c in client.completions.create(model="demo", prompt=p, max_tokens=24, temperature=0, stream=True)
            if c.choices
        )

    expected = [sequential(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(streamed, prompts))
    assert got == expected


def test_requests_read_by_a_running_batchs_decode_calls_get_the_runtimes_output(engine_dir, runtime_engine):
    """Requests that join a running batch (a long request holds it running while they arrive), their prompts read by
    its decode cycles' target calls (``--fold-prompt-tokens``) beside the batch's trees, complete with the runtime's
    greedy output, and the server counts them."""
    srv = Server(engine_dir, "--fold-prompt-tokens", "64", "--max-num-seqs", "8")
    try:
        client = srv.client()
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(8)]
        budgets = [96] + [24] * (len(prompts) - 1)
        running = threading.Event()

        def streamed(i: int) -> str:
            if i:
                running.wait(60)  # the long request's first token is out: the batch is running
            stream = client.completions.create(
                model="demo", prompt=prompts[i], max_tokens=budgets[i], temperature=0, stream=True
            )
            text = ""
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    running.set()
            return text

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(streamed, range(len(prompts))))
        ids = [runtime_engine.tokenizer(p)["input_ids"] for p in prompts]
        assert got == [runtime_greedy(runtime_engine, p, n) for p, n in zip(ids, budgets)]
        assert srv.metrics()["specdec:prompts_read_in_decode_total"] >= 3
    finally:
        srv.stop()


def test_stop_strings_cut_the_stream(server):
    client = server.client()
    full = client.completions.create(model="demo", prompt="abc abc", max_tokens=30, temperature=0).choices[0].text
    stop = full[10:13]
    chunks = list(
        client.completions.create(
            model="demo", prompt="abc abc", max_tokens=30, temperature=0, stop=[stop], stream=True
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full[: full.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_disconnect_mid_stream_cancels_and_frees_the_row(server):
    before = server.metrics()
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "demo", "prompt": "Once upon", "max_tokens": 1500, "stream": True, "ignore_eos": True},
    ) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 3:
                break  # leave after a few chunks
    deadline = time.time() + 30
    while time.time() < deadline and server.metrics()["specdec:num_requests_running"] != 0:
        time.sleep(0.1)
    after = server.metrics()
    assert after["specdec:num_requests_running"] == 0
    assert after["specdec:generation_tokens_total"] - before["specdec:generation_tokens_total"] < 1500
    assert server.client().completions.create(model="demo", prompt="x", max_tokens=3).choices[0].text is not None


def post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={**headers, "Content-Type": "application/json"})
    return httpx.post(server.url + path, json=body, headers=headers)


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        ({"model": "demo", "prompt": "x", "temperature": 5}, 400, "temperature", None),
        ({"model": "demo", "prompt": "x", "top_p": 0}, 400, "top_p", None),
        ({"model": "demo", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
        ({"model": "demo", "prompt": "x", "n": 2}, 400, "n", "unsupported_parameter"),
        ({"model": "demo", "prompt": "x", "logprobs": 3}, 400, "logprobs", "unsupported_parameter"),
        ({"model": "demo", "prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unrecognized_parameter"),
        ({"model": "demo", "prompt": ""}, 400, "prompt", None),
        ({"model": "demo", "prompt": [99999]}, 400, "prompt", None),
        ({"model": "demo", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
        ({"model": "other", "prompt": "x"}, 404, "model", "model_not_found"),
        ({"prompt": "x"}, 400, "model", None),
    ],
)
def test_invalid_requests_get_openai_errors(server, body, status, param, code):
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["code"] == code


def test_chat_specific_refusals(server):
    resp = post(
        server,
        "/v1/chat/completions",
        {
            "model": "demo",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"
    resp = post(server, "/v1/chat/completions", {"model": "demo", "messages": []})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_malformed_json_long_prompts_auth_and_unknown_routes(server):
    resp = post(server, "/v1/completions", None, raw=b"{not json")
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = post(server, "/v1/completions", {"model": "demo", "prompt": list(range(1, 70)) * 30, "max_tokens": 10})
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "2048" in err["message"] and "2070" in err["message"]  # the limit and what was asked
    assert post(server, "/v1/completions", {"model": "demo", "prompt": "x"}, key=None).status_code == 401
    wrong = post(server, "/v1/completions", {"model": "demo", "prompt": "x"}, key="wrong")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert [m.id for m in server.client().models.list()] == ["demo"]
    assert httpx.get(server.url + "/health").status_code == 200  # liveness needs no key
    r = server.client().completions.create(model="demo", prompt="still serving", max_tokens=4)
    assert r.usage.completion_tokens == 4


def test_metrics_parse_and_move(server):
    before = server.metrics()
    server.client().completions.create(model="demo", prompt="Counting", max_tokens=20, temperature=0)
    after = server.metrics()
    assert after["specdec:generation_tokens_total"] - before["specdec:generation_tokens_total"] == 20
    assert after["specdec:request_success_total{finished_reason=length}"] > before.get(
        "specdec:request_success_total{finished_reason=length}", 0
    )
    assert after["specdec:time_to_first_token_seconds_count"] == before["specdec:time_to_first_token_seconds_count"] + 1
    assert (
        after["specdec:inter_token_latency_seconds_count"] - before["specdec:inter_token_latency_seconds_count"] == 19
    )
    assert after["specdec:e2e_request_latency_seconds_count"] == before["specdec:e2e_request_latency_seconds_count"] + 1
    assert after["specdec:prompt_tokens_total"] > before["specdec:prompt_tokens_total"]
    for name in (
        "specdec:num_requests_waiting",
        "specdec:spec_accept_length",
        "specdec:spec_decode_num_drafts_total",
        "specdec:spec_decode_num_accepted_tokens_total",
        "specdec:request_errors_total{type=invalid_api_key}",
        "python_gc_collections_total{generation=2}",
        "process_resident_memory_bytes",
    ):
        assert name in after, name
    assert after["specdec:gc_frozen_objects"] > 100_000  # the start-up heap (torch, transformers, the engine)


def test_a_repeated_prompt_computes_only_its_uncached_tail(server, runtime_engine):
    client = server.client()
    prompt = "A prompt repeated word for word: " + " ".join(reversed(PROMPTS)) * 3
    ids = runtime_engine.tokenizer(prompt)["input_ids"]
    before = server.metrics()
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
    again = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
    after = server.metrics()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert again.choices[0].text == first.choices[0].text == runtime_greedy(runtime_engine, ids, 24)
    queries, hits = "specdec:prefix_cache_queries_total", "specdec:prefix_cache_hits_total"
    assert after[queries] - before[queries] == 2 * len(ids)
    assert after[hits] - before[hits] == again.usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
def test_a_prefix_cache_too_small_for_one_block_is_refused_at_start(engine_dir):
    done = subprocess.run(
        [sys.executable, "-m", "specdec_kit.serving", "--engine", str(engine_dir), "--prefix-cache-mib", "0.0001"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--prefix-cache-mib" in done.stderr and "at least one block" in done.stderr


@pytest.mark.slow
def test_overload_gets_429_with_retry_after_and_shutdown_drains(engine_dir):
    srv = Server(engine_dir, "--max-num-seqs", "1", "--max-queue", "1", "--drain-timeout", "60")
    try:

        def call(i):
            return httpx.post(
                srv.url + "/v1/completions",
                timeout=120,
                json={"model": "demo", "prompt": f"load {i}", "max_tokens": 200, "ignore_eos": True},
            )

        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(call, range(6)))
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and 200 in codes
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["Retry-After"] and refused.json()["error"]["code"] == "queue_full"
        assert all(r.json()["usage"]["completion_tokens"] == 200 for r in responses if r.status_code == 200)
        # a stream in flight when the server is told to stop still completes
        lines: list[str] = []

        def stream():
            with httpx.stream(
                "POST",
                srv.url + "/v1/completions",
                timeout=120,
                json={"model": "demo", "prompt": "drain", "max_tokens": 300, "ignore_eos": True, "stream": True},
            ) as resp:
                lines.extend(line for line in resp.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(1.0)
        assert srv.stop() == 0  # drained, then a clean exit
        reader.join(timeout=60)
        assert lines and lines[-1] == "data: [DONE]"
        assert sum(len(json.loads(x[6:])["choices"][0]["text"]) > 0 for x in lines[:-1]) > 0
    finally:
        srv.stop()


def test_server_backends_launch_their_own_server(demo_checkpoints, tmp_path):
    """``--engine`` of an SGLang engine execs the engine's serve.sh; with no SGLang installed here the
    launch gets as far as SGLang's own module, which is as far as a CPU machine can take it."""
    inputs = BuildInputs(
        draft="griffin",
        target=demo_checkpoints["target"],
        draft_path=demo_checkpoints["griffin"],
        tokenizer=demo_checkpoints["target"],
        backend="sglang",
        dtype="float32",
        tree=tree_to_dict(DynamicTreeConfig(12, 3, 3)),
    )
    engine = build_engine(inputs, tmp_path / "sglang-engine").path
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_kit.serving", "--engine", str(engine), "--port", "9"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": str(Path(sys.executable).parent)},
    )
    out = proc.stdout + proc.stderr
    assert "starting the sglang server" in out and proc.returncode != 0
    assert "No module named sglang" in out or "sglang" in out.split("starting the sglang server")[1]
    wrong = subprocess.run(
        [sys.executable, "-m", "specdec_kit.serving", "--engine", str(engine), "--backend", "tensorrt-llm"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode == 2 and "is a sglang engine" in wrong.stderr
    trt = build_engine(
        dataclasses.replace(inputs, backend="tensorrt-llm", file_hashes={}), tmp_path / "trtllm-engine"
    ).path
    keyed = subprocess.run(
        [sys.executable, "-m", "specdec_kit.serving", "--engine", str(trt), "--api-key", "sk-x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert keyed.returncode == 2 and "trtllm-serve takes none" in keyed.stderr  # never a server that ignores the key
    # trtllm-serve names its model after the model directory: the served name arrives as the name of a link to the
    # engine's target. A stand-in for trtllm-serve (TensorRT-LLM cannot be installed here) reports what it was given.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "trtllm-serve").write_text(
        f"#!{sys.executable}\nimport pathlib, sys\n"
        "model = pathlib.Path(sys.argv[1])\n"
        "print('model name', model.name, 'at', model.resolve(), 'args', *sys.argv[2:])\n"
    )
    (bin_dir / "trtllm-serve").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    named = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_kit.serving",
            "--engine",
            str(trt),
            "--served-model-name",
            "llama-3-8b-griffin",
            "--port",
            "9123",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert named.returncode == 0, named.stdout + named.stderr
    assert f"model name llama-3-8b-griffin at {(trt / 'target').resolve()} args --backend pytorch" in named.stdout
    assert "--port 9123" in named.stdout
    slashed = subprocess.run(
        [sys.executable, "-m", "specdec_kit.serving", "--engine", str(trt), "--served-model-name", "meta/llama"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert slashed.returncode == 2 and "single path component" in slashed.stderr


def test_an_error_after_the_stream_began_is_sent_in_band_and_the_server_recovers(engine_dir):
    """Fault injection: a batched cycle raises (no single request to blame). The stream that was running gets
    the error as a data frame and then [DONE]; the next request is served normally."""
    srv = InProcessServer(engine_dir)
    real_cycle, calls = srv.scheduler.gen.cycle, {"n": 0}

    def flaky_cycle(batch, speculate=True, joining=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real_cycle(batch, speculate, joining)

    srv.scheduler.gen.cycle = flaky_cycle
    try:
        with httpx.stream(
            "POST",
            srv.url + "/v1/completions",
            json={"model": "demo", "prompt": "abc", "max_tokens": 50, "stream": True},
        ) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "injected fault" in error["message"] and error["type"] == "server_error"
        assert resp.headers["X-Request-Id"] in error["message"]
        assert any("choices" in json.loads(x[6:]) for x in lines[:-2])  # tokens had been streamed before it
        ok = httpx.post(
            srv.url + "/v1/completions", json={"model": "demo", "prompt": "abc", "max_tokens": 5}, timeout=60
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    finally:
        srv.stop()


def test_model_free_and_hybrid_speculation_serve_the_runtimes_greedy_output(engine_dir, demo_checkpoints, tmp_path):
    """A target-only engine speculates with prompt lookup, and ``--lookup suffix`` merges suffix trees into the GRIFFIN
    engine's: concurrent requests get the runtime's greedy text, and the speculation shows in the metrics by method
    (the merged trees first; the parts the cost policy weighs beside them as it measures them)."""
    ngram = build_engine(
        BuildInputs(
            draft="ngram",
            target=demo_checkpoints["target"],
            draft_path=None,
            tokenizer=demo_checkpoints["target"],
            backend="onnxruntime",
            dtype="float32",
            tree=tree_to_dict(DynamicTreeConfig(8, 6, 1)),
        ),
        tmp_path / "ngram",
    ).path
    runtime = open_engine(engine_dir)
    prompts = [p + " " + p for p in PROMPTS]  # repeated text: something to copy
    expected = [runtime_greedy(runtime, runtime.tokenizer(p)["input_ids"], 24) for p in prompts]
    for engine, extra, first, methods in (
        (ngram, (), "ngram", {"ngram"}),
        (engine_dir, ("--lookup", "suffix"), "griffin+suffix", {"griffin+suffix", "griffin", "suffix"}),
    ):
        srv = Server(engine, "--max-num-seqs", "4", *extra)
        try:
            client = srv.client()
            for _ in range(3):  # enough cycles for the policy to try each candidate
                with ThreadPoolExecutor(4) as pool:
                    texts = list(
                        pool.map(
                            lambda p: (
                                client.completions.create(model="demo", prompt=p, max_tokens=24, temperature=0)
                                .choices[0]
                                .text
                            ),
                            prompts,
                        )
                    )
                assert texts == expected, engine
            metrics = srv.metrics()
        finally:
            srv.stop()
        drafted = {
            key.split("method=")[1].rstrip("}")
            for key, value in metrics.items()
            if key.startswith("specdec:spec_decode_num_drafts_by_method_total") and value > 0
        }
        assert first in drafted and drafted <= methods, (engine, drafted)
