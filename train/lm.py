"""Causal-LM training for the demo target and the small independent draft LM (classic speculative
sampling and ``transformers`` assisted generation need one). Resumable; progress bar with loss."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_kit.train.schedule import Schedule


@dataclass(kw_only=True)
class LMSpec(Schedule):
    hidden_size: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int


def build_lm(spec: LMSpec, vocab_size: int, eos_id: int) -> LlamaForCausalLM:
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.layers,
        intermediate_size=spec.intermediate,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        vocab_size=vocab_size,
        # no pad_token_id: it would make EOS a zero, frozen padding embedding, and a sequence starting with
        # it would then stay exactly zero through every RMSNorm, whose gradient there (1/sqrt(eps)) overflows
        max_position_embeddings=2048,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, spec: LMSpec) -> float:
    """Warm-up, then a cosine down to a tenth of ``lr`` (the draft LM's own schedule: ``decay`` is the heads')."""
    if spec.decay:
        raise ValueError(f"decay {spec.decay}: the draft LM follows its own cosine schedule; decay is for the heads")
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_lm(
    model: LlamaForCausalLM, data: torch.Tensor, spec: LMSpec, state_path: Path | None = None, desc: str = "lm"
) -> list[float]:
    """Next-token training over ``data`` [N, seq_len] blocks; resumes from ``state_path`` if present."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start, losses = 0, []
    if state_path is not None and state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, losses = state["step"], state["losses"]
    model.train()
    bar = tqdm(range(start, spec.steps), desc=desc, initial=start, total=spec.steps)
    for step in bar:
        batch = data[spec.batch_rows(step, data.shape[0])]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = model(batch, labels=batch).loss
        spec.check_finite(loss, desc, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if state_path is not None and (step + 1) % 100 == 0:
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1, "losses": losses},
                state_path,
            )
    model.eval()
    return losses


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, data: torch.Tensor, max_blocks: int = 32) -> float:
    model.eval()
    return float(model(data[:max_blocks], labels=data[:max_blocks]).loss)
