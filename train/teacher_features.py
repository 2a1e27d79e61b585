"""The target's features for regenerated samples (``train/regenerate.py``), from one teacher-forced forward over each
finished prompt + answer (a conversation's turns that continue one another share one): the hidden states the heads
read and the target's most likely next token, written as the same shards and ``index.json`` that
``train/distill.py`` writes, so every trainer reads them unchanged.

A sample keeps its answer whole and the last ``context_tokens`` of its prompt (the target saw the whole prompt; the
draft learns from the window before the answer, which bounds the features a long multi-turn history would cost).
Samples go through the target in batches of similar length under a token budget. Resumable: one features shard per
answers shard, listed in ``index.json`` as it is written.

``compute_dtype="bfloat16"`` runs the target's matrix products under bfloat16 autocast (``"auto"``: where the device
computes bfloat16 natively, as the trainers' ``precision``; elsewhere it is emulated, far slower than float32): on a
CPU with AVX-512 BF16 (and on a CUDA GPU) the pass takes about half the time (measured here on SmolLM2: 759 against
411 forwarded tokens a second), at a root-mean-square error of 0.02 in the final state (against EAGLE's training
noise of 0.029) and about 0.4% of the tapped layers' magnitude; for sampled answers the next-token labels, taken from
the LM head, can flip at near-ties (greedy answers are their own labels). GRIFFIN trained on either reached the
same held-out acceptance (SmolLM2, 209k answer tokens: tau 1.327 against 1.325); the default stays float32, the
precision the runtime's target computes in, and the SmolLM2 chat recipe asks for auto. The data's identity records
the precision used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specdec_kit.train.distill import INDEX, Sample, fingerprint, finish_index, run_stage, write_shard
from specdec_kit.train.regenerate import ANSWERS_INDEX, RegenSpec, read_answers, shard_pass
from specdec_kit.train.schedule import bfloat16_autocast, resolved_precision


@dataclass
class FeatureSpec:
    context_tokens: int = 128  # prompt tokens kept before each answer
    tokens_per_batch: int = 4096  # padded tokens per forward
    hidden_indices: list[int] = field(default_factory=list)  # default: EAGLE-3's taps and the final state
    compute_dtype: str = "float32"  # "bfloat16": the target's matrix products under autocast; "auto": where native

    def __post_init__(self):
        resolved_precision(self.compute_dtype, torch.device("cpu"), what="features compute_dtype")

    def identity(self) -> dict:
        """What the features' values depend on (the batching changes none; float32, the only precision before the
        choice existed, is left out so that data written then still resumes)."""
        keep = {k: v for k, v in asdict(self).items() if k != "tokens_per_batch"}
        if keep["compute_dtype"] == "float32":
            del keep["compute_dtype"]
        return keep


def shared_forwards(samples: list[dict]) -> list[tuple[list[int], list[int]]]:
    """The sequences to run and the samples each holds. A follow-up whose prompt begins with the turn before's
    prompt and answer shares that turn's forward: a causal model's states at a position depend on the tokens before
    it alone, so one pass over a conversation's last turn gives every earlier turn's states too (a history whose
    re-templated answer tokenizes differently starts a pass of its own)."""
    by_conversation: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        by_conversation.setdefault(sample["conversation"], []).append(i)
    groups: list[list[int]] = []
    for members in by_conversation.values():
        members.sort(key=lambda i: samples[i]["turn"])
        groups.append([members[0]])
        for i in members[1:]:
            before = samples[groups[-1][-1]]
            seen = before["prompt"] + before["answer"]
            if samples[i]["turn"] == before["turn"] + 1 and samples[i]["prompt"][: len(seen)] == seen:
                groups[-1].append(i)
            else:
                groups.append([i])
    return [(samples[g[-1]]["prompt"] + samples[g[-1]]["answer"][:-1], g) for g in groups]


@torch.inference_mode()
def features_for(target, samples: list[dict], spec: FeatureSpec, greedy: bool = False) -> tuple[list[Sample], int]:
    """Teacher-forced features of ``samples`` (dicts with prompt and answer ids), in their order, and the tokens run
    through the target. ``greedy``: the answers are the target's greedy choices, so its most likely next token at
    each answer position is the answer's token, and the LM head (about 15% of the pass) is not run."""
    model, device, idx = target.hf_model, target.device, spec.hidden_indices
    base, head = model.model, model.get_output_embeddings()
    forwards = shared_forwards(samples)
    order = sorted(range(len(forwards)), key=lambda f: len(forwards[f][0]))
    out: dict[int, Sample] = {}
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(forwards[order[end]][0]) <= spec.tokens_per_batch:
            end += 1
        rows = order[start:end]
        start = end
        batch = [forwards[f] for f in rows]
        width = len(batch[-1][0])
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (tokens, _) in enumerate(batch):
            ids[r, : len(tokens)] = torch.tensor(tokens)
            mask[r, : len(tokens)] = 1
        with bfloat16_autocast(spec.compute_dtype, device):
            hidden = base(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        hidden = hidden.hidden_states
        for r, (_, members) in enumerate(batch):
            for i in members:
                sample = samples[i]
                seq = sample["prompt"] + sample["answer"][:-1]
                n, first = len(seq), max(len(sample["prompt"]) - spec.context_tokens, 0)
                answer_start = len(sample["prompt"]) - first
                feats = torch.stack([hidden[k][r, first:n] for k in idx], dim=1).half().cpu()
                if greedy:
                    top = list(sample["answer"])
                else:  # from the last prompt position: the answer's tokens
                    top = head(hidden[-1][r, len(sample["prompt"]) - 1 : n].float()).argmax(-1).tolist()
                out[i] = Sample(
                    sample["conversation"],
                    f"turn{sample['turn']}" + (f"-pass{sample['pass']}" if sample.get("pass") else ""),
                    seq[first:],
                    answer_start,
                    feats,
                    [-1] * (answer_start - 1) + top,
                    sample["finish"],
                    len(sample["answer"]),
                )
    return [out[i] for i in range(len(samples))], sum(len(seq) for seq, _ in forwards)


def teacher_features(target_path: Path, answers: Path, out: Path, spec: FeatureSpec, progress: bool = True) -> dict:
    """Write (or go on writing) the features of every answers shard in ``answers`` into ``out``."""
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.train.distill import default_hidden_indices

    if not (answers / ANSWERS_INDEX).is_file():
        raise FileNotFoundError(
            f"{answers / ANSWERS_INDEX}: no regenerated answers there; write them with python -m "
            "specdec_kit.train.regenerate"
        )
    answers_index = json.loads((answers / ANSWERS_INDEX).read_text())
    passes = RegenSpec(**answers_index["spec"]).answer_passes()
    target = TargetModel.from_pretrained(target_path, dtype="float32")
    spec.hidden_indices = spec.hidden_indices or default_hidden_indices(target)
    spec.compute_dtype = resolved_precision(spec.compute_dtype, target.device)  # what the data's values depend on
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    # the passes over the pool are not part of it: the answers may gain passes, whose shards come after the others
    regen_spec = {k: v for k, v in answers_index["spec"].items() if k != "passes"}
    source = {"pool_fingerprint": answers_index["pool_fingerprint"], "regen_spec": regen_spec}
    identity = spec.identity()
    settings = {
        "spec": {**identity, "source": "regenerated"},
        "target": answers_index["target"],
        "prompts_sha256": hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest(),
        "answers": str(answers),
        "hidden_size": target.hidden_size,
        "skipped": [],
    }
    index = json.loads(index_path.read_text()) if index_path.is_file() else {**settings, "shards": []}
    for key in ("spec", "target", "prompts_sha256"):
        if index[key] != settings[key]:
            raise ValueError(
                f"{index_path}: written with another {key} ({index[key]!r}); use another --out, or "
                "remove it to start over"
            )
    have = {s["file"]: s for s in index["shards"]}
    todo = [s for s in answers_index["shards"] if s["file"].replace(".jsonl", ".safetensors") not in have]
    bar = tqdm(
        total=sum(s["answer_tokens"] for s in todo), desc="features", unit="tok", disable=not progress, file=sys.stderr
    )
    for shard in todo:
        t0 = time.time()
        greedy = passes[shard_pass(shard)][0] == 0.0
        samples, forwarded = features_for(target, read_answers(answers / shard["file"]), spec, greedy)
        entry = write_shard(samples, out / shard["file"].replace(".jsonl", ".safetensors"))
        entry["answers_sha256"] = shard["sha256"]
        entry["forward_tokens"] = forwarded
        index["shards"].append(entry)
        index["fingerprint"] = fingerprint(index)
        index_path.write_text(json.dumps(index, indent=1))
        bar.update(shard["answer_tokens"])
        bar.set_postfix(tok_s=f"{sum(len(s.tokens) for s in samples) / (time.time() - t0):.0f}")
    bar.close()
    return finish_index(index, index_path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.train.teacher_features",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="smollm2", help="checkpoint directory, or a named target (smollm2)")
    p.add_argument("--answers", type=Path, required=True, help="folder written by specdec_kit.train.regenerate")
    p.add_argument("--out", type=Path, required=True, help="data folder for the trainers (resumed when it exists)")
    p.add_argument("--context-tokens", type=int, default=FeatureSpec.context_tokens)
    p.add_argument("--tokens-per-batch", type=int, default=FeatureSpec.tokens_per_batch)
    p.add_argument(
        "--compute-dtype",
        choices=["float32", "bfloat16", "auto"],
        default=FeatureSpec.compute_dtype,
        help="the target's matrix products in float32, or under bfloat16 autocast (about twice as fast where the "
        "device computes bfloat16 natively; auto: there only)",
    )
    args = p.parse_args(argv)
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.runtime.models.pretrained import resolve_target

    set_threads()
    spec = FeatureSpec(args.context_tokens, args.tokens_per_batch, compute_dtype=args.compute_dtype)
    return run_stage(lambda: teacher_features(resolve_target(args.target), args.answers, args.out, spec))


if __name__ == "__main__":
    sys.exit(main())
