"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, validated at the boundary.

Parameters the server implements: temperature, top_p, top_k, seed, stop, max_tokens /
max_completion_tokens, stream, stream_options.include_usage (and vLLM's continuous_usage_stats, which
lets a client count the tokens of each chunk), ignore_eos, user. Parameters it does not
implement are refused by name (a silently ignored ``n`` or ``logprobs`` would hand the client
something other than what it asked for); so is any field OpenAI's API does not define. Every number
is range-checked here (``seed`` is a 64-bit signed integer, as in vLLM), so a bad value is a 400
naming the parameter and never reaches the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from specdec_kit.runtime.core.sampling import SEED_MAX, SEED_MIN
from specdec_kit.serving.errors import APIError, invalid, unsupported

# field -> the value that means "not used"; anything else is refused
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "top_logprobs": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "parallel_tool_calls": None,
    "logit_bias": None,
    "echo": False,
    "suffix": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "reasoning_effort": None,
    "response_format": None,
    "web_search_options": None,
}
IGNORED_METADATA = ("user", "metadata", "store", "service_tier")
MAX_STOP_CHARS = 1024  # the stream holds back text that could still become a stop string


def whole_number(value: Any) -> Any:
    """A float with no fraction counts as the integer (``1.0`` for ``1``), as JSON Schema and lenient servers take it;
    booleans and strings stay refused (strict mode)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def count(**bounds: int) -> Any:
    """An integer field (whole-number floats accepted) with its bounds, which the served schema states."""
    return Annotated[int, Field(**bounds), BeforeValidator(whole_number)]


NonEmptyText = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: running usage in every chunk


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # JSON types as they are: no "5" for 5, no true for 1

    model: str
    max_tokens: count(ge=1) | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: count(ge=0) = 0
    seed: count(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise invalid(f"'stop' takes at most 4 sequences, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise invalid("'stop' sequences must be non-empty strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise invalid(f"'stop' sequences may be at most {MAX_STOP_CHARS} characters long", "stop")
        return stops

    def check_extras(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_METADATA:
                continue
            if name in UNSUPPORTED_DEFAULTS:
                if is_unused(name, value):
                    continue
                raise unsupported(name, f"got {value!r}")
            raise invalid(f"Unrecognized request argument supplied: {name}", name, "unrecognized_parameter")


class TextPart(BaseModel):
    """The one kind of content part this server takes (the served schema says so)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def text_parts_only(cls, data: Any) -> Any:
        """Another kind of part (an image, audio) is named in the refusal rather than failing the schema."""
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else []:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise unsupported("messages.content", f"content part of type {kind!r} (text only)")
            if not isinstance(part.get("text"), str):
                raise invalid("a text content part needs 'text', a string", "messages")
        return data

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: count(ge=1) | None = None


class CompletionRequest(_Common):
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )


def is_unused(name: str, value: Any) -> bool:
    """Whether an unsupported field carries its "not used" value (``false`` is not ``0``, ``0`` is ``0.0``)."""
    default = UNSUPPORTED_DEFAULTS[name]
    if value is None or (name == "logprobs" and value is False):
        return True
    return (
        isinstance(value, bool) == isinstance(default, bool) and type(value) in (int, float, bool) and value == default
    )


def parse(model: type[BaseModel], body: Any):
    """Validate a JSON body into ``model``; a validation failure is a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid(f"request body must be a JSON object, found {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        # of a union's failures, an empty value says most (the members' type mismatches say little)
        first = next((e for e in errors if e["type"] in ("too_short", "string_too_short")), errors[0])
        # union members appear in the location by type ("prompt.list[int].0"); the message keeps them
        where = ".".join(str(p) for p in first["loc"]) or None
        param = str(first["loc"][0]) if first["loc"] else None
        raise invalid(f"{where}: {first['msg']}" if where else first["msg"], param) from None
    request.check_extras()
    return request


def as_api_error(exc: Exception) -> APIError:
    return exc if isinstance(exc, APIError) else invalid(str(exc))
