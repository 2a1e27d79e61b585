"""Training a Mixture-of-Attentions draft: forward KL to the target plus Smooth-L1 on the predicted
activation, with K-step bounded cross-attention (the paper's section 3.1.2).

Per batch the frozen target runs once over whole blocks and gives, for every position p, its keys and
values at every layer (LSA's input), its activations (the regression target: the input of layer L-TLI,
or the post-norm feature for TLI = 0) and its logits. Positions 1..T-1 are cut into blocks of random
length K in [1, max_k] (a fresh draw per block): a query at position p in a block starting at s sees LSA
memory of positions < s only, as a draft K steps past its last verification does, and the token stream
causally (SA). For TLI = N the target's last N layers (frozen) finish each prediction with attention to
the target's true K/V before s and the draft's own predicted K/V from s to p, as at inference.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.drafts.loading import draft_config
from specdec_kit.runtime.drafts.moa import MoADraft
from specdec_kit.runtime.models.attention import apply_rope
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.methods import Trainer
from specdec_kit.train.parallel import Ranks
from specdec_kit.train.schedule import Schedule, optimizer_and_state, step_bar
from specdec_kit.train.sharding import distribute
from specdec_kit.train.training_run import TrainingRun
from specdec_kit.train.warm_start import start_from


@dataclass(kw_only=True)
class MoASpec(Schedule):
    method: str = "moa"
    tli: int = 0
    max_k: int = 6  # longest block: the deepest draft the CA is trained for
    kl_weight: float = 1.0
    l1_weight: float = 1.0
    lsa_heads: int = 4


@torch.no_grad()
def target_pass(target: TargetModel, tokens: torch.Tensor, tli: int):
    """K/V per position and layer [B, T, L, 2*H*D], the per-layer K/V (for TLI), activations, logits."""
    out = target.hf_model(tokens, use_cache=True, output_hidden_states=True)
    cache = out.past_key_values
    keys = [cache.layers[i].keys for i in range(target.num_layers)]  # [B, H, T, D], RoPE applied
    values = [cache.layers[i].values for i in range(target.num_layers)]
    kv = torch.stack([torch.cat([k, v], dim=-1) for k, v in zip(keys, values)])  # [L, B, H, T, 2D]
    b, t = tokens.shape
    kv = kv.permute(1, 3, 0, 2, 4).reshape(b, t, target.num_layers, -1)
    activation = out.hidden_states[-1] if tli == 0 else out.hidden_states[target.num_layers - tli]
    return kv.float(), keys, values, activation.float(), out.logits.float()


def block_starts(positions: int, max_k: int, gen: torch.Generator) -> torch.Tensor:
    """For positions 1..positions, the start of the random-length block each one is in."""
    starts, p = torch.empty(positions, dtype=torch.long), 1
    while p <= positions:
        k = int(torch.randint(1, max_k + 1, (1,), generator=gen))
        starts[p - 1 : p - 1 + k] = p
        p += k
    return starts


def tail_layers(
    target: TargetModel, hidden: torch.Tensor, positions: torch.Tensor, keys, values, starts: torch.Tensor, tli: int
) -> torch.Tensor:
    """The target's last ``tli`` layers on predicted activations ``hidden`` [B, Q, d] at target positions
    ``positions`` [Q]: true K/V of positions < start(p), the predicted K/V of positions start(p)..p."""
    inner = target.hf_model.model
    q_len = hidden.shape[1]
    t_len = keys[0].shape[2]
    mem = torch.arange(t_len)[None, :] < starts[:, None]  # [Q, T]
    own = (positions[None, :] >= starts[:, None]) & (positions[None, :] <= positions[:, None])  # [Q, Q]
    mask = torch.cat([mem, own], dim=1)[None, None]
    cos, sin = inner.rotary_emb(hidden, positions[None].expand(hidden.shape[0], -1))
    for i in range(target.num_layers - tli, target.num_layers):
        layer = inner.layers[i]
        attn = layer.self_attn
        heads, kv_heads, dim = target.num_heads, target.num_kv_heads, target.head_dim
        h = layer.input_layernorm(hidden)
        b = h.shape[0]
        q = apply_rope(attn.q_proj(h).view(b, q_len, heads, dim).transpose(1, 2), cos, sin)
        k = apply_rope(attn.k_proj(h).view(b, q_len, kv_heads, dim).transpose(1, 2), cos, sin)
        v = attn.v_proj(h).view(b, q_len, kv_heads, dim).transpose(1, 2)
        all_k = torch.cat([keys[i].float(), k], dim=2)
        all_v = torch.cat([values[i].float(), v], dim=2)
        out = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask, enable_gqa=heads != kv_heads)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return inner.norm(hidden)


def moa_loss(draft: MoADraft, target: TargetModel, tokens: torch.Tensor, spec: MoASpec, gen: torch.Generator):
    """One batch: returns (loss, kl, smooth_l1, top1 of the draft against the target's argmax)."""
    kv, keys, values, activation, logits = target_pass(target, tokens, spec.tli)
    b, t = tokens.shape
    memory = draft.lsa_memory(kv)  # [B, T, d]
    mem_pos = torch.arange(t)[None].expand(b, -1)
    cos_m, sin_m = draft.rotary_emb(memory, mem_pos)
    mem_k, mem_v = draft.ca.memory_kv(memory, cos_m, sin_m)
    positions = torch.arange(1, t)  # queries: target positions 1..T-1 (the token there, predicting the next)
    starts = block_starts(t - 1, spec.max_k, gen)
    emb = draft.embed_tokens(tokens[:, 1:])
    sa_pos = (positions - 1)[None].expand(b, -1)  # the SA stream's slot s holds target position s + 1
    cos, sin = draft.rotary_emb(emb, sa_pos)
    sa = draft.sa
    h = sa.input_layernorm(emb)
    a = sa.self_attn
    q = apply_rope(a.q_proj(h).view(b, t - 1, a.num_heads, a.head_dim).transpose(1, 2), cos, sin)
    k = apply_rope(a.k_proj(h).view(b, t - 1, a.num_kv_heads, a.head_dim).transpose(1, 2), cos, sin)
    v = a.v_proj(h).view(b, t - 1, a.num_kv_heads, a.head_dim).transpose(1, 2)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=a.num_heads != a.num_kv_heads)
    hidden = emb + a.o_proj(att.transpose(1, 2).reshape(b, t - 1, -1))
    hidden = hidden + sa.mlp(sa.post_attention_layernorm(hidden))
    ca_mask = (torch.arange(t)[None, :] < starts[:, None])[None, None]  # K-step bounded
    hidden = draft.ca(hidden, cos, sin, mem_k, mem_v, ca_mask)
    o_hat = draft.output(hidden)
    l1 = F.smooth_l1_loss(o_hat, activation[:, 1:])
    feats = o_hat if spec.tli == 0 else tail_layers(target, o_hat, positions, keys, values, starts, spec.tli)
    draft_logp = torch.log_softmax(target.lm_head(feats), dim=-1)
    target_p = torch.softmax(logits[:, 1:], dim=-1)
    kl = (target_p * (torch.log(target_p.clamp_min(1e-12)) - draft_logp)).sum(-1).mean()
    top1 = (draft_logp.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    return spec.kl_weight * kl + spec.l1_weight * l1, float(kl.detach()), float(l1.detach()), float(top1)


class MoATrainingStep(torch.nn.Module):
    """MoA's training step as one module (the unit DDP or FSDP2 wraps; the frozen target is an argument, not part of
    it). Under several ranks each takes its share of the batch's rows, the block lengths drawn alike on every rank,
    and its loss weighs by its share of the rows (so DDP's averaging gives the whole batch's mean)."""

    def __init__(self, draft: MoADraft, spec: MoASpec):
        super().__init__()
        self.draft, self.spec = draft, spec

    def forward(self, target: TargetModel, tokens: torch.Tensor, gen: torch.Generator, ranks: Ranks):
        rows = tokens.shape[0]
        if ranks.world > 1:
            tokens = tokens[ranks.share(rows)]
        loss, kl, l1, top1 = moa_loss(self.draft, target, tokens, self.spec, gen)
        return loss * (tokens.shape[0] * ranks.world / rows), kl, l1, top1


def new_moa(target: TargetModel, spec: MoASpec) -> MoADraft:
    torch.manual_seed(spec.seed)
    draft = MoADraft(
        draft_config(target),
        target.num_layers,
        2 * target.num_kv_heads * target.head_dim,
        tli=spec.tli,
        lsa_heads=spec.lsa_heads,
    )
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data.float())
    draft.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
    return draft


def train_moa(
    target: TargetModel,
    data: torch.Tensor,
    spec: MoASpec,
    out_dir: Path,
    base_model: str = "",
    progress: bool = True,
    save_dtype: torch.dtype | None = None,
) -> dict:
    """Train on [N, seq_len] token blocks (the target runs on each batch); writes the checkpoint layout and
    a resumable training state to ``out_dir``. Under ``torchrun`` the ranks share each batch's rows (DDP, or FSDP2
    with ``spec.sharding``); rank 0 logs and writes."""
    if spec.target_sharding != "replicated":
        raise ValueError(
            f"moa: target_sharding {spec.target_sharding!r}: its training step runs the target's attention and last "
            "layers with the draft (the target is an argument of the step), so every rank holds the whole target"
        )
    ranks = Ranks.from_environment(target.device)
    progress = progress and ranks.main
    out_dir.mkdir(parents=True, exist_ok=True)
    target = target.float()
    for p in target.parameters():
        p.requires_grad_(False)
    draft = new_moa(target, spec).float()
    if spec.init_from:
        start_from(draft, spec.init_from, "moa", target)
    state_path = out_dir / "training_state.pt"
    what = f"moa tli={spec.tli}"
    model, sharded = distribute(
        MoATrainingStep(draft, spec), draft, torch.nn.Module(), spec.sharding, ranks, what, progress
    )
    params, opt, start, history = optimizer_and_state(draft, spec, state_path, sharded)
    saved = sharded.plain if sharded is not None else draft
    run = TrainingRun(spec, draft, saved, opt, ranks, sharded, history, state_path)
    gen = torch.Generator().manual_seed(spec.seed + start)
    bar = step_bar(spec, start, what, progress, ranks)
    t0 = time.time()
    for step in bar:
        tokens = data[spec.batch_rows(step, len(data))]
        for group in opt.param_groups:
            group["lr"] = spec.lr_at(step)
        loss, kl, l1, top1 = model(target, tokens, gen, ranks)
        spec.check_finite(loss, "moa", step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        kl, l1, top1 = (ranks.average(x) for x in (kl, l1, top1))
        loss = spec.kl_weight * kl + spec.l1_weight * l1
        run.log({"step": step, "loss": loss, "kl": kl, "smooth_l1": l1, "top1": top1}, step)
        bar.set_postfix(kl=f"{kl:.3f}", l1=f"{l1:.3f}", top1=f"{top1:.2f}")
    if not run.finish():
        return {"steps": spec.steps, "rank": ranks.rank}
    save_draft(saved.to(save_dtype or torch.float32), out_dir, "moa", safetensors=True, base_model=base_model)
    (out_dir / "training_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return {"steps": spec.steps, "minutes": round((time.time() - t0) / 60, 2), "last": history[-1] if history else None}


def moa_spec(method: str = "moa", **settings) -> MoASpec:
    """Mixture of Attentions' settings (``moa`` and its zoo variants, e.g. ``moa_tli0``, differ in ``tli``)."""
    return MoASpec(**settings)


TRAINER = Trainer(
    make_spec=moa_spec,
    train=train_moa,
    options=("tli",),
    cached_features="the moa trainer reads every layer's K/V, which it streams",
)
