"""A byte-level BPE tokenizer trained on the corpus (for the demo target), saved as a HF fast tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, path: Path | None = None):
    """Train byte-level BPE; returns a ``PreTrainedTokenizerFast`` (also saved to ``path`` if given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    if path is not None:
        fast.save_pretrained(path)
    return fast
