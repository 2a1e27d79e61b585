"""Self-distilled training data for draft heads: the target's own answers to chat prompts, generated in batches, with
the target's features written while they are generated (no second pass over the data).

Each prompt is answered once per variant (greedy, and sampled at temperature 0.7: the two regimes a draft serves).
A sample is the chat-templated prompt followed by the answer; stored for every position but the answer's last token
(which is never fed back): the token, the target's hidden states at ``hidden_indices`` (Hugging Face's
``hidden_states`` numbering: index i enters layer i, the last index is the final, normed state, from which the
target's logits follow through its LM head) and, from the last prompt position on, the target's most likely next
token (``top``, over its whole vocabulary; -1 on the other prompt positions, which no loss counts). GRIFFIN, EAGLE
and HASS read the final state; EAGLE-3 reads its three tapped layers. Features are float16: 2 bytes x width per
index and token.

Resumable: prompts go in fixed chunks, one shard file per chunk and variant, written atomically and listed in
``index.json``; a rerun skips the shards that exist. ``index.json`` also records the settings, the prompt file's hash
and a fingerprint of every token written, so two runs can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.prompt_sources import Prompt, read_prompts

INDEX = "index.json"


@dataclass
class Variant:
    name: str
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass
class DistillSpec:
    max_prompt_tokens: int = 640  # longer prompts are skipped (recorded)
    max_new_tokens: int = 320
    batch: int = 16
    chunk: int = 64  # prompts per shard
    hidden_indices: list[int] = field(default_factory=list)  # default: EAGLE-3's taps and the final state
    variants: list[Variant] = field(default_factory=lambda: [Variant("greedy"), Variant("t0.7", 0.7, 0.95)])
    seed: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "DistillSpec":
        return cls(**{**d, "variants": [Variant(**v) for v in d.get("variants", [])] or cls().variants})


@dataclass
class Sample:
    prompt_id: str
    variant: str
    tokens: list[int]  # prompt + answer, less the answer's last token
    answer_start: int
    features: torch.Tensor  # [len(tokens), k, d] float16
    top: list[int]  # the target's most likely next token at each position (-1: not recorded)
    finish: str  # "stop" (end of turn) or "length"
    answer_tokens: int  # including the last one, which has no features


def default_hidden_indices(target: TargetModel) -> list[int]:
    from specdec_kit.runtime.drafts.eagle3 import default_feature_layers

    return [*default_feature_layers(target.num_layers), target.num_layers]


def chat_ids(tokenizer, prompt: Prompt) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def choose(logits: torch.Tensor, variant: Variant, gen: torch.Generator) -> torch.Tensor:
    if variant.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / variant.temperature, dim=-1)
    if variant.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > variant.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.inference_mode()
def answer_batch(
    target: TargetModel,
    prompts: list[tuple[Prompt, list[int]]],
    variant: Variant,
    spec: DistillSpec,
    eos: set[int],
    gen: torch.Generator,
) -> list[Sample]:
    """Answer ``prompts`` (with their chat token ids) as one left-padded batch; finished rows leave the batch."""
    model, device, idx = target.hf_model, target.device, spec.hidden_indices
    width = max(len(ids) for _, ids in prompts)
    pad = min(eos) if eos else 0  # left padding is masked; any id will do
    ids = torch.tensor([[pad] * (width - len(t)) + t for _, t in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for _, t in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1,
    )  # logits at the last prompt position only: the answers start there
    cache = out.past_key_values
    feats = torch.stack([out.hidden_states[i] for i in idx], dim=2).half().cpu()  # [B, P, k, d]
    rows = list(range(len(prompts)))
    answers: list[list[int]] = [[] for _ in prompts]
    answer_feats: list[list[torch.Tensor]] = [[] for _ in prompts]
    tops: list[list[int]] = [[int(x)] for x in out.logits[:, -1].argmax(-1)]
    finish = ["length"] * len(prompts)
    nxt = choose(out.logits[:, -1], variant, gen)
    last = positions[:, -1]
    for step in range(spec.max_new_tokens):
        keep = []
        for j, r in enumerate(rows):
            token = int(nxt[j])
            answers[r].append(token)
            if token in eos:
                finish[r] = "stop"
            elif step + 1 < spec.max_new_tokens:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(rows):  # finished rows leave: their cache rows go too
            sel = torch.tensor(keep, device=device)
            cache.batch_select_indices(sel)
            mask, last, nxt = mask[sel], last[sel], nxt[sel]
            rows = [rows[j] for j in keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        last = last + 1
        out = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=last[:, None],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        step_feats = torch.stack([out.hidden_states[i][:, -1] for i in idx], dim=1).half().cpu()  # [b, k, d]
        best = out.logits[:, -1].argmax(-1).tolist()
        for j, r in enumerate(rows):
            answer_feats[r].append(step_feats[j])
            tops[r].append(best[j])
        nxt = choose(out.logits[:, -1], variant, gen)
    samples = []
    for r, (prompt, prompt_ids) in enumerate(prompts):
        prompt_feats = feats[r, width - len(prompt_ids) :]
        body = answers[r][:-1]  # the last answer token is never fed, so it has no features
        features = torch.cat([prompt_feats, *([torch.stack(answer_feats[r])] if answer_feats[r] else [])])
        assert features.shape[0] == len(prompt_ids) + len(body)
        top = [-1] * (len(prompt_ids) - 1) + tops[r][: len(body) + 1]
        samples.append(
            Sample(
                prompt.id, variant.name, prompt_ids + body, len(prompt_ids), features, top, finish[r], len(answers[r])
            )
        )
    return samples


def write_shard(samples: list[Sample], path: Path) -> dict:
    tokens = torch.tensor([t for s in samples for t in s.tokens], dtype=torch.int32)
    offsets = torch.tensor([0] + [len(s.tokens) for s in samples]).cumsum(0)
    tmp = path.with_suffix(".tmp")
    save_file(
        {
            "tokens": tokens,
            "features": torch.cat([s.features for s in samples]).contiguous(),
            "offsets": offsets,
            "top": torch.tensor([t for s in samples for t in s.top], dtype=torch.int32),
            "answer_start": torch.tensor([s.answer_start for s in samples]),
        },
        str(tmp),
    )
    os.replace(tmp, path)
    return {
        "file": path.name,
        "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
        "samples": [
            {
                "prompt_id": s.prompt_id,
                "variant": s.variant,
                "tokens": len(s.tokens),
                "answer_start": s.answer_start,
                "answer_tokens": s.answer_tokens,
                "finish": s.finish,
            }
            for s in samples
        ],
    }


def fingerprint(index: dict) -> str:
    """One hash of the settings, the prompts and every token written, in shard order."""
    digest = hashlib.sha256(
        json.dumps(
            {"spec": index["spec"], "prompts": index["prompts_sha256"], "target": index["target"]}, sort_keys=True
        ).encode()
    )
    for shard in sorted(index["shards"], key=lambda s: s["file"]):
        digest.update(shard["tokens_sha256"].encode())
    return digest.hexdigest()


def distill(
    target_path: Path, prompts_file: Path, out: Path, spec: DistillSpec, limit: int | None = None, progress: bool = True
) -> dict:
    """Generate (or finish generating) the data set in ``out``; returns its index."""
    from specdec_kit.runtime.loader import load_tokenizer

    target = TargetModel.from_pretrained(target_path, dtype="float32")
    tokenizer = load_tokenizer(target_path)
    spec.hidden_indices = spec.hidden_indices or default_hidden_indices(target)
    prompts = read_prompts(prompts_file)[:limit]
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    converted = target_path / ".specdec-converted"
    settings = {
        "spec": asdict(spec),
        "prompts_file": str(prompts_file),
        "prompts_sha256": hashlib.sha256(prompts_file.read_bytes()).hexdigest(),
        "limit": limit,
        "target": converted.read_text() if converted.is_file() else str(target_path),
        "hidden_size": target.hidden_size,
    }
    index = json.loads(index_path.read_text()) if index_path.is_file() else {**settings, "shards": [], "skipped": []}
    for key in ("spec", "prompts_sha256", "target"):
        if index[key] != settings[key]:
            raise ValueError(
                f"{index_path}: written with another {key} ({index[key]!r}); use another --out, or "
                f"remove it to start over"
            )
    index["limit"] = limit  # another limit keeps the shards whose prompts are still the same (a prefix's)
    eos = set(target.eos_token_ids())
    encoded = [(p, chat_ids(tokenizer, p)) for p in prompts]
    fits = [(p, ids) for p, ids in encoded if len(ids) <= spec.max_prompt_tokens]
    index["skipped"] = sorted(p.id for p, ids in encoded if len(ids) > spec.max_prompt_tokens)
    chunks = [fits[i : i + spec.chunk] for i in range(0, len(fits), spec.chunk)]
    planned = {
        f"{v.name}-{c:04d}.safetensors": sorted(p.id for p, _ in chunks[c])
        for v in spec.variants
        for c in range(len(chunks))
    }
    index["shards"] = [
        s for s in index["shards"] if planned.get(s["file"]) == sorted(x["prompt_id"] for x in s["samples"])
    ]
    done = {s["file"] for s in index["shards"]}
    work = [(v, c) for v in spec.variants for c in range(len(chunks)) if f"{v.name}-{c:04d}.safetensors" not in done]
    total = sum(len(chunks[c]) for _, c in work)
    bar = tqdm(total=total, desc="distill", unit="answer", disable=not progress, file=sys.stderr)
    t0, written = time.time(), 0
    for variant, c in work:
        chunk = sorted(chunks[c], key=lambda pair: len(pair[1]))  # similar lengths share a batch
        gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + c * 17 + spec.variants.index(variant))
        samples = []
        for b in range(0, len(chunk), spec.batch):
            batch = answer_batch(target, chunk[b : b + spec.batch], variant, spec, eos, gen)
            samples += batch
            bar.update(len(batch))
            written += sum(s.answer_tokens for s in batch)
            bar.set_postfix(tok_s=f"{written / (time.time() - t0):.0f}")
        index["shards"].append(write_shard(samples, out / f"{variant.name}-{c:04d}.safetensors"))
        index["fingerprint"] = fingerprint(index)
        index_path.write_text(json.dumps(index, indent=1))
    bar.close()
    return finish_index(index, index_path)


def finish_index(index: dict, index_path: Path) -> dict:
    """Totals and the fingerprint over every shard written, saved beside them."""
    index["tokens"] = sum(s["tokens"] for shard in index["shards"] for s in shard["samples"])
    index["answer_tokens"] = sum(s["answer_tokens"] for shard in index["shards"] for s in shard["samples"])
    index["fingerprint"] = fingerprint(index)
    index_path.write_text(json.dumps(index, indent=1))
    return index


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def run_stage(stage: Callable[[], dict], keys: tuple[str, ...] = ("tokens", "answer_tokens", "fingerprint")) -> int:
    """A data stage run from its command line: a refusal is one line and exit code 2, else the index's summary."""
    try:
        index = stage()
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: index.get(k) for k in keys}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.train.distill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="checkpoint directory, or a named target (smollm2)")
    p.add_argument("--prompts", type=Path, required=True, help="jsonl of prompts (id, source, text)")
    p.add_argument("--out", type=Path, required=True, help="data directory (resumed when it exists)")
    p.add_argument("--spec", type=Path, help="JSON with DistillSpec fields (default: the defaults)")
    p.add_argument("--limit", type=int, help="only the first N prompts")
    args = p.parse_args(argv)
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.runtime.models.pretrained import resolve_target

    set_threads()
    spec = DistillSpec.from_dict(json.loads(args.spec.read_text())) if args.spec else DistillSpec()
    return run_stage(lambda: distill(resolve_target(args.target), args.prompts, args.out, spec, args.limit))


if __name__ == "__main__":
    sys.exit(main())
