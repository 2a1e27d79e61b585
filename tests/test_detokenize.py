"""The server's streaming detokenizer: the pieces it sends add up to the tokenizer's own decoding, a character split
across tokens is never sent half, a possible stop string is held back, and a fast tokenizer is decoded
incrementally (never the whole completion again)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from specdec_kit.paths import default_zoo
from specdec_kit.serving.detokenize import IncrementalText


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_zoo() / "tokenizer")


class SlowTokenizer:
    """A tokenizer without a ``tokenizers`` backend: only ``decode``."""

    def __init__(self, fast):
        self.fast = fast

    def decode(self, ids, skip_special_tokens=True):
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)


class NoWholeDecode:
    """A fast tokenizer whose ``decode`` must not be called."""

    def __init__(self, fast):
        self.backend_tokenizer = fast.backend_tokenizer

    def decode(self, ids, skip_special_tokens=True):
        raise AssertionError("the streaming path decoded the whole completion")


def stream(text: IncrementalText, tokens: list[int], chunks: list[int]) -> list[str]:
    pieces, fed = [], 0
    for size in chunks:
        fed = min(len(tokens), fed + size)
        pieces.append(text.update(tokens[:fed]))
    return pieces


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_pieces_add_up_to_the_decoded_text(tokenizer, kind):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(200):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        chunks = [rng.randrange(1, 6) for _ in range(len(tokens))]
        text = IncrementalText(tokenizer if kind == "fast" else SlowTokenizer(tokenizer))
        full = tokenizer.decode(tokens, skip_special_tokens=True)
        sent = "".join(stream(text, tokens, chunks))
        assert full.startswith(sent)
        assert sent + text.update(tokens, final_text=full) == full


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_a_character_split_across_tokens_is_sent_whole(tokenizer, kind):
    words = "naïve café – 日本語 ✓ emoji 🎉 done"
    tokens = tokenizer.encode(words, add_special_tokens=False)
    assert len(tokens) > len(words.split())  # the multibyte characters take several byte-level tokens
    text = IncrementalText(tokenizer if kind == "fast" else SlowTokenizer(tokenizer))
    pieces = stream(text, tokens, [1] * len(tokens))
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == words


def test_a_possible_stop_string_is_held_back(tokenizer):
    head, tail, rest = (tokenizer.encode(t, add_special_tokens=False) for t in ("x = 1 # ", "STO", "RE"))
    text = IncrementalText(tokenizer, stops=["STOP"])
    sent = "".join(stream(text, head + tail, [1] * len(head + tail)))
    assert sent == "x = 1 # "  # "STO" may still become "STOP"
    assert text.update(head + tail + rest) == "STORE"  # now it cannot


def test_a_fast_tokenizer_is_decoded_incrementally(tokenizer):
    tokens = tokenizer.encode("def f(x):\n    return x * 2\n" * 20, add_special_tokens=False)
    text = IncrementalText(NoWholeDecode(tokenizer))
    assert "".join(stream(text, tokens, [3] * len(tokens))) == tokenizer.decode(tokens, skip_special_tokens=True)
