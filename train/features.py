"""Target features for draft training: streamed (computed per batch by the frozen target) or cached to
disk in safetensors shards, with the disk size printed before anything is written.

Only tokens and post-norm last-layer features are stored (fp16); the target's logits are recomputed
from the features with its LM head, which costs little and saves V/d times the disk (the EAGLE data
pipeline's 740 GB for 68k samples is what this avoids). A head that reads other layers (EAGLE-3: the hidden
states entering three of them) gets those stored beside them (``taps``): the cache then holds (k + 1) x d per token.

Streamed features are the online mode (the target runs in the training loop, nothing on disk: for targets that fit
beside the head, or whose layers are sharded across the ranks: ``train/sharded_target.py``); a cache is the offline
mode (the target runs once, before training: for data trained on for several epochs, where the disk is there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.parallel import Ranks
from specdec_kit.train.sharded_target import rows_through_target


def cache_bytes(blocks: int, seq_len: int, hidden: int, taps: int = 0) -> int:
    return blocks * seq_len * (hidden * 2 * (1 + taps) + 8)  # fp16 features (and taps) + int64 tokens


class StreamedFeatures:
    """Runs the target on each batch as it is needed: no disk, one target forward per step (under several ranks each
    runs its share of the rows and the features are gathered: ``train/sharded_target.py``)."""

    def __init__(self, target: TargetModel, data: torch.Tensor, ranks: Ranks = Ranks()):
        self.target, self.data, self.ranks = target, data, ranks

    def __len__(self) -> int:
        return self.data.shape[0]

    @torch.no_grad()
    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, the target's post-norm last-layer features, its logits: its LM head over them)."""
        tokens = self.data[idx]
        (feats,) = rows_through_target(lambda rows: layer_outputs(self.target, rows, [])[:1], tokens, self.ranks)
        lm_head = self.target.lm_head
        return tokens, feats, lm_head(feats.to(lm_head.weight.device, lm_head.weight.dtype)).float().cpu()

    def batch_for(self, step: int, schedule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """The schedule's blocks of ``step`` (no masks: every position of a block is real and counts)."""
        return *self.batch(schedule.batch_rows(step, len(self))), None

    def tokens_seen(self) -> torch.Tensor:
        return self.data


@torch.no_grad()
def layer_outputs(target: TargetModel, tokens: torch.Tensor, taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-norm last-layer features and the hidden states entering ``taps`` side by side [B, T, k x d]."""
    out = target.hf_model.model(tokens.to(target.device), output_hidden_states=True)
    tapped = torch.cat([out.hidden_states[i] for i in taps], dim=-1) if taps else out.last_hidden_state[..., :0]
    return out.last_hidden_state.float().cpu(), tapped.float().cpu()


def write_cache(
    target: TargetModel, data: torch.Tensor, out: Path, shard_blocks: int = 64, taps: list[int] | None = None
) -> Path:
    """Compute and store features for ``data`` [N, T] blocks (and the hidden states entering the ``taps`` layers);
    prints the size first."""
    n, seq = data.shape
    taps = list(taps or [])
    size = cache_bytes(n, seq, target.hidden_size, len(taps))
    layers = f" and the inputs of layers {taps}" if taps else ""
    print(
        f"feature cache: {n} blocks x {seq} tokens x d={target.hidden_size}{layers} -> {size / 2**20:.1f} MiB in {out}",
        file=sys.stderr,
    )
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in tqdm(range(0, n, shard_blocks), desc="features", file=sys.stderr):
        tokens = data[start : start + shard_blocks]
        feats, tapped = layer_outputs(target, tokens, taps)
        tensors = {"tokens": tokens.contiguous(), "features": feats.half().contiguous()}
        if taps:
            tensors["taps"] = tapped.half().contiguous()
        name = f"features_{start // shard_blocks:05d}.safetensors"
        save_file(tensors, str(out / name))
        shards.append({"file": name, "blocks": int(tokens.shape[0])})
    index = {"seq_len": seq, "hidden_size": target.hidden_size, "taps": taps, "shards": shards}
    (out / "index.json").write_text(json.dumps(index))
    return out


class CachedFeatures:
    """Reads a cache written by ``write_cache``; logits come from the target's LM head. With ``taps`` (the layers an
    EAGLE-3 head reads) a batch gives their hidden states in place of the last layer's features."""

    def __init__(self, path: Path, target: TargetModel, taps: list[int] | None = None):
        index_file = path / "index.json"
        if not index_file.is_file():
            raise FileNotFoundError(f"{index_file}: missing; write the cache with write_cache first")
        index = json.loads(index_file.read_text())
        if index["hidden_size"] != target.hidden_size:
            raise ValueError(
                f"{index_file}: hidden_size {index['hidden_size']} does not fit the target's {target.hidden_size}"
            )
        self.taps = list(taps or [])
        if self.taps and self.taps != index.get("taps", []):
            raise ValueError(
                f"{index_file}: holds the inputs of layers {index.get('taps', [])}, expected {self.taps} (write the "
                "cache again for this head)"
            )
        tokens, feats, tapped = [], [], []
        for shard in index["shards"]:
            data = load_file(str(path / shard["file"]))
            tokens.append(data["tokens"])
            feats.append(data["features"])
            if self.taps:
                tapped.append(data["taps"])
        self.tokens, self.features = torch.cat(tokens), torch.cat(feats)
        self.tapped = torch.cat(tapped) if tapped else None
        self.lm_head = target.lm_head

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @torch.no_grad()
    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, what the head reads: the tapped layers or the last layer's features, the target's logits)."""
        feats = self.features[idx].float()
        logits = self.lm_head(feats.to(self.lm_head.weight.dtype)).float()
        read = self.tapped[idx].float() if self.tapped is not None else feats
        return self.tokens[idx], read, logits

    batch_for = StreamedFeatures.batch_for

    def tokens_seen(self) -> torch.Tensor:
        return self.tokens
