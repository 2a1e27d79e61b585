"""From raw request bytes to a validated request, safely: bounded size, strict JSON, encodable text.

The body is read against a byte limit (a declared ``Content-Length`` over it is refused before a byte
is read, a chunked body as soon as it passes it: 413). Parsing, validation, the chat template and
tokenization then run in a worker thread (``prepare``), so a large or slow request never holds the
event loop that answers ``/health`` and streams everyone else's tokens.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from specdec_kit.serving import errors

if TYPE_CHECKING:
    from fastapi import Request

DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024  # a 128k-token prompt is about 0.5 MB of text


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it is known to be larger than ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise errors.invalid(f"the Content-Length header is not a number: {declared!r}") from None
        if size > limit:
            raise errors.too_large(limit, size)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise errors.too_large(limit, None)
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    """Strict JSON (no NaN or Infinity), every string valid Unicode; errors name what is wrong and where."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.invalid(f"could not parse the request body as JSON ({exc})") from None
    except RecursionError:
        raise errors.invalid("could not parse the request body as JSON (nested too deeply)") from None
    check_unicode(body)
    return body


def check_unicode(body: Any) -> None:
    """Refuse strings (keys too) that cannot be encoded as UTF-8: JSON escapes can spell lone surrogates
    (``"\\ud800"``) that no tokenizer accepts."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                _encodable(key, where or "body")
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _encodable(value, where)


def _encodable(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise errors.invalid(
            f"{where}: the text contains U+{ord(bad):04X} at character {exc.start}, a lone surrogate "
            "that is not valid Unicode; send UTF-8 text",
            where,
        ) from None
