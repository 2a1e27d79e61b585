"""Streaming text from token ids: send only what can no longer change.

A speculative cycle delivers several tokens at once, byte-level BPE can split a character across
tokens (the decoder shows U+FFFD until it completes), and a stop string may be arriving piece by
piece; so each update decodes the whole completion and holds back an incomplete character and any
tail that could still become a stop string. The final update sends the generator's own final text
(already cut at the stop string).
"""

from __future__ import annotations

from typing import Callable, Sequence


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode, self.stops = decode, [s for s in stops if s]
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

    def update(self, tokens: list[int], final_text: str | None = None) -> str:
        if final_text is not None:
            text, end = final_text, len(final_text)
        else:
            text = self.decode(tokens)
            end = len(text.rstrip("\ufffd"))
            end -= self._holdback(text[:end])
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece
