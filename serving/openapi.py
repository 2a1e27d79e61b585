"""The served OpenAPI schema: request bodies, response bodies and every error the routes answer.

The completion routes read their bodies themselves (to bound their size and validate off the event
loop), so FastAPI cannot see the request models; this module declares them, exactly as ``parse``
accepts them: the protocol models, with the OpenAI fields the server refuses unless they carry their
"unused" value, and nothing else. SDK generators and API fuzzers read this document.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from specdec_kit.serving.protocol import (
    IGNORED_METADATA,
    UNSUPPORTED_DEFAULTS,
    ChatCompletionRequest,
    CompletionRequest,
)

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class SpecDecoding(BaseModel):
    draft_tokens: int
    accepted_tokens: int
    speculative_cycles: int
    cycles: int
    acceptance_length: float
    accepted_per_depth: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec_decoding: SpecDecoding | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None
    finish_reason: Literal["stop", "length", "cancelled"] | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length", "cancelled"] | None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


def sse_event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event: its ``data`` is a JSON chunk, an in-band error, or the final ``[DONE]``."""
    payload = {"anyOf": [{"$ref": REF.format(model=chunk.__name__)}, {"$ref": REF.format(model="ErrorResponse")}]}
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]
    }
    return {"type": "object", "properties": {"event": {"type": "string"}, "data": data}, "required": ["data"]}


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request (the error names the parameter)"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "request body over the server's limit"},
    429: {"model": ErrorResponse, "description": "request queue full", "headers": RETRY_AFTER},
    500: {"model": ErrorResponse, "description": "generation failed for this request"},
    503: {"model": ErrorResponse, "description": "overloaded or shutting down", "headers": RETRY_AFTER},
}
AUTH_RESPONSES = {401: ERROR_RESPONSES[401]}


def completion_route_docs(request_model: type[BaseModel], kind: str) -> dict[str, Any]:
    """``responses`` and ``openapi_extra`` for one completion route."""
    whole, chunk = (ChatCompletion, ChatCompletionChunk) if kind == "chat" else (Completion, CompletionChunk)
    ok = {
        "model": whole,
        "description": "the completion, or with ``stream`` server-sent events ending in [DONE]",
        "content": {"text/event-stream": {"schema": sse_event_schema(chunk)}},
    }
    body = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": REF.format(model=request_model.__name__)}}},
    }
    return {"responses": {200: ok, **ERROR_RESPONSES}, "openapi_extra": {"requestBody": body}}


def _exact_request_schema(schema: dict) -> None:
    """What ``parse`` accepts: the model's fields, unsupported OpenAI fields at their unused value, metadata."""
    props = schema.setdefault("properties", {})
    for name, unused in UNSUPPORTED_DEFAULTS.items():
        values = [unused, None] + ([False] if name == "logprobs" else [])
        props.setdefault(name, {"enum": list(dict.fromkeys(values)), "description": "not supported: only this value"})
    for name in IGNORED_METADATA:
        props.setdefault(name, {"description": "accepted and ignored"})
    schema["additionalProperties"] = False


def install_schemas(app: FastAPI, model_name: str, bearer_auth: bool) -> None:
    """Make ``app.openapi()`` include the request models the completion routes refer to (their ``model`` is
    the one name this server answers to) and, with an API key, the bearer scheme of the routes that need it."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        models = [ChatCompletionRequest, CompletionRequest, ChatCompletionChunk, CompletionChunk, ErrorResponse]
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs["$defs"])
        for model in (ChatCompletionRequest, CompletionRequest):
            _exact_request_schema(components[model.__name__])
            components[model.__name__]["properties"]["model"]["enum"] = [model_name]
        if bearer_auth:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                if path.startswith("/v1/") or path == "/server_info":
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
