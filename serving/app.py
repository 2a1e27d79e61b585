"""The OpenAI-compatible HTTP API over the continuous-batching scheduler (FastAPI).

``/v1/chat/completions`` and ``/v1/completions`` (streaming as server-sent events ending in
``data: [DONE]``, or whole), ``/v1/models``, ``/health`` (liveness), ``/health/ready`` (readiness:
the engine is loaded, a warm-up generation went through the scheduler, and the server is not
draining), ``/metrics`` (Prometheus). Every error is OpenAI-style JSON, unexpected ones included;
after a stream has started, an error is sent in-band as a ``data: {"error": ...}`` frame followed by
``[DONE]``.

Nothing heavy runs on the event loop: the body is read against a size limit and everything after it
(JSON, validation, chat template, tokenization) runs in a worker thread. A client that disconnects
frees its row, streaming or not.

The pieces are module-level: ``ServerState`` (what every route reads), one function per route on an
``APIRouter``, prompt building (``prompting.py``) and response bodies (``responses.py``); ``create_app``
only wires them together.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec_kit import __version__
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.engine import Engine
from specdec_kit.serving import errors
from specdec_kit.serving.intake import DEFAULT_MAX_REQUEST_BYTES, parse_json, read_body
from specdec_kit.serving.metrics import ServerMetrics
from specdec_kit.serving.openapi import AUTH_RESPONSES, completion_route_docs, install_schemas
from specdec_kit.serving.prompting import chat_prompt, completion_prompt, ensure_chat_template, token_budget
from specdec_kit.serving.protocol import ChatCompletionRequest, CompletionRequest, parse
from specdec_kit.serving.responses import EventStream, Reply
from specdec_kit.serving.scheduler import Delta, Scheduler, ServerRequest

__all__ = ["ServerConfig", "create_app", "ensure_chat_template"]

logger = logging.getLogger("specdec_kit.serving")


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_num_seqs: int = 16
    max_queue: int = 256
    drain_timeout: float = 30.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_model_len: int | None = None  # a tighter context than the engine's (prompt + completion tokens)


@dataclass
class ServerState:
    """What the routes share: the engine, the scheduler and metrics, the settings, and readiness."""

    engine: Engine
    config: ServerConfig
    scheduler: Scheduler
    metrics: ServerMetrics
    ready: bool = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        return min(self.engine.target.max_context, self.config.max_model_len or self.engine.target.max_context)


def _state(request: Request) -> ServerState:
    return request.app.state.specdec


def error_response(err: errors.APIError) -> JSONResponse:
    headers = {"Retry-After": str(int(err.retry_after))} if err.retry_after is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def authorize(state: ServerState, request: Request) -> None:
    key = state.config.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    if not header.lower().startswith("bearer "):
        raise errors.unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(header[7:].strip().encode(), key.encode()):
        raise errors.unauthorized("Incorrect API key provided")


def sampling(body) -> SamplingParams:
    return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)


async def request_events(scheduler: Scheduler, req: ServerRequest) -> AsyncIterator[Delta]:
    """Submit ``req`` and yield its events; a consumer that stops early cancels the request (frees its row).
    Tokens count as read once yielded: the scheduler bounds what is generated but not yet read."""
    scheduler.submit(req)
    finished = False
    try:
        while not finished:
            delta = await req.events.get()
            finished = delta.finish is not None
            req.read += len(delta.tokens)
            yield delta
    finally:
        if not finished:
            scheduler.cancel(req)


async def warm_up(state: ServerState) -> None:
    """A real generation through the scheduler before readiness turns true."""
    req = ServerRequest(
        state.tokenizer("Hello")["input_ids"] or [0],
        2,
        SamplingParams(),
        [],
        False,
        asyncio.get_running_loop(),
        request_id="warm-up",
    )
    async for _ in request_events(state.scheduler, req):
        pass


router = APIRouter()


@router.get("/health", responses={200: {"description": "the process is alive (no engine work involved)"}})
async def health():
    return {"status": "ok"}


@router.get("/health/ready", responses={503: {"description": "not ready: warming up or draining"}})
async def ready(request: Request):
    state = _state(request)
    if not state.ready or not state.scheduler.accepting:
        return JSONResponse({"status": "not ready"}, status_code=503)
    return {"status": "ready", "model": state.config.model_name}


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
    },
)
async def prometheus(request: Request):
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/server_info", responses=AUTH_RESPONSES)
async def server_info(request: Request):
    """Engine, batching limits and the speculation policy's measurements (cf. SGLang's /get_server_info)."""
    state = _state(request)
    authorize(state, request)
    m, c = state.engine.manifest, state.config
    quantized = m.get("onnx", {}).get("weights", {})  # ONNX Runtime engines built with quantized weights
    return {
        "model": c.model_name,
        "engine": str(state.engine.path),
        "backend": m["backend"],
        "dtype": m["dtype"],
        "weights": {part: quantized.get(part, {}).get("format", "float") for part in ("target", "draft")},
        "draft": m["draft"]["kind"],
        "tree": m["tree"],
        "max_num_seqs": c.max_num_seqs,
        "max_queue": c.max_queue,
        "speculation": state.scheduler.policy.describe(),
        "running": state.scheduler.busy(),
    }


@router.get("/v1/models", responses=AUTH_RESPONSES)
async def models(request: Request):
    state = _state(request)
    authorize(state, request)
    m = state.engine.manifest
    return {
        "object": "list",
        "data": [
            {
                "id": state.config.model_name,
                "object": "model",
                "created": int(state.engine.path.stat().st_mtime),
                "owned_by": "specdec",
                "max_model_len": state.max_context,
                "speculative": {"draft": m["draft"]["kind"], "backend": m["backend"], "tree": m["tree"]},
            }
        ],
    }


@dataclass
class Prepared:
    """A validated request, ready for the scheduler."""

    body: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    max_tokens: int
    stops: list[str]


def prepare(state: ServerState, kind: str, raw: bytes) -> Prepared:
    """JSON -> validated request -> prompt ids and token budget (runs in a worker thread)."""
    body = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, parse_json(raw))
    if body.model != state.config.model_name:
        raise errors.unknown_model(body.model, state.config.model_name)
    stops = body.stop_list()
    if kind == "chat":
        prompt_ids, requested = chat_prompt(state.tokenizer, body)
    else:
        prompt_ids, requested = completion_prompt(state.tokenizer, body, state.engine.target.vocab_size)
    return Prepared(body, prompt_ids, token_budget(len(prompt_ids), requested, state.max_context), stops)


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, step):
    """Await ``step`` unless the client disconnects first (then None)."""
    work = asyncio.ensure_future(step)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # the request's event generator closes, which cancels the request
            await asyncio.gather(work, return_exceptions=True)
    return None if work.cancelled() else work.result()


async def collect(events: AsyncIterator[Delta]) -> tuple[list[int], Delta]:
    tokens, final = [], None
    async for delta in events:
        tokens += delta.tokens
        final = delta
    return tokens, final


async def generate(request: Request, kind: str):
    """Both completion routes: read and prepare the request off the loop, then answer whole or as a stream."""
    state = _state(request)
    authorize(state, request)
    raw = await read_body(request, state.config.max_request_bytes)
    prepared = await asyncio.to_thread(prepare, state, kind, raw)
    body = prepared.body
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    req = ServerRequest(
        prepared.prompt_ids,
        prepared.max_tokens,
        sampling(body),
        prepared.stops,
        body.ignore_eos,
        asyncio.get_running_loop(),
        request_id=rid,
    )
    reply = Reply(kind, rid, int(time.time()), state.config.model_name, len(prepared.prompt_ids))
    events = request_events(state.scheduler, req)
    headers = {"X-Request-Id": rid}
    try:
        if body.stream:
            first = await unless_disconnected(request, anext(events))  # queue-full errors surface here, as HTTP
            if first is None:
                return Response(status_code=499)  # nobody is listening
            options = body.stream_options
            stream = EventStream(
                reply, bool(options and options.include_usage), bool(options and options.continuous_usage_stats)
            )
            return StreamingResponse(
                stream.frames(first, events, state.tokenizer, prepared.stops),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
        outcome = await unless_disconnected(request, collect(events))
    except BaseException:
        await events.aclose()
        raise
    if outcome is None:
        await events.aclose()  # frees the row
        logger.info("request %s: the client disconnected; its generation was stopped", rid)
        return Response(status_code=499)
    tokens, final = outcome
    if final.error is not None:
        raise final.error
    return JSONResponse(reply.whole(final.text, final.finish, len(tokens), final.stats), headers=headers)


@router.post("/v1/chat/completions", **completion_route_docs(ChatCompletionRequest, "chat"))
async def chat(request: Request):
    return await generate(request, "chat")


@router.post("/v1/completions", **completion_route_docs(CompletionRequest, "completion"))
async def completions(request: Request):
    return await generate(request, "completion")


def create_app(engine: Engine, config: ServerConfig, scheduler: Scheduler, metrics: ServerMetrics) -> FastAPI:
    ensure_chat_template(engine.tokenizer)
    state = ServerState(engine, config, scheduler, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        await warm_up(state)
        state.ready = True
        yield
        state.ready = False
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, config.drain_timeout)

    app = FastAPI(title="specdec", version=__version__, lifespan=lifespan)
    app.state.specdec = state

    @app.exception_handler(errors.APIError)
    async def api_error(_: Request, exc: errors.APIError):
        if not exc.counted:
            metrics.labels(metrics.errors, type=exc.code or exc.type).inc()
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = error_response(
            errors.APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, code)
        )
        response.headers.update(exc.headers or {})  # 405 carries Allow
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc, exc_info=exc)
        metrics.labels(metrics.errors, type="internal_error").inc()
        return error_response(
            errors.APIError(500, f"internal error: {type(exc).__name__}", "server_error", None, "internal_error")
        )

    app.include_router(router)
    install_schemas(app, config.model_name, bearer_auth=bool(config.api_key))
    return app
