"""The OpenAI-compatible HTTP API over the continuous-batching scheduler (FastAPI).

``/v1/chat/completions`` and ``/v1/completions`` (streaming as server-sent events ending in
``data: [DONE]``, or whole), ``/v1/models``, ``/health`` (liveness), ``/health/ready`` (readiness:
the engine is loaded and a warm-up generation went through the scheduler), ``/metrics``
(Prometheus). Every error is OpenAI-style JSON; after a stream has started, an error is sent in-band
as a ``data: {"error": ...}`` frame followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec_kit import __version__
from specdec_kit.runtime.engine import Engine
from specdec_kit.runtime.sampling import SamplingParams
from specdec_kit.serving import errors
from specdec_kit.serving.detokenize import IncrementalText
from specdec_kit.serving.metrics import ServerMetrics
from specdec_kit.serving.protocol import ChatCompletionRequest, CompletionRequest, parse
from specdec_kit.serving.scheduler import Delta, Scheduler, ServerRequest

# Used when the tokenizer has no chat template of its own (the demo zoo's code model has none).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def ensure_chat_template(tokenizer) -> None:
    """Chat prompts are built by the tokenizer's own template; one without gets a plain role-prefix format."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_num_seqs: int = 16
    max_queue: int = 256
    drain_timeout: float = 30.0


def usage_body(prompt_tokens: int, completion_tokens: int, stats) -> dict:
    spec = None
    if stats is not None:
        spec = {"draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
                "speculative_cycles": stats.spec_cycles, "cycles": stats.cycles,
                "acceptance_length": round(stats.acceptance_length, 4),
                "accepted_per_depth": stats.accepted_per_depth}
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "spec_decoding": spec}


def error_response(err: errors.APIError) -> JSONResponse:
    headers = {"Retry-After": str(int(err.retry_after))} if err.retry_after is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(engine: Engine, config: ServerConfig, scheduler: Scheduler, metrics: ServerMetrics) -> FastAPI:
    tokenizer = engine.tokenizer
    ensure_chat_template(tokenizer)
    max_context = engine.target.max_context
    state = {"ready": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        await warm_up()
        state["ready"] = True
        yield
        state["ready"] = False
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, config.drain_timeout)

    app = FastAPI(title="specdec", version=__version__, lifespan=lifespan)

    async def warm_up() -> None:
        """A real generation through the scheduler before readiness turns true."""
        req = ServerRequest(tokenizer("Hello")["input_ids"] or [0], 2, SamplingParams(), [], False,
                            asyncio.get_running_loop())
        scheduler.submit(req)
        while (await req.events.get()).finish is None:
            pass

    @app.exception_handler(errors.APIError)
    async def api_error(_: Request, exc: errors.APIError):
        metrics.labels(metrics.errors, type=exc.code or exc.type).inc()
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(errors.APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, code))

    def authorize(request: Request) -> None:
        if not config.api_key:
            return
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise errors.unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(header[7:].strip().encode(), config.api_key.encode()):
            raise errors.unauthorized("Incorrect API key provided")

    async def read_json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise errors.invalid(f"could not parse the request body as JSON ({exc})") from None

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise errors.unknown_model(name, config.model_name)

    def budget(prompt_len: int, requested: int | None) -> int:
        if requested is None:
            if prompt_len >= max_context:
                raise errors.context_length(prompt_len, 1, max_context)
            return max_context - prompt_len
        if prompt_len + requested > max_context:
            raise errors.context_length(prompt_len, requested, max_context)
        return requested

    def sampling(body) -> SamplingParams:
        return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)

    async def events(req: ServerRequest) -> AsyncIterator[Delta]:
        scheduler.submit(req)
        finished = False
        try:
            while not finished:
                delta = await req.events.get()
                finished = delta.finish is not None
                yield delta
        finally:
            if not finished:
                scheduler.cancel(req)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health/ready")
    async def ready():
        if not state["ready"] or not scheduler.accepting:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return {"status": "ready", "model": config.model_name}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info(request: Request):
        """Engine, batching limits and the speculation policy's measurements (cf. SGLang's /get_server_info)."""
        authorize(request)
        m = engine.manifest
        return {"model": config.model_name, "engine": str(engine.path), "backend": m["backend"],
                "draft": m["draft"]["kind"], "tree": m["tree"], "max_num_seqs": config.max_num_seqs,
                "max_queue": config.max_queue, "speculation": scheduler.policy.describe(),
                "running": scheduler.busy()}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        m = engine.manifest
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": int(engine.path.stat().st_mtime), "owned_by": "specdec",
            "max_model_len": max_context,
            "speculative": {"draft": m["draft"]["kind"], "backend": m["backend"], "tree": m["tree"]},
        }]}

    async def run(request: Request, kind: str):
        authorize(request)
        body = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, await read_json(request))
        check_model(body.model)
        stops = body.stop_list()
        if kind == "chat":
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
            prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
            requested = body.max_completion_tokens or body.max_tokens
        else:
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise errors.unsupported("prompt", "one prompt per request (got a batch of %d)" % len(prompt))
                prompt = prompt[0]
            prompt_ids = list(prompt) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
            if not prompt_ids:
                raise errors.invalid("'prompt' is empty", "prompt")
            if any(not isinstance(t, int) or not 0 <= t < engine.target.vocab_size for t in prompt_ids):
                raise errors.invalid(f"prompt token ids must be integers in [0, {engine.target.vocab_size})", "prompt")
            requested = body.max_tokens if body.max_tokens is not None else 16  # OpenAI's completions default
        max_tokens = budget(len(prompt_ids), requested)
        req = ServerRequest(prompt_ids, max_tokens, sampling(body), stops, body.ignore_eos, asyncio.get_running_loop())
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = bool(options and options.continuous_usage_stats)
            stream = events(req)
            first = await anext(stream)  # queue-full errors surface here, as a proper HTTP error
            return StreamingResponse(sse(kind, rid, created, req, first, stream, stops, include_usage, continuous),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        tokens, final = [], None
        async for delta in events(req):
            tokens += delta.tokens
            final = delta
        if final.error is not None:
            raise final.error
        usage = usage_body(len(prompt_ids), len(tokens), final.stats)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text}, "logprobs": None,
                      "finish_reason": final.finish}
            return {"id": rid, "object": "chat.completion", "created": created, "model": config.model_name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": final.text, "logprobs": None, "finish_reason": final.finish}
        return {"id": rid, "object": "text_completion", "created": created, "model": config.model_name,
                "choices": [choice], "usage": usage}

    async def sse(kind, rid, created, req, first, stream, stops, include_usage, continuous):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def frame(choices: list, usage=None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": config.model_name, "choices": choices}
            if continuous and usage is None and choices:
                usage = usage_body(len(req.prompt_ids), len(tokens), None)
            if include_usage or continuous:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def choice(text: str | None, finish: str | None, role: bool = False) -> dict:
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        text = IncrementalText(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stops)
        tokens: list[int] = []
        if kind == "chat":
            yield frame([choice(None, None, role=True)])
        delta = first
        try:
            while True:
                tokens += delta.tokens
                if delta.error is not None:
                    yield f"data: {json.dumps(delta.error.body())}\n\n"
                    break
                piece = text.update(tokens, final_text=delta.text if delta.finish else None)
                if piece:
                    yield frame([choice(piece, None)])
                if delta.finish is not None:
                    yield frame([choice(None if kind == "chat" else "", delta.finish)])
                    if include_usage:
                        yield frame([], usage_body(len(req.prompt_ids), len(tokens), delta.stats))
                    break
                delta = await anext(stream)
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await run(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, "completion")

    return app
