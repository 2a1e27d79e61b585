"""Self-distilled data (``train/distill.py``) as training batches for the draft trainers.

Samples of similar length share a batch of at most ``tokens_per_batch`` tokens (right-padded: a real position never
attends to a pad, which comes after it), and the batches come in a fixed shuffled order, so a resumed run sees the
same batches. Only the tokens stay in host memory; a batch's features are read from the shards when it is built
(memory-mapped by safetensors, so the page cache holds what fits: a 2.5M-token set's four feature columns are 16 GB)
and handed over on ``device`` (the trainer's), where the target's logits are computed. Each batch carries the
draft's input features (the final hidden state for EAGLE/HASS/GRIFFIN, the three tapped layers side by side for
EAGLE-3), the target's logits over the head's vocabulary (the target's LM-head rows of that vocabulary applied to the
final state: exactly the target's logits there), and masks: ``valid`` (not padding) and ``counted`` (the position's
next token is part of an answer, so its prediction counts in the loss: where the target's next token is recorded,
``top`` >= 0; the kit's own data records it from the last prompt position on, imported data after each answer's
tokens: ``train/foreign_features.py``).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from specdec_kit.train.distill import INDEX


@dataclass
class BatchMasks:
    valid: torch.Tensor  # [B, T] real positions (not padding)
    counted: torch.Tensor  # [B, T] positions whose next token is an answer token
    top: torch.Tensor  # [B, T] the target's most likely next token (target ids; -1 where not recorded)

    def take(self, rows) -> "BatchMasks":
        """These rows' masks (a rank's share, a micro-batch)."""
        return BatchMasks(self.valid[rows], self.counted[rows], self.top[rows])


@dataclass(frozen=True)
class ShardSelection:
    """Which of the distilled data's shards a head reads, in file order: with ``answer_tokens``, the first ones
    holding that many answer tokens (a part of the data, for a learning curve); with ``shards_from``, those of the
    pool's chunks from that number on (the data a continued run had not read); with ``passes``, those of these passes
    over the pool (0: the first pass, ``answers-NNNNN``; 1, 2, ...: the passes answered after it, ``answers-pK-NNNNN``:
    a head continued over a new sampled pass alone)."""

    answer_tokens: int | None = None
    shards_from: int = 0
    passes: tuple[int, ...] | None = None

    @property
    def everything(self) -> bool:
        return self.answer_tokens is None and not self.shards_from and self.passes is None

    def pick(self, shards: list[dict]) -> list[dict]:
        ordered = sorted((s for s in shards if self._wanted(s["file"])), key=lambda s: s["file"])
        if self.answer_tokens is None:
            return ordered
        taken, total = [], 0
        for shard in ordered:
            if total >= self.answer_tokens:
                break
            taken.append(shard)
            total += sum(s["answer_tokens"] for s in shard["samples"])
        return taken

    def _wanted(self, file: str) -> bool:
        if self.shards_from and shard_chunk(file) < self.shards_from:
            return False
        return self.passes is None or shard_pass_number(file) in self.passes


class DistilledData:
    def __init__(
        self,
        path: Path,
        hidden_indices: list[int],
        lm_rows: torch.Tensor | None = None,
        tokens_per_batch: int = 4096,
        seed: int = 0,
        variants: tuple[str, ...] | None = None,
        select: Callable[[dict], bool] | None = None,
        shards: ShardSelection = ShardSelection(),
    ):
        """``select``: which samples (by their index entry: prompt_id, variant, ...) to take, e.g. a held-out split;
        ``shards``: which shards to read (every one by default)."""
        index_file = path / INDEX
        if not index_file.is_file():
            raise FileNotFoundError(
                f"{index_file}: missing; generate the data with python -m specdec_kit.train.distill"
            )
        index = json.loads(index_file.read_text())
        stored = index["spec"]["hidden_indices"]
        missing = [i for i in hidden_indices if i not in stored]
        if missing:
            raise ValueError(f"{index_file}: hidden states {missing} were not stored (stored: {stored})")
        self.index, self.lm_rows, self.device = index, lm_rows, torch.device("cpu")
        self.prefetch: bool | None = None  # gather the next step's batch in the background (None: on a GPU)
        self._threads: ThreadPoolExecutor | None = None
        self._pending = None  # (step, future of its host batch)
        self.columns = [stored.index(i) for i in hidden_indices]
        self.final = len(stored) - 1  # the final, normed state is stored last
        tokens, tops, starts, lengths, self.spans, self.shards = [], [], [], [], [], []
        for shard in shards.pick(index["shards"]):
            keep = [
                n
                for n, s in enumerate(shard["samples"])
                if (variants is None or s["variant"] in variants) and (select is None or select(s))
            ]
            if not keep:
                continue
            f = safe_open(str(path / shard["file"]), "pt")
            offsets = f.get_tensor("offsets")
            shard_tokens, shard_top = f.get_tensor("tokens").long(), f.get_tensor("top").long()
            shard_starts = f.get_tensor("answer_start")
            self.shards.append(f.get_slice("features"))
            for n in keep:
                a, b = int(offsets[n]), int(offsets[n + 1])
                tokens.append(shard_tokens[a:b].clone())
                tops.append(shard_top[a:b].clone())
                starts.append(int(shard_starts[n]))
                lengths.append(b - a)
                self.spans.append((len(self.shards) - 1, a, b))
        if not tokens:
            raise ValueError(
                f"{path}: no samples"
                + (f" of variants {variants}" if variants else "")
                + (" in the selection (e.g. a held-out split too small for this data)" if select else "")
            )
        self.tokens, self.tops, self.starts = tokens, tops, starts
        self.width = self.shards[0].get_shape()[-1]  # one stored column's width
        self.inputs_are_final = self.columns == [self.final]  # EAGLE/HASS/GRIFFIN: the inputs are the final state
        self.batches = self._plan(lengths, tokens_per_batch, seed)

    def to(self, device: torch.device | str) -> "DistilledData":
        """Hand batches over on ``device`` (the LM-head rows go with them: set them first)."""
        self.device = torch.device(device)
        if self.lm_rows is not None:
            self.lm_rows = self.lm_rows.to(self.device)
        return self

    @staticmethod
    def _plan(lengths: list[int], budget: int, seed: int) -> list[list[int]]:
        """Samples sorted by length, cut into batches of at most ``budget`` padded tokens, in a seeded order."""
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        batches, current = [], []
        for i in order:
            if current and (len(current) + 1) * lengths[i] > budget:
                batches.append(current)
                current = []
            current.append(i)
        batches.append(current)
        perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed)).tolist()
        return [batches[p] for p in perm]

    def __len__(self) -> int:
        return len(self.batches)

    def batch_for(self, step: int, schedule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BatchMasks]:
        return self.batch(step)  # the batches are planned by token budget, not the schedule's batch size

    def answer_tokens(self) -> torch.Tensor:
        """Every answer token (those after a position whose next token counts), for choosing a draft vocabulary by
        frequency."""
        return torch.cat([t[1:][top[:-1] >= 0] for t, top in zip(self.tokens, self.tops)])

    def stored_features(self, sample: int) -> torch.Tensor:
        """Sample ``sample``'s stored feature columns, read from its shard: [tokens, columns, D]."""
        shard, a, b = self.spans[sample]
        return self.shards[shard][a:b]

    @torch.no_grad()
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BatchMasks]:
        """Batch ``step`` (wrapping around): tokens [B, T], features [B, T, D], the target's logits over the head's
        vocabulary [B, T, V'], and the masks. With ``prefetch`` (on by default when batches go to a GPU), the next
        step's host part is gathered in a background thread meanwhile: a trainer asks for consecutive steps, and the
        gathering (28-76 ms a batch of 8192 tokens on a 2-core CPU) is a share of a GPU step worth hiding."""
        pending, self._pending = self._pending, None
        host = pending[1].result() if pending is not None and pending[0] == step else self.host_batch(step)
        if self.prefetch if self.prefetch is not None else self.device.type == "cuda":
            if self._threads is None:
                self._threads = ThreadPoolExecutor(1, thread_name_prefix="distilled-prefetch")
            self._pending = (step + 1, self._threads.submit(self.host_batch, step + 1))
        return self.on_device(host)

    def host_batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """Batch ``step`` gathered on the host: (tokens, features, final states, top, valid, counted). The features
        stay in the shards' own precision (float16), to be widened on the device: half the bytes to copy and move,
        and no conversion pass on the host."""
        rows = self.batches[step % len(self.batches)]
        width = max(self.tokens[i].shape[0] for i in rows)
        bsz = len(rows)
        stored = [self.stored_features(i) for i in rows]  # each [n, stored columns, D]
        tokens = torch.zeros(bsz, width, dtype=torch.long)
        finals = torch.zeros(bsz, width, self.width, dtype=stored[0].dtype)
        feats = finals if self.inputs_are_final else finals.new_zeros(bsz, width, len(self.columns) * self.width)
        top = torch.full((bsz, width), -1, dtype=torch.long)
        valid = torch.zeros(bsz, width, dtype=torch.bool)
        counted = torch.zeros(bsz, width, dtype=torch.bool)
        for r, (i, columns) in enumerate(zip(rows, stored)):
            n = self.tokens[i].shape[0]
            tokens[r, :n], finals[r, :n] = self.tokens[i], columns[:, self.final]
            if not self.inputs_are_final:
                feats[r, :n] = columns[:, self.columns].flatten(1)
            top[r, :n], valid[r, :n] = self.tops[i], True
            counted[r, :n] = self.tops[i] >= 0  # the target's next token recorded: token t+1 is an answer token
        return tokens, feats, finals, top, valid, counted

    def on_device(self, host: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BatchMasks]:
        """A host batch moved to ``device``, its features widened to float32 and the target's logits computed there."""
        tokens, feats, finals, top, valid, counted = host
        tokens, top, valid, counted = (t.to(self.device, non_blocking=True) for t in (tokens, top, valid, counted))
        widened = finals.to(self.device).float()
        feats = widened if self.inputs_are_final else feats.to(self.device).float()
        logits = widened @ self.lm_rows.float().T  # the rows are on the device since ``to``
        return tokens, feats, logits, BatchMasks(valid, counted, top)


def shard_pass_number(file: str) -> int:
    """The pass over the pool a shard file holds (``answers-00112.safetensors``: 0, ``answers-p1-00003.jsonl``: 1)."""
    found = re.search(r"-p(\d+)-\d+\.\w+$", file)
    return int(found.group(1)) if found else 0


def shard_chunk(file: str) -> int:
    """The pool chunk a shard file holds (``answers-00112.safetensors``, ``answers-p1-00003.jsonl``: 112, 3)."""
    found = re.search(r"(\d+)\.\w+$", file)
    if found is None:
        raise ValueError(f"{file}: not a shard file name (expected answers-NNNNN.<ext>)")
    return int(found.group(1))
