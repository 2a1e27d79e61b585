"""Draft-head trainers: EAGLE, HASS, GRIFFIN (token-alignable training) and Medusa.

Features are streamed (each step runs the frozen target over a batch of corpus blocks and trains on
its post-norm last-layer features and logits) or read from a cache (``features.py``).
Every trainer writes its checkpoint in the official layout of its method plus a resumable
``training_state.pt``. The head trains on CUDA when present (the frozen target stays where it was loaded; its
LM-head rows and each batch go to the head's device). Multi-pass methods sum the pass losses before one backward:
the gradient is the same as the reference's backward after every pass.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.device import resolve_device, resolve_dtype
from specdec_kit.runtime.drafts.eagle import EagleDraft
from specdec_kit.runtime.drafts.griffin import GriffinDraft
from specdec_kit.runtime.drafts.loading import draft_config
from specdec_kit.runtime.drafts.medusa import MedusaHeads
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.distilled import BatchMasks, DistilledData
from specdec_kit.train.draft_forward import PassRunner, next_pass_features
from specdec_kit.train.features import StreamedFeatures
from specdec_kit.train.heldout import feature_draft_acceptance
from specdec_kit.train.losses import (
    LossWeights,
    TargetSide,
    chain_top_positions,
    medusa_loss,
    next_alignment_mask,
    pass_loss,
)
from specdec_kit.train.methods import Trainer, trainer_for
from specdec_kit.train.parallel import Ranks
from specdec_kit.train.schedule import Schedule, accumulated_step, optimizer_and_state, step_bar
from specdec_kit.train.sharded_target import prepare_target
from specdec_kit.train.sharding import distribute
from specdec_kit.train.training_run import TrainingRun, heldout_measure
from specdec_kit.train.warm_start import start_from


@dataclass(kw_only=True)
class HeadSpec(Schedule):
    method: str
    passes: int = 1  # forward passes per batch (HASS: 3, GRIFFIN: 3)
    draft_vocab: int = 0  # a reduced draft vocabulary of the training data's most frequent tokens (0: the target's)
    weights: dict = field(default_factory=dict)  # LossWeights fields
    noise: float = 0.1  # uniform feature noise amplitude on pass-1 inputs (EAGLE's augmentation)
    align_topk: int = 3  # GRIFFIN: predictable = true token in the draft's top-k
    medusa_heads: int = 4
    medusa_layers: int = 1

    @classmethod
    def defaults(cls, method: str, **overrides) -> "HeadSpec":
        base = {
            "eagle": dict(passes=1, weights=dict(regression=1.0, prediction=0.1)),
            "hass": dict(passes=3, weights=dict(regression=1.0, prediction=0.1, topk=1.0, topk_k=10)),
            "griffin": dict(passes=3, weights=dict(regression=1.0, prediction=0.1, topk=0.5, topk_k=10)),
            "medusa": dict(passes=1),
        }
        if method not in base:
            raise ValueError(f"unknown method {method!r}; this trainer trains {list(base)}")
        if method == "medusa" and overrides.get("draft_vocab"):
            raise ValueError(
                "medusa heads predict over the target's whole vocabulary; a draft vocabulary applies to "
                "eagle, hass, griffin and eagle3"
            )
        return cls(method=method, **{**base[method], **overrides})


def new_head(
    method: str, target: TargetModel, spec: HeadSpec, vocab: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.nn.Module:
    """A seeded head; ``vocab``: (d2t, t2d) of a reduced draft vocabulary."""
    torch.manual_seed(spec.seed)
    if method == "medusa":
        head = MedusaHeads(target.hidden_size, target.vocab_size, spec.medusa_heads, spec.medusa_layers)
        for h in head.medusa_head:  # start every head at the target's own LM head
            h[-1].weight.data.copy_(target.lm_head.weight.data.float())
        return head
    cls = GriffinDraft if method == "griffin" else EagleDraft
    draft = cls(draft_config(target), draft_vocab_size=None if vocab is None else len(vocab[0]))
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data.float())
    draft.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen (as in the reference)
    if vocab is not None:
        draft.d2t.copy_(vocab[0])
        draft.t2d.copy_(vocab[1])
    return draft


def head_vocab(draft, target: TargetModel) -> tuple[torch.nn.Linear, torch.Tensor | None]:
    """What scores the draft's prediction feature in training: the target's LM head, or its rows of the draft's
    reduced vocabulary; and the map from target ids to the head's (-1 outside it; None: the identity)."""
    lm_head = target.lm_head.float()
    if getattr(draft, "d2t", None) is None:
        return lm_head, None
    ids = draft.target_ids(torch.arange(draft.draft_vocab_size))
    rows = torch.nn.Linear(lm_head.in_features, len(ids), bias=False)
    rows.weight.data.copy_(lm_head.weight.data[ids])
    to_head = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_head[ids] = torch.arange(len(ids))
    return rows, to_head


def feature_step(
    draft,
    lm_head,
    spec: HeadSpec,
    tokens,
    feats,
    logits,
    gen: torch.Generator,
    masks: BatchMasks | None = None,
    to_head: torch.Tensor | None = None,
    ranks: Ranks = Ranks(),
):
    """All passes on one batch: returns the summed loss and per-pass (top1, top3, positions, loss). ``logits`` are the
    target's over the head's vocabulary; ``masks`` (distilled data) mark padding and the positions that count (the
    others count everywhere but the last position); ``to_head`` maps target ids into a reduced vocabulary, where a
    position counts only if the target's own next token is in it. Under several ``ranks`` each takes its share of
    the batch's rows (the feature noise drawn for the whole batch, as one process draws it) and its part of the loss
    (``Ranks.mean``)."""
    weights = LossWeights(**spec.weights)
    if to_head is not None and logits.shape[-1] != lm_head.out_features:  # streamed: the target's whole vocabulary
        logits = logits[..., to_head >= 0]  # its columns of the head's vocabulary, in the head's (ascending) order
    noise = ((torch.rand(feats[:, :-1].shape, generator=gen) - 0.5) * spec.noise).to(feats.device)  # host RNG
    if ranks.world > 1:
        rows = ranks.share(tokens.shape[0])
        tokens, feats, logits, noise = tokens[rows], feats[rows], logits[rows], noise[rows]
        masks = None if masks is None else masks.take(rows)
    # position i: (F_i, x_{i+1}) -> F_{i+1}, and the target's distribution of x_{i+2}
    inputs, tgt_feat, tgt_logits = feats[:, :-1], feats[:, 1:], logits[:, 1:]
    true_next = tokens[:, 2:]
    seq = inputs.shape[1]
    if masks is None:
        valid = torch.ones(tokens.shape[0], seq, dtype=torch.bool, device=tokens.device)
        token_mask = torch.cat([torch.ones_like(true_next, dtype=torch.bool), torch.zeros_like(valid[:, :1])], dim=1)
    else:  # both positions real, and position i + 1's next token an answer token the head can propose
        valid = masks.valid[:, :-1] & masks.valid[:, 1:]
        token_mask = valid & masks.counted[:, 1:]
        if to_head is not None:
            top = masks.top[:, 1:]
            token_mask = token_mask & (top >= 0) & (to_head[top.clamp(min=0)] >= 0)
    true_next = torch.cat([true_next, torch.zeros_like(true_next[:, :1])], dim=1)
    if to_head is not None:  # GRIFFIN's predictable check compares in the head's vocabulary (-1: never predictable)
        true_next = to_head[true_next]
    runner = PassRunner(draft, tokens[:, 1:], valid)
    target = TargetSide.at(token_mask, tgt_feat, tgt_logits, weights)
    pass_in = inputs + noise
    griffin = spec.method == "griffin"
    chain = torch.ones_like(valid)
    total, stats = 0.0, []
    for p in range(spec.passes):
        pred, reg = runner.run(pass_in)
        mask, top_at = token_mask, None
        if griffin:
            mask = token_mask & chain
            top_at = chain_top_positions(token_mask, chain, spec.passes - 1 - p)
        result, drafted = pass_loss(pred, reg, target, lm_head, mask, weights, top_at, spec.align_topk, ranks)
        total = total + result.loss
        stats.append((result.top1, result.top3, result.positions, float(result.loss.detach())))
        if griffin:
            chain = next_alignment_mask(chain, drafted, true_next, spec.align_topk)
        pass_in = next_pass_features(inputs, reg if griffin else pred)
    return total, stats


class FeatureTrainingStep(torch.nn.Module):
    """A training step's forward (``feature_step``) as one module, the unit DistributedDataParallel wraps: its
    gradients are those of the head (the LM head is frozen)."""

    def __init__(self, draft, lm_head, spec: HeadSpec, to_head: torch.Tensor | None):
        super().__init__()
        self.draft, self.lm_head, self.spec, self.to_head = draft, lm_head, spec, to_head

    def forward(self, tokens, feats, logits, gen, masks, ranks: Ranks):
        return feature_step(self.draft, self.lm_head, self.spec, tokens, feats, logits, gen, masks, self.to_head, ranks)


class MedusaTrainingStep(torch.nn.Module):
    """Medusa's training step as one module (the unit DDP or FSDP2 wraps); under several ranks each takes its share
    of the batch's rows."""

    def __init__(self, heads: MedusaHeads):
        super().__init__()
        self.draft = heads

    def forward(self, tokens, feats, ranks: Ranks):
        if ranks.world > 1:
            rows = ranks.share(tokens.shape[0])
            tokens, feats = tokens[rows], feats[rows]
        valid = torch.ones_like(tokens, dtype=torch.bool)
        return medusa_loss(self.draft(feats), tokens, valid, ranks if ranks.world > 1 else None)


def merged_pass_stats(parts: list[list[tuple]], ranks: Ranks) -> dict:
    """Per pass over a step's micro-batches: top-1/top-3 over all their counted positions, the positions, the mean
    of their losses (averaged over the ranks)."""
    out: dict = {"top1": [], "top3": [], "positions": [], "pass_loss": []}
    for per_pass in zip(*parts):
        n = sum(p[2] for p in per_pass)
        out["top1"].append(sum(p[0] * p[2] for p in per_pass) / max(n, 1))
        out["top3"].append(sum(p[1] * p[2] for p in per_pass) / max(n, 1))
        out["positions"].append(n)
        out["pass_loss"].append(ranks.average(sum(p[3] for p in per_pass) / len(per_pass)))
    return out


def on_device(batch: tuple, device: torch.device) -> tuple:
    """A trainer's batch (tokens, features, logits, masks or None) on ``device``."""
    tokens, feats, logits, masks = batch
    if masks is not None:
        masks = BatchMasks(*(m.to(device) for m in (masks.valid, masks.counted, masks.top)))
    return tokens.to(device), feats.to(device), logits.to(device), masks


def train_head(
    target: TargetModel,
    data,
    spec: HeadSpec,
    out_dir: Path,
    base_model: str = "",
    progress: bool = True,
    save_dtype: torch.dtype | None = None,
    embedding_from_target: bool = False,
    heldout: DistilledData | None = None,
    device: str | torch.device | None = None,
) -> dict:
    """Train one head; ``data`` is [N, seq_len] token blocks (features streamed from the target), a
    ``CachedFeatures`` or a ``DistilledData``. Writes the official layout (in ``save_dtype``, default the target's;
    without the embedding with ``embedding_from_target``) and a resumable training state to ``out_dir``. With
    ``heldout`` data and ``spec.eval_every``, the held-out acceptance is logged and the best head by it is saved.
    ``device``: where the head trains (default: CUDA when present). Under ``torchrun`` the ranks share each batch
    (``train/parallel.py``); rank 0 logs, measures and writes."""
    device = resolve_device(device)
    ranks = Ranks.from_environment(device)
    device = ranks.device(device)
    progress = progress and ranks.main
    online = isinstance(data, torch.Tensor)
    prepare_target(target, spec.target_sharding, online, ranks, progress)
    source = StreamedFeatures(target, data, ranks) if online else data
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, coverage = None, None
    if spec.draft_vocab:
        from specdec_kit.train.eagle3 import chosen_vocabulary

        seen = source.answer_tokens() if isinstance(source, DistilledData) else source.tokens_seen()
        *vocab, coverage = chosen_vocabulary(spec.method, seen, target.vocab_size, spec.draft_vocab)
    head = new_head(spec.method, target, spec, vocab).float()
    if spec.init_from:  # its weights and draft vocabulary
        coverage = start_from(head, spec.init_from, spec.method, target, seen if vocab else None)
    lm_head, to_head = head_vocab(head, target) if spec.method != "medusa" else (target.lm_head.float(), None)
    head.to(device)
    state_path = out_dir / "training_state.pt"
    lm_head = lm_head.to(device)
    to_head = None if to_head is None else to_head.to(device)
    for p in lm_head.parameters():
        p.requires_grad_(False)
    # what runs the step (under DDP its gradients are averaged over the ranks; under FSDP2 it is sharded across them)
    medusa = spec.method == "medusa"
    model = MedusaTrainingStep(head) if medusa else FeatureTrainingStep(head, lm_head, spec, to_head)
    frozen = torch.nn.Module() if medusa else lm_head  # Medusa's heads start from the LM head and train it
    model, sharded = distribute(model, head, frozen, spec.sharding, ranks, spec.method, progress)
    params, opt, start, history = optimizer_and_state(head, spec, state_path, sharded)
    measured = sharded.plain if sharded is not None else head  # the whole head: what is measured and saved (rank 0)
    if isinstance(source, DistilledData):
        source.lm_rows = lm_head.weight.data
        source.to(device)
    measure = heldout_measure(
        None if medusa else heldout,
        spec,
        ranks,
        lm_head.weight.data,
        device,
        partial(feature_draft_acceptance, method=spec.method, lm_head=lm_head, to_head=to_head, depth=spec.eval_depth),
    )
    run = TrainingRun(spec, head, measured, opt, ranks, sharded, history, state_path, measure)
    gen = torch.Generator().manual_seed(spec.seed + start)
    bar = step_bar(spec, start, spec.method, progress, ranks)
    t0 = time.time()
    for step in bar:
        tokens, feats, logits, masks = on_device(source.batch_for(step, spec), device)
        losses, parts = accumulated_step(
            spec,
            model,
            opt,
            params,
            ranks,
            device,
            step,
            spec.method,
            tokens.shape[0],
            (lambda rows: model(tokens[rows], feats[rows], ranks))
            if medusa
            else (lambda rows: model(tokens[rows], feats[rows], logits[rows], gen, masks and masks.take(rows), ranks)),
        )
        record = {"step": step, "loss": ranks.average(sum(losses) / len(losses))}
        if medusa:  # each head's accuracy, averaged over the micro-batches
            record["head_top1"] = [sum(a) / len(a) for a in zip(*parts)]
        else:
            record.update(merged_pass_stats(parts, ranks))
        run.log(record, step)
        if "top1" in record:
            bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                acc=" ".join(
                    f"p{i + 1}:{a:.2f}/{b:.2f}" for i, (a, b) in enumerate(zip(record["top1"], record["top3"]))
                ),
            )
        else:
            bar.set_postfix(loss=f"{record['loss']:.3f}", top1=" ".join(f"{a:.2f}" for a in record["head_top1"]))
    if not run.finish():
        return {"steps": spec.steps, "rank": ranks.rank}
    save_draft(
        measured.cpu().to(save_dtype or target.dtype),
        out_dir,
        spec.method,
        base_model=base_model,
        embedding_from_target=embedding_from_target,
    )
    (out_dir / "training_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return {
        "steps": spec.steps,
        "minutes": round((time.time() - t0) / 60, 2),
        "last": history[-1] if history else None,
        **({"draft_vocab": spec.draft_vocab, "draft_vocab_coverage": round(coverage, 4)} if vocab else {}),
        **run.summary(),
    }


def build_heads(out: Path, recipe: dict, tokenizer, corpus, log: dict, force: bool = False) -> None:
    """Zoo stage: one head per method in ``recipe["heads"]``, trained against ``out/target``."""
    from specdec_kit.train.data import blocks, target_continuations, token_stream

    target = TargetModel.from_pretrained(out / "target", dtype="float32", device="cpu")
    save_dtype = resolve_dtype(recipe["save_dtype"], target.device)
    for method, overrides in recipe["heads"].items():
        folder = out / method
        if (folder / "config.json").is_file() and not force:
            continue
        trainer = trainer_for(method)
        settings = dict(overrides)
        written = settings.pop("target_written", None)  # {"rows": N, "prompt": P}: the target writes the data
        spec = trainer.make_spec(method, **settings)
        need = (written["rows"] if written else spec.steps * spec.batch) * spec.seq_len
        # a different slice of the corpus than the target saw first, in a different order
        stream = token_stream(tokenizer, corpus.train[::-1], max_tokens=need + spec.seq_len)
        data = blocks(stream, spec.seq_len, spec.seed + 17)
        if written:
            data = target_continuations(target.hf_model, data[:, : written["prompt"]], spec.seq_len)
        print(
            f"{method}: {data.numel() / 1e6:.2f}M training tokens"
            + (" (the target's continuations)" if written else ""),
            file=sys.stderr,
        )
        log[method] = trainer.train(target, data, spec, folder, base_model="../target", save_dtype=save_dtype)


TRAINER = Trainer(
    make_spec=HeadSpec.defaults,
    train=train_head,
    options=("passes", "draft_vocab"),
    distilled_layers=lambda spec, num_layers: [num_layers],  # the last layer's output
)
