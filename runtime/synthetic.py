"""Tiny synthetic targets and drafts built in memory (tests, smoke runs, the pre-zoo demo).

``tiny_target`` is a random Llama-family model (``logit_scale`` sharpens its output distribution). With ``context_mix`` < 1 the attention and MLP
outputs are scaled down, so the model is close to a bigram model whose next token is a fixed function
of the current one; ``oracle_*`` then build drafts in the official layouts that predict that function
exactly (EAGLE, GRIFFIN) or through a least-squares fit (Medusa), so acceptance is high but not
perfect. Nothing here is trained: it is for exercising the runtime, not for measuring methods. (EAGLE-3 has no
such oracle: its token reaches the prediction only through attention; tests train a small one instead.)
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec_kit.runtime.drafts.dflash import DFlashDraft, dflash_feature_layers
from specdec_kit.runtime.drafts.eagle import EagleDraft
from specdec_kit.runtime.drafts.eagle3 import Eagle3Draft, default_feature_layers
from specdec_kit.runtime.drafts.griffin import GriffinDraft
from specdec_kit.runtime.drafts.layers import DraftVocab, FeatureDraft
from specdec_kit.runtime.drafts.loading import dflash_config, draft_config
from specdec_kit.runtime.drafts.medusa import MedusaHeads
from specdec_kit.runtime.drafts.moa import MoADraft
from specdec_kit.runtime.drafts.peagle import PEagleDraft
from specdec_kit.runtime.models.target import TargetModel

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def tiny_hf_model(
    family: str = "llama",
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    context_mix: float = 1.0,
    logit_scale: float = 1.0,
    seed: int = 0,
    max_positions: int = 1024,
    dtype: torch.dtype = torch.float32,
):
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if family == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # random init gives near-uniform outputs; sharpen them
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(context_mix)
            layer.mlp.down_proj.weight.mul_(context_mix)
            if family == "qwen2":  # exercise the q/k/v biases with non-zero values
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_target(**kwargs) -> TargetModel:
    return TargetModel(tiny_hf_model(**kwargs))


def random_eagle(target: TargetModel, seed: int = 1) -> EagleDraft:
    torch.manual_seed(seed)
    draft = EagleDraft(draft_config(target)).to(target.dtype)
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data)
    return draft.eval()


def random_griffin(target: TargetModel, seed: int = 2) -> GriffinDraft:
    torch.manual_seed(seed)
    draft = GriffinDraft(draft_config(target)).to(target.dtype)
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data)
    return draft.eval()


@torch.no_grad()
def random_ids(vocab_size: int, size: int, seed: int) -> torch.Tensor:
    """``size`` distinct target ids drawn with ``seed``, ascending (as draft vocabularies list them)."""
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def propose_only(draft: DraftVocab, used: torch.Tensor) -> None:
    """Point a reduced draft's vocabulary maps (``d2t``, ``t2d``) at the ascending target ids ``used``."""
    draft.d2t.copy_(used - torch.arange(len(used)))
    draft.t2d.zero_()
    draft.t2d[used] = True


def with_draft_vocab(draft: FeatureDraft, size: int, seed: int = 7) -> FeatureDraft:
    """The same EAGLE/GRIFFIN draft proposing only ``size`` random target tokens (its reduced draft vocabulary)."""
    config = draft.config
    reduced = type(draft)(
        config,
        draft_vocab_size=size,
        **({"fc_bias": draft.fc.bias is not None} if isinstance(draft, EagleDraft) else {}),
    )
    reduced = reduced.to(draft.embed_tokens.weight.dtype)
    reduced.load_state_dict(draft.state_dict(), strict=False)  # every weight; the vocabulary maps come next
    propose_only(reduced, random_ids(config.vocab_size, size, seed))
    return reduced.eval()


def eagle3_layers(target: TargetModel) -> tuple[int, ...]:
    """The reference's three layers where the target is deep enough, else every layer (tiny test targets)."""
    return default_feature_layers(target.num_layers) if target.num_layers >= 7 else tuple(range(target.num_layers))


def random_eagle3(
    target: TargetModel, seed: int = 5, draft_vocab: int | None = None, layers: tuple[int, ...] | None = None
) -> Eagle3Draft:
    """A random EAGLE-3 draft over a random draft vocabulary (two thirds of the target's by default)."""
    torch.manual_seed(seed)
    size = draft_vocab or max(1, 2 * target.vocab_size // 3)
    draft = Eagle3Draft(draft_config(target), target.hidden_size, size, layers or eagle3_layers(target))
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data.float())
    propose_only(draft, torch.randperm(target.vocab_size)[:size].sort().values)  # drawn after the weights' seed
    return draft.to(target.dtype).eval()


def random_peagle(target: TargetModel, seed: int = 5, parallel_tokens: int = 4) -> PEagleDraft:
    """A random P-EAGLE draft: ``random_eagle3``'s weights and vocabulary, a random masked-slot input."""
    base = random_eagle3(target, seed)
    draft = PEagleDraft(
        base.config,
        target.hidden_size,
        base.draft_vocab_size,
        base.feature_layers,
        target.vocab_size - 1,
        parallel_tokens,
    )
    draft.load_state_dict(base.state_dict(), strict=False)
    torch.nn.init.normal_(draft.mask_hidden, std=1.0)
    return draft.to(target.dtype).eval()


def random_dflash(target: TargetModel, seed: int = 6, block_size: int = 5, layers: int = 1) -> DFlashDraft:
    """A random DFlash draft of ``layers`` layers over the target's tapped layers (``dflash_feature_layers``), its
    mask token the target's last vocabulary id."""
    torch.manual_seed(seed)
    draft = DFlashDraft(
        dflash_config(target, layers),
        target.hidden_size,
        dflash_feature_layers(target.num_layers),
        target.vocab_size - 1,
        block_size,
    )
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)  # the norms' ones, perturbed so that they matter
    draft.num_target_layers = target.num_layers
    return draft.to(target.dtype).eval()


@torch.no_grad()
def dflash_with_draft_vocab(draft: DFlashDraft, target: TargetModel, size: int, seed: int = 7) -> DFlashDraft:
    """The same DFlash draft over ``size`` random target tokens, with an LM head of its own: the target's LM-head
    rows of those tokens, so that within its vocabulary it scores exactly as the full draft does."""
    reduced = DFlashDraft(
        draft.config, draft.target_hidden_size, draft.feature_layers, draft.mask_token_id, draft.block_size, size
    ).to(draft.fc.weight.dtype)
    reduced.load_state_dict(draft.state_dict(), strict=False)  # every block weight; the head and maps come next
    reduced.num_target_layers = draft.num_target_layers
    used = random_ids(draft.config.vocab_size, size, seed)
    reduced.lm_head.weight.copy_(target.lm_head.weight[used])
    propose_only(reduced, used)
    return reduced.eval()


def random_medusa(target: TargetModel, heads: int = 4, layers: int = 1, seed: int = 3) -> MedusaHeads:
    torch.manual_seed(seed)
    medusa = MedusaHeads(target.hidden_size, target.vocab_size, heads, layers).to(target.dtype)
    for head in medusa.medusa_head:
        for block in head[:-1]:
            torch.nn.init.normal_(block.linear.weight, std=0.05)
    return medusa.eval()


def _identity_fc(fc: torch.nn.Linear, d: int, embeds: torch.Tensor) -> None:
    """fc([emb; feature]) = emb / rms(emb): the draft's guess of the next feature is the next token's
    embedding at the scale of the target's normalised features (so its distribution is as sharp)."""
    scale = 1.0 / float(embeds.float().pow(2).mean().sqrt())
    fc.weight.zero_()
    fc.weight[:, :d] = scale * torch.eye(d, dtype=fc.weight.dtype)
    if fc.bias is not None:
        fc.bias.zero_()


@torch.no_grad()
def oracle_eagle(target: TargetModel) -> EagleDraft:
    """Exact for a pure bigram target: rmsnorm (unit weights) only rescales, so argmax is unchanged."""
    draft = random_eagle(target)
    _identity_fc(draft.fc, target.hidden_size, draft.embed_tokens.weight)
    draft.layers[0].self_attn.o_proj.weight.zero_()
    draft.layers[0].mlp.down_proj.weight.zero_()
    return draft


@torch.no_grad()
def oracle_griffin(target: TargetModel) -> GriffinDraft:
    draft = random_griffin(target)
    _identity_fc(draft.fc.fc, target.hidden_size, draft.embed_tokens.weight)
    draft.fc.mlp.down_proj.weight.zero_()
    draft.layers[0].self_attn.o_proj.weight.zero_()
    draft.layers[0].mlp.down_proj.weight.zero_()
    return draft


@torch.no_grad()
def fitted_medusa(target: TargetModel, heads: int = 4) -> MedusaHeads:
    """Head k maps the feature of token x to (approximately) the feature of the token k+1 steps after
    x under the target's bigram map, by least squares; exact when vocab <= hidden size."""
    emb = target.embed_tokens.weight.float()
    norm = target.hf_model.model.norm
    feats = norm(emb.to(target.dtype)).float()  # [V, d]: the bigram target's feature for each token
    nxt = target.lm_head(feats.to(target.dtype)).argmax(-1)  # bigram map f
    medusa = MedusaHeads(target.hidden_size, target.vocab_size, heads, 1).to(target.dtype)
    pinv = torch.linalg.pinv(feats.T)  # [V, d]
    mapped = torch.arange(target.vocab_size)
    for k, head in enumerate(medusa.medusa_head):
        mapped = nxt[mapped]  # f^{k+1}
        m = feats[mapped].T @ pinv  # [d, d]: feature(x) -> feature(f^{k+1}(x))
        head[-1].weight.copy_((target.lm_head.weight.float() @ m).to(target.dtype))
    return medusa.eval()


def random_moa(target: TargetModel, tli: int = 0, seed: int = 4) -> MoADraft:
    torch.manual_seed(seed)
    draft = MoADraft(draft_config(target), target.num_layers, 2 * target.num_kv_heads * target.head_dim, tli=tli)
    draft = draft.to(target.dtype)
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data)
    return draft.eval()


@torch.no_grad()
def oracle_moa(target: TargetModel) -> MoADraft:
    """TLI = L with every residual branch zeroed: o_hat is the token's embedding, and the target's own L
    layers (over its cache plus the draft-time entries) finish it, so the draft is the target itself. Tests
    the TLI machinery: greedy drafts must then be accepted in full."""
    draft = random_moa(target, tli=target.num_layers)
    for block in (draft.sa, draft.ca):
        attn = block.self_attn if hasattr(block, "self_attn") else block.attn
        attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()
    return draft
