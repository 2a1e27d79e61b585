"""EAGLE-3 training, the reference recipe: features from three target layers fused by ``fc``, a draft vocabulary of
the training data's most frequent tokens, and training-time test.

Training-time test unrolls the draft ``ttt_length`` steps over whole blocks. Step 0 is ordinary teacher forcing:
position t fuses the target's tapped hidden states of x_t with the embedding of x_{t+1} and is scored against the
target's distribution of x_{t+2}. Step j feeds position t its own output of step j-1 with the token x_{t+j+1} at
rotary position t + j, attending to step 0's keys at positions <= t (the context the target verified) and to its
own keys of steps 1..j at position t (its chain of guesses): exactly what the j-th draft step sees when decoding.
The loss of step j is the soft cross-entropy against the target's distribution restricted to the draft vocabulary,
counted where the target's top token is in that vocabulary, weighted ``step_decay ** j``; gradients flow through
the unrolled steps, as in the reference.

P-EAGLE (``PEagleSpec``, a ``PEagleDraft``) is the same unrolling with one change: step j >= 1 feeds position t a
masked slot (the mask token's embedding and ``fc(mask_hidden)``) instead of its own guess, at the same rotary
position t + j and with the same attention (step 0's keys <= t, its slots of steps 1..j at t). That is what one
parallel draft forward sees: the context, then masked slots after the last pair, slot j proposing x_{t+j+2}.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.device import resolve_device
from specdec_kit.runtime.drafts.eagle3 import Eagle3Draft, default_feature_layers
from specdec_kit.runtime.drafts.layers import DraftVocab
from specdec_kit.runtime.drafts.loading import draft_config
from specdec_kit.runtime.drafts.peagle import PEagleDraft
from specdec_kit.runtime.models.attention import apply_rope
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.distilled import BatchMasks, DistilledData
from specdec_kit.train.features import CachedFeatures
from specdec_kit.train.heldout import ChainCounts
from specdec_kit.train.methods import Trainer
from specdec_kit.train.parallel import Ranks
from specdec_kit.train.schedule import Schedule, accumulated_step, optimizer_and_state, step_bar
from specdec_kit.train.sharded_target import prepare_target
from specdec_kit.train.sharding import distribute
from specdec_kit.train.training_run import TrainingRun, heldout_measure
from specdec_kit.train.warm_start import start_from, vocabulary_coverage


@dataclass(kw_only=True)
class Eagle3Spec(Schedule):
    ttt_length: int = 7  # draft steps unrolled per block (the reference's ``length``)
    step_decay: float = 0.8  # step j's loss weight is step_decay ** j
    draft_vocab: int = 0  # draft vocabulary size; 0: a quarter of the target's (the reference: 32k of 128k)
    feature_layers: list[int] | None = None  # None: the reference's (2, L // 2, L - 3)

    @property
    def method(self) -> str:
        return "eagle3"


@dataclass(kw_only=True)
class PEagleSpec(Eagle3Spec):
    """P-EAGLE: ``ttt_length`` is the proposals one forward makes (the first from the context, the rest masked)."""

    ttt_length: int = 4
    step_decay: float = 1.0  # every position counts alike (speculators' P-EAGLE weighs each depth equally)
    mask_token_id: int = -1  # the masked slots' token; -1: the target's last vocabulary id

    @property
    def method(self) -> str:
        return "peagle"


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent ids of ``tokens`` (ties and unseen ids by id), as (d2t, t2d): draft id i is
    target id ``i + d2t[i]``, ids ascending as the reference sorts them."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary of {size} tokens: expected 1..{vocab_size} (the target's vocab_size)")
    counts = torch.bincount(tokens.flatten().cpu(), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(-counts, stable=True)  # most frequent first, lower id first among equals
    used = order[:size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(size), t2d


def chosen_vocabulary(
    method: str, seen: torch.Tensor, vocab_size: int, size: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``draft_vocabulary`` of the training tokens ``seen``, and the share of them it holds (said on stderr: a low
    share caps what the head can ever accept)."""
    d2t, t2d = draft_vocabulary(seen, vocab_size, size)
    coverage = vocabulary_coverage(t2d, seen)
    print(
        f"{method}: draft vocabulary {size} of {vocab_size} tokens covers {coverage:.1%} of the training tokens",
        file=sys.stderr,
    )
    return d2t, t2d, coverage


def draft_vocab_rows(target: TargetModel, draft: DraftVocab) -> torch.Tensor:
    """The target's LM-head rows of the draft's vocabulary (float32): its logits over that vocabulary, which the
    distilled data's soft targets and a reduced DFlash head's starting weights are made of."""
    return target.lm_head.weight.data.float()[draft.target_ids(torch.arange(draft.draft_vocab_size))]


def new_eagle3(target: TargetModel, spec: Eagle3Spec, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Draft:
    """A seeded draft as wide as the target, with the target's embedding (frozen, as in the reference); a P-EAGLE
    draft for a ``PEagleSpec``, its ``mask_hidden`` starting at zero (what an unread slot adds)."""
    torch.manual_seed(spec.seed)
    layers = tuple(spec.feature_layers) if spec.feature_layers else default_feature_layers(target.num_layers)
    arguments = (draft_config(target), target.hidden_size, len(d2t), layers)
    if isinstance(spec, PEagleSpec):
        mask = spec.mask_token_id if spec.mask_token_id >= 0 else target.vocab_size - 1
        draft = PEagleDraft(*arguments, mask, spec.ttt_length)
    else:
        draft = Eagle3Draft(*arguments)
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data.float())
    draft.embed_tokens.weight.requires_grad_(False)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft


@torch.no_grad()
def tapped_outputs(
    target: TargetModel, tokens: torch.Tensor, layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states entering ``layers`` side by side [B, T, k x d] and the logits [B, T, V], one forward."""
    out = target.hf_model(tokens.to(target.device), output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in layers], dim=-1)  # hidden_states[i] enters layer i
    return taps.float().cpu(), out.logits.float().cpu()


def shift_left(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, t + by] at position t, zeros past the end."""
    if by == 0:
        return x
    return torch.cat([x[:, by:], torch.zeros_like(x[:, :by])], dim=1)


@dataclass
class StepResult:
    loss: torch.Tensor  # this step's loss (already averaged)
    accuracy: float  # draft top-1 equals the target's top token, over the counted positions
    positions: int


class TrainingTimeTest:
    """The unrolled draft over one batch of blocks (see the module docstring). ``logits`` are the target's over its
    whole vocabulary, or (distilled data, with ``masks``) over the draft vocabulary already."""

    def __init__(
        self,
        draft: Eagle3Draft,
        taps: torch.Tensor,
        tokens: torch.Tensor,
        logits: torch.Tensor,
        masks: BatchMasks | None = None,
        ranks: Ranks = Ranks(),
    ):
        self.draft, self.ranks = draft, ranks
        self.tokens, self.logits = tokens, logits
        self.countable = None
        if masks is not None:  # the position's next token is an answer token the draft vocabulary holds
            top = masks.top
            self.countable = masks.valid & masks.counted & (top >= 0) & draft.t2d[top.clamp(min=0)]
        bsz, seq = tokens.shape
        self.seq = seq
        self.hidden = draft.fc(taps)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
        self.positions = torch.arange(seq, device=tokens.device).expand(bsz, seq)

    def step(self, j: int) -> StepResult:
        draft, layer = self.draft, self.draft.midlayer
        attn = layer.self_attn
        if j and isinstance(draft, PEagleDraft):  # a masked slot, not the draft's own guess
            ids = torch.full_like(self.tokens, draft.mask_token_id)
            self.hidden = draft.fc(draft.mask_hidden.to(self.hidden.dtype)).expand_as(self.hidden)
        else:
            ids = shift_left(self.tokens, j + 1)
        embeds = draft.embed_tokens(ids).to(self.hidden.dtype)
        joined = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(self.hidden)), dim=-1)
        bsz, seq, _ = joined.shape
        cos, sin = draft.rotary_emb(joined, self.positions + j)
        q = apply_rope(attn.q_proj(joined).view(bsz, seq, attn.num_heads, attn.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(attn.k_proj(joined).view(bsz, seq, attn.num_kv_heads, attn.head_dim).transpose(1, 2), cos, sin)
        v = attn.v_proj(joined).view(bsz, seq, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        group = attn.num_heads // attn.num_kv_heads
        self.keys.append(k.repeat_interleave(group, dim=1))
        self.values.append(v.repeat_interleave(group, dim=1))
        scale = 1.0 / math.sqrt(attn.head_dim)
        context = (q @ self.keys[0].transpose(2, 3)) * scale  # step 0's keys, causally
        context = context.masked_fill(~self.causal, float("-inf"))
        chain = [(q * k_i).sum(-1, keepdim=True) * scale for k_i in self.keys[1:]]  # own keys at position t
        weights = torch.softmax(torch.cat([context, *chain], dim=-1).float(), dim=-1).to(q.dtype)
        out = weights[..., :seq] @ self.values[0]
        for i, v_i in enumerate(self.values[1:]):
            out = out + weights[..., seq + i, None] * v_i
        out = attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
        hidden = self.hidden + out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.hidden = hidden
        return self._score(hidden, j)

    def _score(self, hidden: torch.Tensor, j: int) -> StepResult:
        """Soft cross-entropy against the target's distribution of x_{t+j+2} over the draft vocabulary, averaged over
        every position (those that do not count add zero); the draft's LM head runs only where positions count."""
        t2d = self.draft.t2d
        with torch.no_grad():
            target = shift_left(self.logits, j + 1)
            if self.countable is None:
                exists = torch.arange(self.seq, device=target.device) + j + 1 < self.seq
                counted = t2d[target.argmax(-1)] & exists[None, :]
                target = target[counted][..., t2d]
            else:
                counted = shift_left(self.countable, j + 1)
                target = target[counted]
            target_p = torch.softmax(target.float(), dim=-1)
        draft_logits = self.draft.logits(hidden[counted])
        logp = torch.log_softmax(draft_logits.float(), dim=-1)
        loss = self.ranks.mean(-(target_p * logp).sum(), counted.numel())  # over every rank's positions
        with torch.no_grad():
            n = int(counted.sum())
            hits = (draft_logits.argmax(-1) == target_p.argmax(-1)).sum()
        return StepResult(loss, float(hits) / max(n, 1), n)


def merged_step_results(parts: list[list[StepResult]]) -> tuple[list[float], list[int]]:
    """Each unrolled step's (or slot's) accuracy and counted positions over a step's micro-batches."""
    positions = [sum(r.positions for r in per_step) for per_step in zip(*parts)]
    accuracy = [
        sum(r.accuracy * r.positions for r in per_step) / max(n, 1) for per_step, n in zip(zip(*parts), positions)
    ]
    return accuracy, positions


def eagle3_losses(
    draft: Eagle3Draft, spec: Eagle3Spec, taps, tokens, logits, masks: BatchMasks | None = None, ranks: Ranks = Ranks()
) -> tuple[torch.Tensor, list[StepResult]]:
    ttt = TrainingTimeTest(draft, taps, tokens, logits, masks, ranks)
    results = [ttt.step(j) for j in range(spec.ttt_length)]
    return sum(spec.step_decay**j * r.loss for j, r in enumerate(results)), results


@torch.no_grad()
def eagle3_acceptance(draft, data: DistilledData, depth: int = 3, max_new_tokens: int | None = None) -> ChainCounts:
    """Chain acceptance per depth of an EAGLE-3 head (its training-time test, step j drafting x_{t+j+2})."""
    counts = ChainCounts(depth, max_new_tokens)
    for b in range(len(data)):
        tokens, taps, logits, masks = data.batch(b)
        ttt = TrainingTimeTest(draft, taps, tokens, logits, masks)
        # position t drafts x_{t+2}, the target's choice after x_{t+1}: a chain starts where that one is known
        starts = shift_left(masks.valid & masks.counted & (masks.top >= 0), 1)
        alive, lengths = starts, torch.zeros_like(starts, dtype=torch.long)
        for j in range(depth):
            ttt.step(j)
            guess = draft.target_ids(draft.logits(ttt.hidden).argmax(-1))
            alive = alive & (guess == shift_left(masks.top, j + 1))
            lengths += alive.long()
        counts.add(lengths, starts)
    return counts


class Eagle3TrainingStep(torch.nn.Module):
    """A training step's forward (``eagle3_losses``) as one module: the unit DistributedDataParallel or FSDP2 wraps.
    Under several ``ranks`` each passes its share of the batch's rows and its part of the loss."""

    def __init__(self, draft: Eagle3Draft, spec: Eagle3Spec, ranks: Ranks = Ranks()):
        super().__init__()
        self.draft, self.spec, self.ranks = draft, spec, ranks

    def forward(self, taps, tokens, logits, masks):
        return eagle3_losses(self.draft, self.spec, taps, tokens, logits, masks, self.ranks)


def train_eagle3(
    target: TargetModel,
    data: torch.Tensor | DistilledData,
    spec: Eagle3Spec,
    out_dir: Path,
    base_model: str = "",
    progress: bool = True,
    save_dtype: torch.dtype | None = None,
    embedding_from_target: bool = False,
    heldout: DistilledData | None = None,
    device: str | torch.device | None = None,
) -> dict:
    """Train an EAGLE-3 head on ``data``: [N, seq_len] token blocks (features streamed from the target), or
    self-distilled data holding the tapped layers. Writes the official layout (``d2t``/``t2d`` included, in
    ``save_dtype``, default the target's; without the embedding with ``embedding_from_target``) and a resumable
    state. ``device``: where the draft trains (default: CUDA when present; the target stays where it was loaded).
    Under ``torchrun`` the ranks share each batch's rows (DDP, or FSDP2 with ``spec.sharding``); rank 0 logs,
    measures and writes."""
    device = resolve_device(device)
    ranks = Ranks.from_environment(device)
    device = ranks.device(device)
    progress = progress and ranks.main
    distilled, cached = isinstance(data, DistilledData), isinstance(data, CachedFeatures)
    if not (distilled or cached or isinstance(data, torch.Tensor)):
        raise ValueError(
            "eagle3 trains on token blocks (online: the target's tapped layers and logits from one forward per "
            f"batch), a feature cache holding its layers (offline) or distilled data, not {type(data).__name__}"
        )
    prepare_target(target, spec.target_sharding, not (distilled or cached), ranks, progress)
    layers = cache_taps(spec, target.num_layers)
    if cached and data.taps != layers:
        raise ValueError(f"the feature cache holds the inputs of layers {data.taps}; this head reads {layers}")
    out_dir.mkdir(parents=True, exist_ok=True)
    size = spec.draft_vocab or max(1, target.vocab_size // 4)
    seen = data.answer_tokens() if distilled else data.tokens_seen() if cached else data
    d2t, t2d, coverage = chosen_vocabulary(spec.method, seen, target.vocab_size, size)
    draft = new_eagle3(target, spec, d2t, t2d).float()
    if spec.init_from:  # its weights and draft vocabulary
        coverage = start_from(draft, spec.init_from, spec.method, target, seen)
    rows = draft_vocab_rows(target, draft)
    draft.to(device)
    if distilled:  # the target's logits over the draft vocabulary: its LM-head rows of those ids
        data.lm_rows = rows
        data.to(device)
    state_path = out_dir / "training_state.pt"
    model, sharded = distribute(  # its own LM head trains: nothing frozen
        Eagle3TrainingStep(draft, spec, ranks), draft, torch.nn.Module(), spec.sharding, ranks, spec.method, progress
    )
    params, opt, start, history = optimizer_and_state(draft, spec, state_path, sharded)
    measured = sharded.plain if sharded is not None else draft  # the whole draft: what is measured and saved
    # held-out acceptance, the best head by it kept
    measure = heldout_measure(heldout, spec, ranks, rows, device, partial(eagle3_acceptance, depth=spec.eval_depth))
    run = TrainingRun(spec, draft, measured, opt, ranks, sharded, history, state_path, measure)
    bar = step_bar(spec, start, spec.method, progress, ranks)
    t0 = time.time()
    for step in bar:
        if distilled:
            tokens, taps, logits, masks = data.batch(step)
            if ranks.world > 1:  # this rank's share of the batch's rows
                share = ranks.share(tokens.shape[0])
                tokens, taps, logits = tokens[share], taps[share], logits[share]
                masks = masks.take(share)
        else:
            rows = spec.batch_rows(step, len(data))
            if ranks.world > 1:  # this rank's share: only its rows go through the (replicated or sharded) target
                rows = rows[ranks.share(len(rows))]
            if cached:
                tokens, taps, logits = data.batch(rows)
            else:
                tokens = data[rows]
                taps, logits = tapped_outputs(target, tokens, draft.feature_layers)
            tokens, taps, logits, masks = tokens.to(device), taps.to(device), logits.to(device), None
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
            lambda rows: model(taps[rows], tokens[rows], logits[rows], masks and masks.take(rows)),
        )
        accuracy, positions = merged_step_results(parts)
        record = {
            "step": step,
            "loss": ranks.average(sum(losses) / len(losses)),
            "step_accuracy": accuracy,
            "positions": positions,
        }
        run.log(record, step)
        bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            acc=" ".join(f"s{j}:{a:.2f}" for j, a in enumerate(record["step_accuracy"][:4])),
        )
    if not run.finish():
        return {"steps": spec.steps, "rank": ranks.rank}
    save_draft(
        measured.cpu().to(save_dtype or target.dtype),
        out_dir,
        spec.method,
        base_model=base_model,
        embedding_from_target=embedding_from_target,
    )
    (out_dir / "training_spec.json").write_text(json.dumps(dict(asdict(spec), method=spec.method), indent=2))
    return {
        "steps": spec.steps,
        "minutes": round((time.time() - t0) / 60, 2),
        "draft_vocab": size,
        "draft_vocab_coverage": round(coverage, 4),
        "last": history[-1] if history else None,
        **run.summary(),
    }


def cache_taps(spec: Eagle3Spec, num_layers: int) -> list[int]:
    """The target layers whose entering hidden states the head reads (a feature cache or distilled data holds them)."""
    return list(spec.feature_layers or default_feature_layers(num_layers))


def eagle3_spec(method: str = "eagle3", **settings) -> Eagle3Spec:
    """EAGLE-3's settings, or P-EAGLE's (``method`` peagle)."""
    return PEagleSpec(**settings) if method == "peagle" else Eagle3Spec(**settings)


TRAINER = Trainer(
    make_spec=eagle3_spec,
    train=train_eagle3,
    options=("draft_vocab", "ttt_length", "feature_layers", "mask_token_id"),
    cache_taps=cache_taps,
    distilled_layers=cache_taps,
)
