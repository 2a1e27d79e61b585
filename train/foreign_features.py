"""Offline hidden states written by SpecForge or speculators (vLLM's training project), imported as the kit's
distilled data (``train/distill.py``'s shards and ``index.json``), so every trainer that reads the kit's regenerated
data (``specdec-train-head --distilled DIR``, the recipes) reads theirs:

    python -m specdec_kit.train.foreign_features --format specforge ./cache/hidden_states --target ./my-llama --out DIR
    python -m specdec_kit.train.foreign_features --format speculators ./training_data --target ./my-llama --out DIR

SpecForge (``scripts/prepare_hidden_states.py``): one ``torch.save`` file per sample (``rows_A-B/data_I.ckpt``, or
``.ckpt.gz``), holding ``input_ids`` [T], ``loss_mask`` [T] (1 on the tokens the draft learns: the answers),
``hidden_state`` [1, T, d] (the target's final, normed state: SpecForge applies the LM head to it alone) and, when
written for EAGLE-3, ``aux_hidden_state`` [1, T, k x d] (the states entering the captured layers, side by side).
Files are read in SpecForge's own order (their paths sorted).

speculators (``speculators generate-offline-data``): a ``datasets`` folder whose rows hold ``input_ids`` and
``loss_mask``, and beside them ``hidden_states/hs_I.safetensors`` for row I: ``token_ids`` [T] and ``hidden_states``
[T, k + 1, d], the states entering the target layers it was generated with, the last one the final layer's output
before the final norm (speculators' trainer applies the target's norm itself; the import does the same); float8 with
per-token ``hidden_states_scales`` when written by the FP8 connector (restored as fp8 x scale, as its reader does).

Neither file says which layers it holds: ``--layers`` (default EAGLE-3's 2, L/2, L-3, what both write by default)
must be the ones they were generated with; ``--layers none`` imports the final state alone (GRIFFIN, HASS, EAGLE).

A sample keeps all its T tokens and its features (the taps, then the final normed state, float16); the target's most
likely next token (its LM head over the final state) is recorded where the next token is one the loss counts, and -1
elsewhere, which is what the trainers count: a multi-turn sample's several answers count, the turns between them do
not. A sample with no counted token is skipped (listed in the index). Resumable: one shard per chunk of samples.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.distill import INDEX, Sample, fingerprint, finish_index, run_stage, write_shard

FORMATS = ("specforge", "speculators")
CHUNK = 256  # samples per shard


@dataclass
class ForeignSample:
    """One sample as the other project stored it, in the kit's terms."""

    name: str  # where it came from: a file, a row
    tokens: torch.Tensor  # [T] token ids
    counted: torch.Tensor  # [T] bool: the loss counts this token (an answer token)
    taps: torch.Tensor  # [T, k, d] the states entering the tapped layers (k may be 0)
    final: torch.Tensor  # [T, d] the target's final state: normed (SpecForge) or before the norm (speculators)


class SpecForgeSource:
    """SpecForge's feature files under a folder, in the order its readers list them (their paths sorted)."""

    def __init__(self, src: Path, taps: int, hidden: int):
        files = [p for p in src.rglob("*") if p.is_file() and p.name.endswith((".ckpt", ".ckpt.gz"))]
        self.files = sorted(files, key=lambda p: str(p.resolve()))
        if not self.files:
            raise ValueError(f"{src}: no SpecForge feature files (*.ckpt, *.ckpt.gz) under it")
        self.names = [str(p.relative_to(src)) for p in self.files]
        self.taps, self.hidden = taps, hidden

    def __len__(self) -> int:
        return len(self.files)

    def sample(self, i: int) -> ForeignSample:
        path, taps, hidden = self.files[i], self.taps, self.hidden
        raw = load_specforge(path)
        need = ["input_ids", "loss_mask", "hidden_state"] + (["aux_hidden_state"] if taps else [])
        missing = [k for k in need if k not in raw]
        if missing:
            hint = " (written without --enable-aux-hidden-states: import with --layers none)" if taps else ""
            raise ValueError(f"{path}: missing {missing}; a SpecForge feature file holds {need}{hint}")
        tokens = raw["input_ids"].reshape(-1).long()
        length = tokens.shape[0]
        final = raw["hidden_state"].reshape(-1, raw["hidden_state"].shape[-1])
        aux = raw["aux_hidden_state"].reshape(length, -1) if taps else final.new_zeros(length, 0)
        check_shapes(path, "hidden_state", final, (length, hidden))
        check_shapes(path, "aux_hidden_state", aux, (length, taps * hidden))
        mask = raw["loss_mask"].reshape(-1)
        check_shapes(path, "loss_mask", mask, (length,))
        return ForeignSample(self.names[i], tokens, mask != 0, aux.reshape(length, taps, hidden), final)


def load_specforge(path: Path) -> dict:
    """A SpecForge feature file (gzip'd or not); tensors only."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return torch.load(io.BytesIO(f.read()), weights_only=True)
        return torch.load(path, weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which
        raise ValueError(f"{path}: not a readable SpecForge feature file ({exc})") from None


class SpeculatorsSource:
    """The rows of a speculators data folder, each with its hidden-state file, in row order."""

    def __init__(self, src: Path, taps: int, hidden: int):
        try:
            from datasets import load_from_disk
        except ImportError:
            raise ValueError(
                "reading speculators data needs the datasets package: pip install 'specdec-kit[interchange]'"
            ) from None
        try:
            self.rows = load_from_disk(str(src)).with_format(None)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"{src}: not a datasets folder written by speculators ({exc})") from None
        missing = [c for c in ("input_ids", "loss_mask") if c not in self.rows.column_names]
        if missing:
            raise ValueError(f"{src}: its rows lack {missing} (columns: {self.rows.column_names})")
        self.src, self.taps, self.hidden = src, taps, hidden
        self.names = [f"row {i}" for i in range(len(self.rows))]

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, i: int) -> ForeignSample:
        path, taps = self.src / "hidden_states" / f"hs_{i}.safetensors", self.taps
        if not path.is_file():
            raise ValueError(f"{path}: missing: row {i}'s hidden states (generate them with speculators first)")
        stored = load_file(str(path))
        if "hidden_states" not in stored or "token_ids" not in stored:
            raise ValueError(f"{path}: holds {sorted(stored)}; expected hidden_states and token_ids")
        states = stored["hidden_states"]
        if "hidden_states_scales" in stored:  # the FP8 connector's per-token scales
            states = states.float() * stored["hidden_states_scales"].float()
        row = self.rows[i]
        tokens = torch.as_tensor(row["input_ids"]).long()
        if not torch.equal(stored["token_ids"].long(), tokens):
            raise ValueError(f"{path}: its token_ids are not row {i}'s input_ids")
        check_shapes(path, "hidden_states", states, (tokens.shape[0], taps + 1, self.hidden))
        counted = torch.as_tensor(row["loss_mask"]).reshape(-1) != 0
        check_shapes(path, "loss_mask of its row", counted, (tokens.shape[0],))
        return ForeignSample(self.names[i], tokens, counted, states[:, :taps], states[:, taps])


def check_shapes(path: Path, key: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{path}: {key} has shape {list(tensor.shape)}, expected {list(expected)} for this target")


@torch.no_grad()
def kit_sample(sample: ForeignSample, target: TargetModel, normed: bool, source: str) -> Sample | None:
    """The kit's sample of ``sample``: features (taps, final normed state) and the target's next token where the next
    token counts; None where none does."""
    final = sample.final.float()
    if not normed:
        final = target.hf_model.model.norm(final.to(target.device, target.dtype)).float().cpu()
    counts_next = torch.zeros_like(sample.counted)
    counts_next[:-1] = sample.counted[1:]  # position t counts when token t + 1 is an answer token
    if not counts_next.any():
        return None
    lm_head = target.lm_head
    top = lm_head(final.to(lm_head.weight.device, lm_head.weight.dtype)).argmax(-1).cpu()
    top = torch.where(counts_next, top, torch.full_like(top, -1))
    features = torch.cat([sample.taps.float(), final[:, None]], dim=1).half()
    first = int(counts_next.nonzero()[0]) + 1
    return Sample(
        f"{source}:{sample.name}",
        "imported",
        sample.tokens.tolist(),
        first,
        features,
        top.tolist(),
        "imported",
        int(sample.counted[1:].sum()),
    )


def import_features(
    fmt: str, src: Path, target_path: Path, out: Path, layers: list[int] | None, progress: bool = True
) -> dict:
    """Import (or go on importing) the hidden states at ``src`` written by ``fmt`` into the kit's data at ``out``.
    ``layers``: the layers whose entering states they hold (None: EAGLE-3's defaults; []: the final state alone)."""
    from specdec_kit.runtime.drafts.eagle3 import default_feature_layers

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {list(FORMATS)}")
    if not src.exists():
        raise ValueError(f"{src}: no such folder")
    target = TargetModel.from_pretrained(target_path, dtype="float32")
    layers = list(default_feature_layers(target.num_layers) if layers is None else layers)
    target.tapped(tuple(layers))  # refuses ids that are not distinct, ascending layers of this target
    reader = SpecForgeSource if fmt == "specforge" else SpeculatorsSource
    source = reader(src, len(layers), target.hidden_size)
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    settings = {
        "spec": {"hidden_indices": [*layers, target.num_layers], "source": fmt, "layers": layers},
        "target": str(target_path),
        "prompts_sha256": hashlib.sha256(json.dumps([str(src.resolve()), source.names]).encode()).hexdigest(),
        "source": str(src),
        "hidden_size": target.hidden_size,
    }
    index = json.loads(index_path.read_text()) if index_path.is_file() else {**settings, "shards": [], "skipped": []}
    for key in ("spec", "target", "prompts_sha256"):
        if index[key] != settings[key]:
            raise ValueError(
                f"{index_path}: written with another {key} ({index[key]!r}); use another --out, or remove it to start "
                "over"
            )
    done = {s["file"] for s in index["shards"]}
    bar = tqdm(total=len(source), desc=f"import {fmt}", unit="sample", disable=not progress, file=sys.stderr)
    for first in range(0, len(source), CHUNK):
        shard = f"imported-{first // CHUNK:05d}.safetensors"
        if shard not in done:  # a resumed import reads only the samples of the shards it has not written
            chunk = []
            for i in range(first, min(first + CHUNK, len(source))):
                converted = kit_sample(source.sample(i), target, normed=fmt == "specforge", source=fmt)
                if converted is not None:
                    chunk.append(converted)
                elif f"{fmt}:{source.names[i]}" not in index["skipped"]:  # a resumed shard lists it once
                    index["skipped"].append(f"{fmt}:{source.names[i]}")
                bar.update(1)
            if chunk:
                index["shards"].append(write_shard(chunk, out / shard))
            index["fingerprint"] = fingerprint(index)
            index_path.write_text(json.dumps(index, indent=1))
        else:
            bar.update(min(CHUNK, len(source) - first))
    bar.close()
    if not index["shards"]:
        raise ValueError(f"{src}: no sample has a token its loss counts (every loss_mask is 0)")
    return finish_index(index, index_path)


def parse_layers(text: str) -> list[int]:
    return [] if text == "none" else [int(i) for i in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.train.foreign_features",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", type=Path, help="SpecForge's hidden-states folder, or speculators' data folder")
    p.add_argument("--format", required=True, choices=FORMATS, help="the project that wrote it")
    p.add_argument("--target", required=True, help="the target's checkpoint directory, or a named target (smollm2)")
    p.add_argument("--out", type=Path, required=True, help="the kit's data folder (resumed when it exists)")
    p.add_argument(
        "--layers",
        type=parse_layers,
        help="ids of the layers whose entering states the files hold, e.g. 2,16,29 (default EAGLE-3's 2, L/2, L-3); "
        "none: the final state alone",
    )
    args = p.parse_args(argv)
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.runtime.models.pretrained import resolve_target

    set_threads()
    return run_stage(
        lambda: import_features(args.format, args.source, resolve_target(args.target), args.out, args.layers)
    )


if __name__ == "__main__":
    sys.exit(main())
