"""OpenAI response bodies: whole completions, and the server-sent events of a streamed one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator

from specdec_kit.serving.detokenize import IncrementalText
from specdec_kit.serving.scheduler import Delta


def usage_body(prompt_tokens: int, completion_tokens: int, stats) -> dict:
    """OpenAI's usage, plus ``spec_decoding`` (the request's speculation statistics) and OpenAI's
    ``prompt_tokens_details.cached_tokens`` (prompt tokens the prefix cache held) when ``stats`` is given."""
    spec = details = None
    if stats is not None:
        details = {"cached_tokens": stats.cached_tokens}
        spec = {
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "speculative_cycles": stats.spec_cycles,
            "cycles": stats.cycles,
            "acceptance_length": round(stats.acceptance_length, 4),
            "accepted_per_depth": stats.accepted_per_depth,
        }
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
        "spec_decoding": spec,
    }


@dataclass
class Reply:
    """What every response of one request shares: its kind (``chat`` or ``completion``), id, time, model."""

    kind: str
    rid: str
    created: int
    model: str
    prompt_tokens: int

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat"

    def whole(self, text: str, finish: str, completion_tokens: int, stats) -> dict:
        """The non-streaming response body."""
        usage = usage_body(self.prompt_tokens, completion_tokens, stats)
        if self.is_chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            return {
                "id": self.rid,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": usage,
            }
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }


@dataclass
class EventStream:
    """The SSE frames of one streamed response (``include_usage``: a final usage chunk; ``continuous``: vLLM's
    running usage in every chunk)."""

    reply: Reply
    include_usage: bool
    continuous: bool
    tokens: list[int] = field(default_factory=list)

    def frame(self, choices: list, usage: dict | None = None) -> str:
        r = self.reply
        body = {
            "id": r.rid,
            "object": "chat.completion.chunk" if r.is_chat else "text_completion",
            "created": r.created,
            "model": r.model,
            "choices": choices,
        }
        if self.continuous and usage is None and choices:
            usage = usage_body(r.prompt_tokens, len(self.tokens), None)
        if self.include_usage or self.continuous:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.reply.is_chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    async def frames(self, first: Delta, rest: AsyncIterator[Delta], tokenizer, stops: list[str]) -> AsyncIterator[str]:
        """All frames from the request's first event on; an error after the start goes in-band, then [DONE]."""
        text = IncrementalText(tokenizer, stops)
        if self.reply.is_chat:
            yield self.frame([self.choice(None, None, role=True)])
        delta = first
        try:
            while True:
                self.tokens += delta.tokens
                if delta.error is not None:
                    yield f"data: {json.dumps(delta.error.body())}\n\n"
                    break
                piece = text.update(self.tokens, final_text=delta.text if delta.finish else None)
                if piece:
                    yield self.frame([self.choice(piece, None)])
                if delta.finish is not None:
                    yield self.frame([self.choice(None if self.reply.is_chat else "", delta.finish)])
                    if self.include_usage:
                        yield self.frame([], usage_body(self.reply.prompt_tokens, len(self.tokens), delta.stats))
                    break
                delta = await anext(rest)
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"
