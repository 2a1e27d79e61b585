"""``locust -f loadtest/chat.py``: streaming chat load against any OpenAI-compatible server.

Each simulated user sends ``/v1/chat/completions`` (or ``--endpoint completions``) requests back to
back with ``stream=true`` (``--no-stream`` for whole responses), prompts drawn from a Spec-Bench /
MT-Bench jsonl, ``max_tokens`` drawn from ``--max-tokens-distribution``. Locust's own statistics get the
HTTP requests plus ``METRIC`` entries for TTFT, per-token ITL, TPOT and end-to-end latency, so they show
in the web UI and in ``--csv``/``--html``. Failures (HTTP errors, in-band ``data: {"error": ...}``
frames, a stream without ``[DONE]``, fewer tokens than asked without a finish reason that explains it)
are Locust failures. At the end the run's percentiles and goodput under ``--ttft-slo-ms`` /
``--tpot-slo-ms`` are printed and written as CSV and JSON (``--llm-report``, default beside ``--csv``).

Works unchanged against the kit's server, SGLang and ``trtllm-serve``: kit fields (acceptance length,
``continuous_usage_stats``) are used when present and never required. Example::

    locust -f loadtest/chat.py --headless -u 8 -r 8 -t 60s --host http://127.0.0.1:8000 --csv runs/chat
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from locust import HttpUser, constant, events, task

from specdec_kit.loadtest.metrics import StreamMeter, StreamRecord
from specdec_kit.loadtest.prompts import default_prompt_file, load_prompts
from specdec_kit.loadtest.report import RunCollector, draw_max_tokens

COLLECTOR = RunCollector()


@events.init_command_line_parser.add_listener
def add_options(parser) -> None:
    group = parser  # Locust's own parser: options reach --headless runs, the web UI and locust.conf alike
    group.add_argument(
        "--prompts",
        default=str(default_prompt_file()),
        include_in_web_ui=True,
        help="Spec-Bench / MT-Bench jsonl (first turn of each question)",
    )
    group.add_argument(
        "--model", default="", include_in_web_ui=True, help="model id (default: the first of /v1/models)"
    )
    group.add_argument("--endpoint", choices=["chat", "completions"], default="chat", include_in_web_ui=True)
    group.add_argument("--no-stream", action="store_true", default=False, help="whole responses instead of SSE")
    group.add_argument("--max-tokens", type=int, default=128, include_in_web_ui=True, help="mean of the distribution")
    group.add_argument(
        "--max-tokens-distribution",
        choices=["constant", "uniform", "normal", "exponential"],
        default="constant",
        include_in_web_ui=True,
    )
    group.add_argument("--max-tokens-min", type=int, default=1)
    group.add_argument("--max-tokens-max", type=int, default=4096)
    group.add_argument("--temperature", type=float, default=0.0, include_in_web_ui=True)
    group.add_argument(
        "--no-ignore-eos",
        action="store_true",
        default=False,
        help="let the model stop early (by default ignore_eos asks for exactly max_tokens)",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY") or os.environ.get("SPECDEC_API_KEY", ""),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY or $SPECDEC_API_KEY)",
    )
    group.add_argument("--ttft-slo-ms", type=float, default=None, include_in_web_ui=True, help="goodput target")
    group.add_argument("--tpot-slo-ms", type=float, default=None, include_in_web_ui=True, help="goodput target")
    group.add_argument(
        "--llm-report", default="", help="prefix of the CSV/JSON report (default: <--csv prefix>_llm, else locust_llm)"
    )
    group.add_argument(
        "--no-continuous-usage",
        action="store_true",
        default=False,
        help="do not ask for stream_options.continuous_usage_stats (for servers that refuse it); "
        "tokens per chunk are then estimated from the final usage",
    )
    group.add_argument(
        "--max-prompt-chars",
        type=int,
        default=0,
        help="skip prompts longer than this many characters (0 = keep all), e.g. for short-context models",
    )
    group.add_argument("--prompt-seed", type=int, default=0)
    group.add_argument(
        "--show-replies",
        type=int,
        default=2,
        include_in_web_ui=True,
        help="print this many prompts and replies with the report (every one is in _requests.csv)",
    )


class ChatUser(HttpUser):
    wait_time = constant(0)  # closed loop: each user sends its next request when the last one ends
    host = "http://127.0.0.1:8000"  # specdec-serve's default address; --host (or the web UI) for any other

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opts = opts
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.rng = random.Random(opts.prompt_seed + id(self) % 100000)
        self.prompts = load_prompts(Path(opts.prompts), opts.max_prompt_chars)
        self.model = opts.model or COLLECTOR.model or self._discover_model()

    def _discover_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, name="/v1/models", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"/v1/models: HTTP {resp.status_code}")
                raise RuntimeError(f"cannot list models: HTTP {resp.status_code} {resp.text[:200]}")
            COLLECTOR.model = resp.json()["data"][0]["id"]
        return COLLECTOR.model

    def _body(self, prompt: str, max_tokens: int) -> dict:
        opts = self.opts
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": opts.temperature,
            "stream": not opts.no_stream,
        }
        if opts.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if not opts.no_ignore_eos:
            body["ignore_eos"] = True
        if not opts.no_stream:
            body["stream_options"] = {"include_usage": True}
            if not opts.no_continuous_usage:  # vLLM's extension; the kit, vLLM, SGLang and trtllm-serve accept it
                body["stream_options"]["continuous_usage_stats"] = True
        return body

    def _metric(self, name: str, ms: float | None) -> None:
        if ms is not None:
            self.environment.events.request.fire(
                request_type="METRIC", name=name, response_time=ms, response_length=0, exception=None, context={}
            )

    @task
    def completion(self) -> None:
        opts = self.opts
        path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
        max_tokens = draw_max_tokens(
            self.rng, opts.max_tokens_distribution, opts.max_tokens, opts.max_tokens_min, opts.max_tokens_max
        )
        prompt = self.rng.choice(self.prompts)
        body = self._body(prompt, max_tokens)
        start = time.perf_counter()
        COLLECTOR.mark_start(time.time())
        with self.client.post(
            path,
            json=body,
            headers=self.headers,
            stream=not opts.no_stream,
            catch_response=True,
            name=path + (" (stream)" if not opts.no_stream else ""),
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
                COLLECTOR.add(
                    StreamRecord(error=f"HTTP {resp.status_code}", requested_tokens=max_tokens, prompt=prompt)
                )
                return
            if opts.no_stream:
                record = self._whole(resp, start, max_tokens)
            else:
                meter = StreamMeter(start, max_tokens)  # fewer tokens need a finish reason that explains them
                for line in resp.iter_lines(decode_unicode=True):
                    meter.feed(line, time.perf_counter())
                record = meter.finish(time.perf_counter())
            record.prompt = prompt
            if record.ok:
                resp.success()
            else:
                resp.failure(record.error)
        COLLECTOR.add(record)
        if record.ok:
            self._metric("ttft_ms", 1000 * record.ttft if record.ttft is not None else None)
            self._metric("tpot_ms", 1000 * record.tpot if record.tpot is not None else None)
            self._metric("e2e_ms", 1000 * record.e2e)
            for gap in record.itl:
                self._metric("itl_ms_per_token", 1000 * gap)

    def _whole(self, resp, start: float, max_tokens: int) -> StreamRecord:
        end = time.perf_counter()
        rec = StreamRecord(requested_tokens=max_tokens, e2e=end - start, ttft=end - start, token_count_source="usage")
        try:
            data = resp.json()
        except json.JSONDecodeError:
            rec.error = "response is not JSON"
            return rec
        if "error" in data:
            rec.error = f"error: {data['error']}"
            return rec
        usage = data.get("usage") or {}
        rec.output_tokens = int(usage.get("completion_tokens", 0))
        choice = (data.get("choices") or [{}])[0]
        rec.finish_reason = choice.get("finish_reason")
        rec.text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        spec = usage.get("spec_decoding")
        if isinstance(spec, dict):
            rec.acceptance_length = spec.get("acceptance_length")
        if rec.output_tokens < rec.requested_tokens and rec.finish_reason != "stop":
            rec.error = f"{rec.output_tokens} of {rec.requested_tokens} tokens, finish_reason {rec.finish_reason!r}"
        rec.ok = rec.error is None
        return rec


@events.report_to_master.add_listener
def send_records(client_id, data, **kwargs) -> None:
    data["llm_records"] = COLLECTOR.drain_rows()


@events.worker_report.add_listener
def receive_records(client_id, data, **kwargs) -> None:
    COLLECTOR.extend_rows(data.get("llm_records", []))


@events.test_stop.add_listener
def report(environment, **kwargs) -> None:
    from locust.runners import WorkerRunner

    if isinstance(environment.runner, WorkerRunner):
        return  # the master reports for everyone
    opts = environment.parsed_options
    COLLECTOR.report(
        opts.llm_report or None,
        getattr(opts, "csv_prefix", None),
        opts.ttft_slo_ms,
        opts.tpot_slo_ms,
        opts.show_replies,
    )
