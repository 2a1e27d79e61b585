"""A request's own tokens joining a reduced draft vocabulary.

A GRIFFIN/EAGLE/HASS head with a draft vocabulary ranks its children over the target's LM head rows of that
vocabulary alone (SmolLM2's heads: 8,192 of 49,152 ids, the training answers' most frequent), so it can never propose
a token outside it. Answers copy names, numbers, identifiers and foreign words from their prompts and from themselves:
on SmolLM2 8-20% of the target's answer tokens lie outside the vocabulary, most of them in the prompt, and each ends
the cycle's accepted path. ``JoinedTokens`` keeps, per row, the tokens outside the vocabulary that the row's draft has
read (its prompt, then what verification accepted), and hands the draft step their target LM head rows
(``PromptVocab``), which the step ranks beside its own: no retraining, since a feature head predicts the target's
hidden state and the rows are the target's. The draft only proposes, so the output stays the target's.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TypeVar

import torch

from specdec_kit.runtime.drafts.layers import PromptVocab, TargetRowsHead

JOINED_VOCAB_FILE = "joined_vocab.safetensors"  # an ONNX Runtime engine's draft ids and the target's LM head rows
D = TypeVar("D")  # a drafter of any kind


def joins_request_tokens(head: torch.nn.Module) -> bool:
    """Whether a draft over ``head`` can rank requests' own tokens beside its vocabulary: a reduced vocabulary over
    the target's LM head rows (an EAGLE-3 head's own LM head has no rows for the tokens outside it)."""
    return isinstance(head, TargetRowsHead)


class JoinedTokens:
    """Per row, the tokens outside the draft vocabulary that its draft read, in the order it read them (at most
    ``limit`` a row: a long prompt's rarest words past that are left out)."""

    limit = 1024

    def __init__(self, draft_ids: torch.Tensor, target_rows: torch.Tensor):
        self.target_rows = target_rows
        self.outside = torch.ones(target_rows.shape[0], dtype=torch.bool, device=target_rows.device)
        self.outside[draft_ids.to(target_rows.device)] = False
        self.rows: list[list[int]] = []
        self._seen: list[set[int]] = []
        self._vocab: PromptVocab | None = None

    @classmethod
    def for_head(cls, head: torch.nn.Module) -> "JoinedTokens | None":
        """A fresh state over a PyTorch head's rows, or None for a head that joins no tokens."""
        return cls(head.ids, head.target_rows) if joins_request_tokens(head) else None

    @classmethod
    def of_engine(cls, path: Path, device: torch.device, dtype: torch.dtype) -> "JoinedTokens":
        """A fresh state over an engine's file (read once per process: every drafter of the engine shares it)."""
        path = Path(path).resolve()
        stat = path.stat()  # a rebuilt engine's file is another file
        return cls(*_engine_tensors(path, (stat.st_mtime_ns, stat.st_size), str(device), dtype))

    def reset(self, batch: int) -> None:
        self.rows, self._seen, self._vocab = [[] for _ in range(batch)], [set() for _ in range(batch)], None

    def select_rows(self, rows: torch.Tensor) -> None:
        kept = rows.tolist()
        self.rows, self._seen, self._vocab = [self.rows[i] for i in kept], [self._seen[i] for i in kept], None

    def add_rows(self, count: int) -> None:
        self.rows += [[] for _ in range(count)]
        self._seen += [set() for _ in range(count)]
        self._vocab = None

    def take(self, count: int) -> tuple[list, list]:
        """Set aside the current rows' state for ``count`` fresh rows (a join reads its rows apart); ``give`` puts it
        back before them."""
        state = self.rows, self._seen
        self.reset(count)
        return state

    def give(self, state: tuple[list, list]) -> None:
        self.rows, self._seen, self._vocab = state[0] + self.rows, state[1] + self._seen, None

    def read(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """The rows' next ``counts`` tokens [B, W] (padding past each row's count)."""
        valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < counts[:, None]
        found = valid & self.outside[tokens.to(self.outside.device)].to(valid.device)
        if not bool(found.any()):
            return
        for b in found.any(dim=1).nonzero()[:, 0].tolist():
            seen, row = self._seen[b], self.rows[b]
            for token in tokens[b][found[b]].tolist():
                if token not in seen and len(row) < self.limit:
                    seen.add(token)
                    row.append(token)
                    self._vocab = None

    def vocab(self) -> PromptVocab:
        """The rows' joined tokens as the draft step takes them (each row padded with -1 to the longest, at least
        one slot)."""
        if self._vocab is None:
            width = max([1, *(len(r) for r in self.rows)])
            ids = torch.full((len(self.rows), width), -1, dtype=torch.long)
            for b, row in enumerate(self.rows):
                ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            ids = ids.to(self.target_rows.device)
            self._vocab = PromptVocab(ids, self.target_rows[ids.clamp(min=0)])
        return self._vocab


def keep_draft_vocabulary(drafter: D) -> D:
    """``drafter`` with its draft vocabulary as trained: no request's tokens join it (a drafter without a reduced
    vocabulary is returned as it is)."""
    if getattr(drafter, "joined", None) is not None:
        drafter.joined = None
    return drafter


@functools.cache
def _engine_tensors(path: Path, version: tuple, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(path), device=device)
    return tensors["draft_ids"], tensors["target_rows"].to(dtype)


def write_joined_vocab(path: Path, draft_ids: torch.Tensor, target_rows: torch.Tensor) -> None:
    """What an ONNX Runtime engine's drafter joins tokens with: the draft's vocabulary and the target's LM head."""
    from safetensors.torch import save_file

    save_file({"draft_ids": draft_ids.contiguous().cpu(), "target_rows": target_rows.contiguous().cpu()}, str(path))
