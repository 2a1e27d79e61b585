"""Target features for draft training: streamed (computed per batch by the frozen target) or cached to
disk in safetensors shards, with the disk size printed before anything is written.

Only tokens and post-norm last-layer features are stored (fp16); the target's logits are recomputed
from the features with its LM head, which costs little and saves V/d times the disk (the EAGLE data
pipeline's 740 GB for 68k samples is what this avoids).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdec_kit.runtime.models.target import TargetModel


def cache_bytes(blocks: int, seq_len: int, hidden: int) -> int:
    return blocks * seq_len * (hidden * 2 + 8)  # fp16 features + int64 tokens


@torch.no_grad()
def target_outputs(target: TargetModel, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-norm last-layer features and logits of the frozen target over whole blocks."""
    out = target.hf_model(tokens.to(target.device), output_hidden_states=True)
    return out.hidden_states[-1].float().cpu(), out.logits.float().cpu()


class StreamedFeatures:
    """Runs the target on each batch as it is needed: no disk, one target forward per step."""

    def __init__(self, target: TargetModel, data: torch.Tensor):
        self.target, self.data = target, data

    def __len__(self) -> int:
        return self.data.shape[0]

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = self.data[idx]
        feats, logits = target_outputs(self.target, tokens)
        return tokens, feats, logits

    def batch_for(self, step: int, schedule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """The schedule's blocks of ``step`` (no masks: every position of a block is real and counts)."""
        return *self.batch(schedule.batch_rows(step, len(self))), None

    def tokens_seen(self) -> torch.Tensor:
        return self.data


def write_cache(target: TargetModel, data: torch.Tensor, out: Path, shard_blocks: int = 64) -> Path:
    """Compute and store features for ``data`` [N, T] blocks; prints the size first."""
    n, seq = data.shape
    size = cache_bytes(n, seq, target.hidden_size)
    print(
        f"feature cache: {n} blocks x {seq} tokens x d={target.hidden_size} -> {size / 2**20:.1f} MiB in {out}",
        file=sys.stderr,
    )
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in tqdm(range(0, n, shard_blocks), desc="features", file=sys.stderr):
        tokens = data[start : start + shard_blocks]
        feats, _ = target_outputs(target, tokens)
        name = f"features_{start // shard_blocks:05d}.safetensors"
        save_file({"tokens": tokens.contiguous(), "features": feats.half().contiguous()}, str(out / name))
        shards.append({"file": name, "blocks": int(tokens.shape[0])})
    (out / "index.json").write_text(json.dumps({"seq_len": seq, "hidden_size": target.hidden_size, "shards": shards}))
    return out


class CachedFeatures:
    """Reads a cache written by ``write_cache``; logits come from the target's LM head."""

    def __init__(self, path: Path, target: TargetModel):
        index_file = path / "index.json"
        if not index_file.is_file():
            raise FileNotFoundError(f"{index_file}: missing; write the cache with write_cache first")
        index = json.loads(index_file.read_text())
        if index["hidden_size"] != target.hidden_size:
            raise ValueError(
                f"{index_file}: hidden_size {index['hidden_size']} does not fit the target's {target.hidden_size}"
            )
        tokens, feats = [], []
        for shard in index["shards"]:
            data = load_file(str(path / shard["file"]))
            tokens.append(data["tokens"])
            feats.append(data["features"])
        self.tokens, self.features = torch.cat(tokens), torch.cat(feats)
        self.lm_head = target.lm_head

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @torch.no_grad()
    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feats = self.features[idx].float()
        logits = self.lm_head(feats.to(self.lm_head.weight.dtype)).float()
        return self.tokens[idx], feats, logits

    batch_for = StreamedFeatures.batch_for

    def tokens_seen(self) -> torch.Tensor:
        return self.tokens
