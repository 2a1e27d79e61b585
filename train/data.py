"""Token blocks from the corpus: documents joined with EOS, cut into fixed-length training blocks."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec_kit.train.corpus import Document


def token_stream(tokenizer, docs: Sequence[Document], max_tokens: int | None = None) -> torch.Tensor:
    """All documents' ids, EOS-separated, in corpus order (deterministic), optionally truncated."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


def blocks(stream: torch.Tensor, seq_len: int, seed: int) -> torch.Tensor:
    """[N, seq_len] blocks in a seeded random order."""
    n = stream.numel() // seq_len
    out = stream[: n * seq_len].view(n, seq_len)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return out[order]
