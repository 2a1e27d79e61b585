"""Concurrent streaming clients for the serving benchmarks: N threads, each streaming requests back to back over
one kept-alive connection, metered by the load test's own per-token ``StreamMeter`` (vLLM-style
``continuous_usage_stats``: a chunk carrying k tokens counts as k, with k inter-token gaps of a k-th of the wait
each).

Serving clients (the OpenAI SDK, Locust, guidellm) keep their connections. A client made per request opens one per
request, which on a small machine is not free: about 35 ms a request on 2 cores (a one-token completion took 80 ms
against 45 ms kept alive), client work on the cores the server computes on, which every server paid and which hid
part of what speculation saves."""

from __future__ import annotations

import threading
import time

import httpx

from specdec_kit.loadtest.metrics import StreamMeter, percentile

Prompt = str | list[int]  # text: a chat request; token ids: a completions request (no template, no tokenizer)


def stream_request(client: httpx.Client, url: str, model: str, prompt: Prompt, max_tokens: int) -> dict:
    """One streamed greedy request (``ignore_eos``, so every server generates ``max_tokens``) on ``client``'s
    connection."""
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if isinstance(prompt, str):
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        route, body["prompt"] = "/v1/completions", prompt
    start = time.perf_counter()
    meter = StreamMeter(start, max_tokens)
    reconnects = 0
    while True:
        try:
            with client.stream("POST", url + route, json=body, timeout=600) as resp:
                if resp.status_code != 200:
                    resp.read()
                    error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                    return {"ok": False, "error": error, "tokens": 0, "itl": [], "reconnects": reconnects}
                for line in resp.iter_lines():
                    meter.feed(line, time.perf_counter())
            break
        except httpx.RemoteProtocolError:
            # A kept-alive connection the server closed as the request went out (llama-server's HTTP library
            # drops idle connections on its own clock): nothing was answered, so ask once more on a new one.
            if meter.events or reconnects:
                raise
            reconnects += 1
    rec = meter.finish(time.perf_counter())
    return {
        "reconnects": reconnects,
        "ok": rec.ok,
        "error": rec.error,
        "ttft": rec.ttft,
        "itl": rec.itl,
        "tokens": rec.output_tokens,
        "e2e": rec.e2e,
        "text": meter.text,
    }


def ms(seconds: float | None, digits: int) -> float | None:
    return None if seconds is None else round(1000 * seconds, digits)


def run_level(url: str, model: str, prompts: list[Prompt], clients: int, total: int, max_tokens: int) -> dict:
    """``clients`` threads share ``max(total, clients)`` requests over ``prompts`` (round robin). Returns throughput
    over the level's wall time, TTFT and per-token ITL percentiles, failures, and each prompt's text."""
    jobs = [(i % len(prompts), prompts[i % len(prompts)]) for i in range(max(total, clients))][::-1]
    lock, results = threading.Lock(), []

    def worker():
        with httpx.Client() as client:
            while stream_next(client):
                pass

    def stream_next(client: httpx.Client) -> bool:
        with lock:
            if not jobs:
                return False
            index, prompt = jobs.pop()
        try:
            res = stream_request(client, url, model, prompt, max_tokens)
        except Exception as exc:  # a benchmark reports a failed request; it does not stop the others
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "tokens": 0, "itl": []}
        res["prompt_index"] = index
        with lock:
            results.append(res)
        return True

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    itl = [g for r in ok for g in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    return {
        "concurrency": clients,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
        "reconnects": sum(r.get("reconnects", 0) for r in results),
        "tokens": sum(r["tokens"] for r in ok),
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "ttft_p50_ms": ms(percentile(ttft, 0.5), 1),
        "ttft_p99_ms": ms(percentile(ttft, 0.99), 1),
        "itl_p50_ms": ms(percentile(itl, 0.5), 2),
        "itl_p99_ms": ms(percentile(itl, 0.99), 2),
        "texts": {r["prompt_index"]: r["text"] for r in ok},
    }
