"""DFlash training: random anchor blocks, every masked slot scored at once.

A decoding cycle of a DFlash draft (``runtime/drafts/dflash.py``) sees the target's states of every position before
the root and a block: the root token x_a at position a, then ``block_size - 1`` mask tokens at a + 1, a + 2, ...;
slot k proposes x_{a+k}. Training builds exactly that for many anchors a of a sequence at once: the sequence's
context states are projected into each draft layer's keys and values once, each anchor's block is a run of query
slots, and a mask lets block j see the context positions < a_j and its own slots (no other block, and no causal
order inside a block). Slot k of a block is scored by cross-entropy against the target's own next token there (the
argmax of its logits after x_{a+k-1}: what greedy verification accepts), weighted ``step_decay ** (k - 1)`` as the
later slots matter less (they are reached only when the earlier ones are accepted); the target's embedding and LM
head stay frozen (the draft has neither of its own). With ``draft_vocab`` the draft gets an LM head of its own over
that many of the training answers' most frequent tokens (as speculators trains DFlash), starting from the target's
rows of them and trained with the rest; a slot then counts only where the target's token is in that vocabulary (as
EAGLE-3 counts), and a draft's block is scored over those rows instead of the whole vocabulary. Anchors are drawn
where the root and at least its first target are in the sequence (in distilled data: in the answer),
``blocks_per_row`` of them per row and step.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.device import resolve_device
from specdec_kit.runtime.drafts.dflash import DFlashDraft, dflash_feature_layers, dflash_scoring_head
from specdec_kit.runtime.drafts.loading import dflash_config
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.distilled import DistilledData
from specdec_kit.train.eagle3 import (
    StepResult,
    chosen_vocabulary,
    draft_vocab_rows,
    merged_step_results,
    tapped_outputs,
)
from specdec_kit.train.heldout import ChainCounts
from specdec_kit.train.methods import Trainer
from specdec_kit.train.parallel import Ranks
from specdec_kit.train.schedule import Schedule, accumulated_step, optimizer_and_state, step_bar
from specdec_kit.train.sharded_target import prepare_target, rows_through_target
from specdec_kit.train.sharding import distribute
from specdec_kit.train.training_run import TrainingRun, heldout_measure
from specdec_kit.train.warm_start import start_from


@dataclass(kw_only=True)
class DFlashSpec(Schedule):
    block_size: int = 8  # the root slot plus the masked slots (proposals a forward: block_size - 1)
    draft_layers: int = 1  # the draft's decoder layers (the official heads have 1 to 8)
    blocks_per_row: int = 16  # anchors drawn per training row and step
    step_decay: float = 0.8  # slot k's loss weight is step_decay ** (k - 1)
    feature_layers: list[int] | None = None  # the target layers (entering) it reads; None: ``dflash_feature_layers``
    mask_token_id: int = -1  # the masked slots' token; -1: the target's last vocabulary id
    draft_vocab: int = 0  # 0: the target's LM head scores (frozen); else an own head over this many tokens

    @property
    def method(self) -> str:
        return "dflash"


def new_dflash(
    target: TargetModel, spec: DFlashSpec, vocabulary: tuple[torch.Tensor, torch.Tensor] | None = None
) -> DFlashDraft:
    """A seeded draft; with ``vocabulary`` (d2t, t2d) a reduced one whose own LM head starts as the target's rows of
    those tokens (the block's outputs are normed as the target's last states are, so those rows score them at once)."""
    torch.manual_seed(spec.seed)
    layers = tuple(spec.feature_layers or dflash_feature_layers(target.num_layers))
    mask = spec.mask_token_id if spec.mask_token_id >= 0 else target.vocab_size - 1
    size = None if vocabulary is None else len(vocabulary[0])
    config = dflash_config(target, spec.draft_layers)
    draft = DFlashDraft(config, target.hidden_size, layers, mask, spec.block_size, draft_vocab_size=size)
    draft.num_target_layers = target.num_layers
    if vocabulary is not None:
        draft.d2t.copy_(vocabulary[0])
        draft.t2d.copy_(vocabulary[1])
        draft.lm_head.weight.data.copy_(draft_vocab_rows(target, draft))
    return draft


def draw_anchors(allowed: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` distinct anchor positions per row among ``allowed`` [B, T] (random order) -> (anchors [B, count],
    real [B, count]: False where a row had fewer allowed positions)."""
    scores = torch.rand(allowed.shape, generator=generator, device="cpu").to(allowed.device)
    scores = scores.masked_fill(~allowed, -1.0)
    count = min(count, allowed.shape[1])
    top = scores.topk(count, dim=1)
    return top.indices, top.values >= 0


@dataclass
class ContextWindow:
    """The ``AttentionWindow`` of training: each layer's block slots attend over the whole sequence's context keys and
    values (``DFlashDraft.context_keys_values``, [L, B, H_kv, T, D]) and the blocks' own, under ``mask``
    [B, 1, n x block, T + n x block], so training runs the runtime's own block forward."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            queries,
            torch.cat([self.keys[layer], keys], 2),
            torch.cat([self.values[layer], values], 2),
            attn_mask=self.mask,
            enable_gqa=True,
        )


class BlockTraining:
    """The blocks of one batch through the draft (see the module docstring): ``taps`` [B, T, F] the target's tapped
    layers, ``tokens`` [B, T], ``top`` [B, T] the target's next token after each position (-1: none), ``anchors``
    [B, n] the blocks' roots (``real``: False for a row's unused anchors)."""

    def __init__(self, draft: DFlashDraft, embed: torch.nn.Module, lm_head: torch.nn.Module, spec: DFlashSpec):
        self.draft, self.embed, self.lm_head, self.spec = draft, embed, lm_head, spec
        self.score = draft.logits if draft.has_own_head else lm_head  # logits over the vocabulary the draft proposes
        # target id -> draft id (d2t lists its target ids ascending); the vocabulary is fixed while a head trains
        self.draft_ids = torch.cumsum(draft.t2d.long(), 0) - 1 if draft.has_own_head else None

    def scored_targets(self, want: torch.Tensor, counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(counted, class ids): with an own head, only the target tokens its vocabulary holds, as draft ids."""
        if self.draft_ids is None:
            return counted, want[counted]
        counted = counted & self.draft.t2d[want.clamp(min=0)]
        return counted, self.draft_ids[want[counted]]

    def hidden(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The blocks at ``anchors`` [B, n] through the draft (``DFlashDraft.block``, as decoding runs it) -> their
        slots' normed outputs [B, n, block, d]. Block j sees the context positions < a_j and its own slots."""
        draft, block = self.draft, self.spec.block_size
        bsz, seq = tokens.shape
        n = anchors.shape[1]
        offsets = torch.arange(block, device=tokens.device)
        positions = (anchors[..., None] + offsets).reshape(bsz, n * block)  # [B, n x block]
        ids = torch.full((bsz, n, block), draft.mask_token_id, dtype=torch.long, device=tokens.device)
        ids[..., 0] = torch.gather(tokens, 1, anchors)
        embeds = self.embed(ids.reshape(bsz, n * block)).to(draft.fc.weight.dtype)
        ctx_pos = torch.arange(seq, device=tokens.device).expand(bsz, seq)
        keys, values = draft.context_keys_values(taps, ctx_pos)
        block_of = torch.arange(n, device=tokens.device).repeat_interleave(block)
        sees_context = ctx_pos[:, None, :] < anchors.repeat_interleave(block, dim=1)[:, :, None]  # [B, nb, T]
        sees_block = (block_of[:, None] == block_of[None, :]).expand(bsz, -1, -1)
        mask = torch.cat([sees_context, sees_block], dim=2)[:, None]  # [B, 1, nb, T + nb]
        return draft.block(embeds, positions, ContextWindow(keys, values, mask)).view(bsz, n, block, -1)

    def forward(
        self,
        taps: torch.Tensor,
        tokens: torch.Tensor,
        top: torch.Tensor,
        anchors: torch.Tensor,
        real: torch.Tensor,
        ranks: Ranks = Ranks(),
    ) -> tuple[torch.Tensor, list[StepResult]]:
        """The weighted loss over every block's slots, and each slot's (loss, accuracy, positions)."""
        hidden = self.hidden(taps, tokens, anchors)
        seq = tokens.shape[1]
        losses, results = [], []
        for k in range(1, self.spec.block_size):
            at = anchors + k - 1  # slot k proposes x_{a+k}: the target's next token after position a + k - 1
            want = torch.gather(top, 1, at.clamp(max=seq - 1))
            counted, target = self.scored_targets(want, real & (at < seq) & (want >= 0))
            logits = self.score(hidden[:, :, k][counted]).float()
            loss = ranks.mean(F.cross_entropy(logits, target, reduction="sum"), counted.numel())
            losses.append(self.spec.step_decay ** (k - 1) * loss)
            with torch.no_grad():
                hits = int((logits.argmax(-1) == target).sum())
            results.append(StepResult(loss, hits / max(int(counted.sum()), 1), int(counted.sum())))
        return sum(losses), results


class DFlashTrainingStep(torch.nn.Module):
    """A training step's forward as one module (the unit DDP or FSDP2 wraps); the target's embedding and LM head
    are frozen buffers of it, not parameters."""

    def __init__(self, draft: DFlashDraft, embed, lm_head, spec: DFlashSpec, ranks: Ranks = Ranks()):
        super().__init__()
        self.draft, self.ranks = draft, ranks
        self.blocks = BlockTraining(draft, embed, lm_head, spec)

    def forward(self, taps, tokens, top, anchors, real):
        return self.blocks.forward(taps, tokens, top, anchors, real, self.ranks)


def tapped_top(target: TargetModel, tokens: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states entering ``layers`` side by side and the target's most likely next tokens (its slots'
    targets), from one forward."""
    taps, logits = tapped_outputs(target, tokens, layers)
    return taps, logits.argmax(-1)


def anchor_room(valid: torch.Tensor, counted: torch.Tensor | None) -> torch.Tensor:
    """Where an anchor may sit: a real position whose next token is known (and, in distilled data, an answer's)."""
    allowed = valid.clone()
    allowed[:, -1] = False  # its first target would lie past the sequence
    if counted is not None:
        allowed &= counted
    allowed[:, 0] = False  # the context before the root would be empty
    return allowed


@torch.no_grad()
def dflash_acceptance(
    draft: DFlashDraft, embed, lm_head, data: DistilledData, depth: int = 3, max_new_tokens: int | None = None
) -> ChainCounts:
    """Chain acceptance per depth on held-out data: at every answer position a, the block's greedy proposals
    x_{a+1..a+depth} against the target's own tokens (depth d needs 1..d), counted per decoding cycle as the
    benchmark counts and per position."""
    blocks = BlockTraining(draft, embed, lm_head, DFlashSpec(block_size=draft.block_size))
    scoring = dflash_scoring_head(draft, lm_head)  # the target's vocabulary, -inf outside a reduced draft's
    depth = min(depth, draft.block_size - 1)
    counts = ChainCounts(depth, max_new_tokens)
    for b in range(len(data)):
        tokens, taps, _, masks = data.batch(b)
        allowed = anchor_room(masks.valid, masks.counted) & (masks.top >= 0)
        lengths = torch.zeros_like(allowed, dtype=torch.long)
        for row in range(tokens.shape[0]):
            for anchors in allowed[row].nonzero().flatten().split(64):
                hidden = blocks.hidden(taps[row : row + 1], tokens[row : row + 1], anchors[None])[0]
                alive = torch.ones(len(anchors), dtype=torch.bool, device=anchors.device)
                for j in range(depth):
                    at = anchors + j
                    want = masks.top[row, at.clamp(max=tokens.shape[1] - 1)]
                    alive &= (at < tokens.shape[1]) & (scoring(hidden[:, j + 1]).argmax(-1) == want)
                    lengths[row, anchors] += alive.long()
        counts.add(lengths, allowed)
    return counts


def train_dflash(
    target: TargetModel,
    data: torch.Tensor | DistilledData,
    spec: DFlashSpec,
    out_dir: Path,
    base_model: str = "",
    progress: bool = True,
    save_dtype: torch.dtype | None = None,
    embedding_from_target: bool = False,
    heldout: DistilledData | None = None,
    device: str | torch.device | None = None,
) -> dict:
    """Train a DFlash head on ``data``: [N, seq_len] token blocks (the target's tapped layers and next tokens from
    one forward per batch) or self-distilled data holding the tapped layers. Writes the official layout (in
    ``save_dtype``, default the target's) and a resumable state. Under ``torchrun`` the ranks share each batch's
    rows (DDP, or FSDP2 with ``spec.sharding``); rank 0 logs, measures and writes. (A DFlash head has no embedding
    of its own: ``embedding_from_target`` changes nothing.)"""
    device = resolve_device(device)
    ranks = Ranks.from_environment(device)
    device = ranks.device(device)
    progress = progress and ranks.main
    distilled = isinstance(data, DistilledData)
    if not (distilled or isinstance(data, torch.Tensor)):
        raise ValueError(
            "dflash trains on token blocks (online: the target's tapped layers from one forward per batch) or "
            f"distilled data holding those layers, not {type(data).__name__} (a feature cache is not read yet)"
        )
    if spec.block_size < 2 or spec.blocks_per_row < 1:
        raise ValueError(f"block_size {spec.block_size} (>= 2) and blocks_per_row {spec.blocks_per_row} (>= 1)")
    prepare_target(target, spec.target_sharding, not distilled, ranks, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocabulary, coverage = None, None
    if 0 < spec.draft_vocab < target.vocab_size:
        *vocabulary, coverage = chosen_vocabulary(
            "dflash", data.answer_tokens() if distilled else data, target.vocab_size, spec.draft_vocab
        )
    draft = new_dflash(target, spec, vocabulary).float()
    if spec.init_from:  # its weights and draft vocabulary
        seen = (data.answer_tokens() if distilled else data) if vocabulary else None
        coverage = start_from(draft, spec.init_from, "dflash", target, seen)
    draft = draft.to(device)
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.detach().float().to(device), freeze=True)
    lm_head = torch.nn.Linear(target.hidden_size, target.vocab_size, bias=False).to(device)
    lm_head.weight.data.copy_(target.lm_head.weight.detach().float())
    lm_head.requires_grad_(False)
    if distilled:
        data.lm_rows = lm_head.weight.data[:1]  # the target's logits are not read: its top tokens are the targets
        data.to(device)
    state_path = out_dir / "training_state.pt"
    frozen = torch.nn.ModuleDict({"embed": embed, "lm_head": lm_head})
    model, sharded = distribute(
        DFlashTrainingStep(draft, embed, lm_head, spec, ranks), draft, frozen, spec.sharding, ranks, "dflash", progress
    )
    params, opt, start, history = optimizer_and_state(draft, spec, state_path, sharded)
    measured = sharded.plain if sharded is not None else draft
    scored = partial(dflash_acceptance, embed=embed, lm_head=lm_head, depth=spec.eval_depth)
    measure = heldout_measure(heldout, spec, ranks, lm_head.weight.data[:1], device, scored)
    run = TrainingRun(spec, draft, measured, opt, ranks, sharded, history, state_path, measure)
    bar = step_bar(spec, start, "dflash", progress, ranks)
    t0 = time.time()
    for step in bar:
        generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)  # a resumed run draws the same
        if distilled:
            tokens, taps, _, masks = data.batch(step)
            allowed = anchor_room(masks.valid, masks.counted) & (masks.top >= 0)
            top = masks.top
        else:
            rows = spec.batch_rows(step, len(data))
            tokens = data[rows]
            taps, top = rows_through_target(  # each rank runs its share of the rows; every rank gets the batch's
                lambda part: tapped_top(target, part, draft.feature_layers), tokens, ranks
            )
            tokens, taps, top = tokens.to(device), taps.to(device), top.to(device)
            allowed = anchor_room(torch.ones_like(tokens, dtype=torch.bool), None)
        anchors, real = draw_anchors(allowed, spec.blocks_per_row, generator)
        if ranks.world > 1:  # this rank's share of the batch's rows
            share = ranks.share(tokens.shape[0])
            tokens, taps, top, anchors, real = tokens[share], taps[share], top[share], anchors[share], real[share]
        losses, parts = accumulated_step(
            spec,
            model,
            opt,
            params,
            ranks,
            device,
            step,
            "dflash",
            tokens.shape[0],
            lambda rows: model(taps[rows], tokens[rows], top[rows], anchors[rows], real[rows]),
        )
        accuracy, positions = merged_step_results(parts)
        record = {
            "step": step,
            "loss": ranks.average(sum(losses) / len(losses)),
            "slot_accuracy": accuracy,
            "positions": positions,
        }
        run.log(record, step)
        bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            acc=" ".join(f"s{k + 1}:{a:.2f}" for k, a in enumerate(record["slot_accuracy"][:4])),
        )
    if not run.finish():
        return {"steps": spec.steps, "rank": ranks.rank}
    save_draft(measured.cpu().to(save_dtype or target.dtype), out_dir, "dflash", base_model=base_model)
    (out_dir / "training_spec.json").write_text(json.dumps(dict(asdict(spec), method="dflash"), indent=2))
    print(f"dflash: {spec.steps} steps, blocks of {spec.block_size}", file=sys.stderr)
    return {
        "steps": spec.steps,
        "minutes": round((time.time() - t0) / 60, 2),
        **({"draft_vocab": spec.draft_vocab, "draft_vocab_coverage": round(coverage, 4)} if vocabulary else {}),
        "last": history[-1] if history else None,
        **run.summary(),
    }


def dflash_layers(spec: DFlashSpec, num_layers: int) -> list[int]:
    """The target layers whose entering hidden states the head reads (distilled data holds them)."""
    return list(spec.feature_layers or dflash_feature_layers(num_layers))


def dflash_spec(method: str = "dflash", **settings) -> DFlashSpec:
    return DFlashSpec(**settings)


TRAINER = Trainer(
    make_spec=dflash_spec,
    train=train_dflash,
    options=("feature_layers", "mask_token_id", "block_size", "draft_layers", "draft_vocab"),
    cached_features="dflash reads the target's tapped layers online or from distilled data; a feature cache is not "
    "read yet",
    distilled_layers=dflash_layers,
)
