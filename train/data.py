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


@torch.inference_mode()
def target_continuations(hf_model, prompts: torch.Tensor, seq_len: int, batch: int = 64) -> torch.Tensor:
    """[N, seq_len] blocks whose tails the target wrote itself: each row of ``prompts`` [N, P] continued greedily
    to ``seq_len`` tokens (what a draft that guesses several tokens ahead, DFlash, must learn from: the target's own
    continuation, not the corpus's)."""
    rows = []
    for start in range(0, prompts.shape[0], batch):
        part = prompts[start : start + batch]
        out = hf_model.generate(
            part,
            attention_mask=torch.ones_like(part),
            max_new_tokens=seq_len - part.shape[1],
            min_new_tokens=seq_len - part.shape[1],
            do_sample=False,
            pad_token_id=0,
        )
        rows.append(out[:, :seq_len])
    return torch.cat(rows)
