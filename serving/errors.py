"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Every failure a client can cause (validation, body size, context length, unknown model,
authentication, overload, shutdown) is an ``APIError``; the app turns it into this JSON (or an
in-band SSE frame once a stream has started) and keeps serving. A request that fails inside the
engine gets ``internal`` (500, with its request id) and fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None
    counted: bool = field(default=False, compare=False)  # already in the error metrics (by the scheduler)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, detail: str = "") -> APIError:
    return APIError(
        400,
        f"'{param}' is not supported by this server{': ' + detail if detail else ''}",
        "invalid_request_error",
        param,
        "unsupported_parameter",
    )


def context_length(prompt_tokens: int, max_tokens: int, limit: int) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
        f"completion). Please reduce the length of the messages or completion.",
        "invalid_request_error",
        "messages",
        "context_length_exceeded",
    )


def unknown_model(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model '{name}' does not exist; this server serves '{served}'",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def unauthorized(reason: str) -> APIError:
    return APIError(401, reason, "authentication_error", None, "invalid_api_key")


def overloaded(status: int, retry_after: float) -> APIError:
    return APIError(
        status,
        "The server is overloaded: its request queue is full; retry later",
        "server_overloaded" if status == 503 else "rate_limit_exceeded",
        None,
        "queue_full",
        retry_after=retry_after,
    )


def draining(retry_after: float) -> APIError:
    return APIError(
        503,
        "The server is shutting down and takes no new requests; retry on another replica",
        "server_overloaded",
        None,
        "shutting_down",
        retry_after=retry_after,
    )


def too_large(limit: int, size: int | None) -> APIError:
    """``size`` is the declared length; a chunked body is refused once its count passes the limit (size unknown)."""
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes (sent in chunks)"
    return APIError(
        413,
        f"The request body is too large: {got}; this server accepts at most {limit} bytes",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def internal(request_id: str, exc: BaseException) -> APIError:
    return APIError(
        500,
        f"generation failed for request {request_id}: {type(exc).__name__}: {exc}",
        "server_error",
        None,
        "internal_error",
    )


def slow_reader(unread: int, limit: int) -> APIError:
    return APIError(
        408,
        f"the client read too slowly: {unread} generated tokens were waiting to be sent (the limit is "
        f"{limit}); the request was stopped to bound the server's memory",
        "invalid_request_error",
        None,
        "slow_reader",
    )
