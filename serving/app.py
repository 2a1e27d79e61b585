"""The OpenAI-compatible HTTP API over the continuous-batching scheduler (FastAPI).

``/v1/chat/completions`` and ``/v1/completions`` (streaming as server-sent events ending in
``data: [DONE]``, or whole), ``/v1/models``, ``/health`` (liveness), ``/health/ready`` (readiness:
the engine is loaded and a warm-up generation went through the scheduler), ``/metrics``
(Prometheus). Every error is OpenAI-style JSON; after a stream has started, an error is sent in-band
as a ``data: {"error": ...}`` frame followed by ``[DONE]``.

The pieces are module-level: ``ServerState`` (what every route reads), one function per route on an
``APIRouter``, prompt building (``prompting.py``) and response bodies (``responses.py``); ``create_app``
only wires them together.
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

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec_kit import __version__
from specdec_kit.runtime.engine import Engine
from specdec_kit.runtime.sampling import SamplingParams
from specdec_kit.serving import errors
from specdec_kit.serving.metrics import ServerMetrics
from specdec_kit.serving.prompting import chat_prompt, completion_prompt, ensure_chat_template, token_budget
from specdec_kit.serving.protocol import ChatCompletionRequest, CompletionRequest, parse
from specdec_kit.serving.responses import EventStream, Reply
from specdec_kit.serving.scheduler import Delta, Scheduler, ServerRequest

__all__ = ["ServerConfig", "create_app", "ensure_chat_template"]


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_num_seqs: int = 16
    max_queue: int = 256
    drain_timeout: float = 30.0


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
        return self.engine.target.max_context


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


async def read_json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise errors.invalid(f"could not parse the request body as JSON ({exc})") from None


def sampling(body) -> SamplingParams:
    return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)


async def request_events(scheduler: Scheduler, req: ServerRequest) -> AsyncIterator[Delta]:
    """Submit ``req`` and yield its events; a consumer that stops early cancels the request (frees its row)."""
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


async def warm_up(state: ServerState) -> None:
    """A real generation through the scheduler before readiness turns true."""
    req = ServerRequest(state.tokenizer("Hello")["input_ids"] or [0], 2, SamplingParams(), [], False,
                        asyncio.get_running_loop())
    async for _ in request_events(state.scheduler, req):
        pass


router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(request: Request):
    state = _state(request)
    if not state.ready or not state.scheduler.accepting:
        return JSONResponse({"status": "not ready"}, status_code=503)
    return {"status": "ready", "model": state.config.model_name}


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/server_info")
async def server_info(request: Request):
    """Engine, batching limits and the speculation policy's measurements (cf. SGLang's /get_server_info)."""
    state = _state(request)
    authorize(state, request)
    m, c = state.engine.manifest, state.config
    return {"model": c.model_name, "engine": str(state.engine.path), "backend": m["backend"],
            "draft": m["draft"]["kind"], "tree": m["tree"], "max_num_seqs": c.max_num_seqs,
            "max_queue": c.max_queue, "speculation": state.scheduler.policy.describe(),
            "running": state.scheduler.busy()}


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    authorize(state, request)
    m = state.engine.manifest
    return {"object": "list", "data": [{
        "id": state.config.model_name, "object": "model", "created": int(state.engine.path.stat().st_mtime),
        "owned_by": "specdec", "max_model_len": state.max_context,
        "speculative": {"draft": m["draft"]["kind"], "backend": m["backend"], "tree": m["tree"]},
    }]}


async def generate(request: Request, kind: str):
    """Both completion routes: parse, build the prompt, then answer whole or as a stream."""
    state = _state(request)
    authorize(state, request)
    body = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, await read_json(request))
    if body.model != state.config.model_name:
        raise errors.unknown_model(body.model, state.config.model_name)
    if kind == "chat":
        prompt_ids, requested = chat_prompt(state.tokenizer, body)
    else:
        prompt_ids, requested = completion_prompt(state.tokenizer, body, state.engine.target.vocab_size)
    max_tokens = token_budget(len(prompt_ids), requested, state.max_context)
    stops = body.stop_list()
    req = ServerRequest(prompt_ids, max_tokens, sampling(body), stops, body.ignore_eos, asyncio.get_running_loop())
    reply = Reply(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex, int(time.time()),
                  state.config.model_name, len(prompt_ids))
    events = request_events(state.scheduler, req)
    if body.stream:
        options = body.stream_options
        stream = EventStream(reply, bool(options and options.include_usage),
                             bool(options and options.continuous_usage_stats))
        first = await anext(events)  # queue-full errors surface here, as a proper HTTP error
        decode = lambda ids: state.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return StreamingResponse(stream.frames(first, events, decode, stops), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    tokens, final = [], None
    async for delta in events:
        tokens += delta.tokens
        final = delta
    if final.error is not None:
        raise final.error
    return reply.whole(final.text, final.finish, len(tokens), final.stats)


@router.post("/v1/chat/completions")
async def chat(request: Request):
    return await generate(request, "chat")


@router.post("/v1/completions")
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
        metrics.labels(metrics.errors, type=exc.code or exc.type).inc()
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(errors.APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, code))

    app.include_router(router)
    return app
