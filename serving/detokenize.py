"""Streaming text from token ids: send only what can no longer change.

A speculative cycle delivers several tokens at once, byte-level BPE can split a character across
tokens, and a stop string may be arriving piece by piece. Fast tokenizers decode incrementally with
``tokenizers``' ``DecodeStream`` (each token is decoded once, and a character split across tokens is held
until it completes), so a long completion costs linear, not quadratic, time; a tokenizer without a
``tokenizers`` backend decodes the whole completion on every update and holds back a trailing incomplete
character (U+FFFD). Either way a tail that could still become a stop string is held back. The final update
sends the generator's own final text (already cut at the stop string).
"""

from __future__ import annotations

from typing import Sequence


class IncrementalText:
    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = None
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=True)
        self.fed = 0  # tokens given to the stream so far
        self.decoded = ""  # the stream's text so far
        self.sent = 0

    def _holdback(self, text: str) -> int:
        """Length of the tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    longest = max(longest, n)
                    break
        return longest

    def _text(self, tokens: list[int]) -> tuple[str, int]:
        """The completion's text and how much of it is complete characters."""
        if self.stream is None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            return text, len(text.rstrip("\ufffd"))
        if len(tokens) > self.fed:
            piece = self.stream.step(self.backend, list(tokens[self.fed :]))
            self.fed = len(tokens)
            if piece:
                self.decoded += piece
        return self.decoded, len(self.decoded)

    def update(self, tokens: list[int], final_text: str | None = None) -> str:
        if final_text is not None:
            text, end = final_text, len(final_text)
        else:
            text, end = self._text(tokens)
            end -= self._holdback(text[:end])
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent : end], end
        return piece
