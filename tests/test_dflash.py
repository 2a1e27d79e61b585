"""DFlash drafts: the official ``DFlashDraftModel`` layout loads strictly, one block computes what the official
model computes, and the kit's decoding proposes what the official decoding loop proposes, cycle by cycle.

The official model (z-lab ``dflash``, ``DFlashDraftModel``, which vLLM's ``DFlashQwen3ForCausalLM`` and SGLang's
DFLASH worker load) is not installable, so it is recreated here from its documented structure, independently of the
kit's modules: the context ``hidden_norm(fc(target layers))``, each layer's keys and values of the context taken
straight from it and those of the block from ``input_layernorm`` of the block, per-head ``q_norm``/``k_norm`` (the
keys normed after the two are joined), rotary over the context's and block's positions, attention without a mask,
the final ``norm``; the target's embedding in and LM head out. Its decoding loop (``dflash_generate``, greedy):
prefill, then per cycle a block of the last token and ``block_size - 1`` mask tokens, the argmax of each masked
slot proposed, the block verified by the target, the accepted tokens' target states appended to the context.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from specdec_kit.runtime.checkpoint import load_draft, save_draft
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.drafts.dflash import default_target_layer_ids
from specdec_kit.runtime.drafts.loading import DraftLoadError
from specdec_kit.runtime.registry import drafter_for
from specdec_kit.runtime.synthetic import random_dflash, tiny_target

BLOCK, MASK = 5, 79


def ref_config(target, layer_ids, layers=2):
    cfg = target.config
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": 96,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": BLOCK,
        "num_target_layers": target.num_layers,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": layer_ids},
    }


class RefNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def ref_rope(x, positions, theta):
    """x [B, H, S, D] rotated at ``positions`` [B, S] (the two halves of each head)."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions[:, None, :, None].float() * inv
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class RefAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.h, self.kv, self.hd, self.theta = h, kv, hd, c["rope_theta"]
        self.q_proj, self.k_proj = nn.Linear(d, h * hd, bias=False), nn.Linear(d, kv * hd, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, kv * hd, bias=False), nn.Linear(h * hd, d, bias=False)
        self.q_norm, self.k_norm = RefNorm(hd, c["rms_norm_eps"]), RefNorm(hd, c["rms_norm_eps"])

    def forward(self, x, context, positions):
        b, q_len, c_len = x.shape[0], x.shape[1], context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.h, self.hd)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(x)], 1).view(b, c_len + q_len, self.kv, self.hd)
        v = torch.cat([self.v_proj(context), self.v_proj(x)], 1).view(b, c_len + q_len, self.kv, self.hd)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        q, k = ref_rope(q, positions[:, c_len:], self.theta), ref_rope(k, positions, self.theta)
        k, v = k.repeat_interleave(self.h // self.kv, 1), v.repeat_interleave(self.h // self.kv, 1)
        weights = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(self.hd), dim=-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, q_len, -1))


class RefMLP(nn.Module):
    def __init__(self, d, i):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class RefLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = RefAttention(c), RefMLP(c["hidden_size"], c["intermediate_size"])
        self.input_layernorm = RefNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RefNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, context, positions):
        x = x + self.self_attn(self.input_layernorm(x), context, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class RefDFlash(nn.Module):
    def __init__(self, c, target_hidden):
        super().__init__()
        d, ids = c["hidden_size"], c["dflash_config"]["target_layer_ids"]
        self.layers = nn.ModuleList(RefLayer(c) for _ in range(c["num_hidden_layers"]))
        self.fc = nn.Linear(len(ids) * target_hidden, d, bias=False)
        self.hidden_norm, self.norm = RefNorm(d, c["rms_norm_eps"]), RefNorm(d, c["rms_norm_eps"])
        self.target_layer_ids = ids

    def forward(self, target_hidden, noise_embedding, positions):
        context = self.hidden_norm(self.fc(target_hidden))
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, context, positions)
        return self.norm(x)


def official_checkpoint(path, target, layer_ids, seed=0, layers=2):
    config = ref_config(target, layer_ids, layers)
    torch.manual_seed(seed)
    ref = RefDFlash(config, target.hidden_size)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # norms away from 1, so a swapped or missing norm shows
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path / "model.safetensors"))
    return ref.eval()


def load(path, target):
    return load_draft(path, "dflash", target.hidden_size, target.vocab_size, target_shape=(target.num_layers, 0))


def target_states(target, ids, layer_ids):
    """The official context feature: the hidden states after decoder layers ``layer_ids``, side by side."""
    out = target.hf_model(ids, output_hidden_states=True)
    return out, torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=5, vocab=80, hidden_size=64, seed=3, logit_scale=4.0)


@torch.no_grad()
def test_one_block_proposes_what_the_official_model_computes(tmp_path, target):
    ref = official_checkpoint(tmp_path / "dflash", target, [0, 2, 3])
    draft = load(tmp_path / "dflash", target)
    assert draft.feature_layers == (1, 3, 4) and draft.block_size == BLOCK and draft.mask_token_id == MASK
    drafter = drafter_for("dflash", draft, target, DynamicTreeConfig(BLOCK, BLOCK - 2, 1))
    b, n = 2, 7
    ids = torch.randint(0, 80, (b, n + 1), generator=torch.Generator().manual_seed(1))
    _, states = target_states(target, ids[:, :n], ref.target_layer_ids)
    drafter.reset(b, 32)
    got = drafter.proposals(states, ids[:, 1:], torch.full((b,), n))  # pairs (state t, token t + 1); root = ids[n]
    block = torch.cat([ids[:, n:], torch.full((b, BLOCK - 1), MASK)], dim=1)
    out = ref(states, target.embed_tokens(block), torch.arange(n + BLOCK).expand(b, -1))
    want = torch.log_softmax(target.lm_head(out[:, 1:]), dim=-1)
    assert (got - want).abs().max() < 1e-4
    assert drafter.cache.lengths.tolist() == [n, n]  # only the context joins the draft's cache


@torch.no_grad()
def official_greedy_drafts(ref, target, prompt, new_tokens):
    """The official loop's proposals per cycle (greedy), and its output."""
    seq = list(prompt)
    out, _ = target_states(target, torch.tensor([seq]), ref.target_layer_ids)
    seq.append(int(out.logits[0, -1].argmax()))
    drafts = []
    while len(seq) - len(prompt) < new_tokens:
        start = len(seq) - 1  # the block's root: the last token, not yet run by the target
        _, states = target_states(target, torch.tensor([seq[:start]]), ref.target_layer_ids)
        block = torch.tensor([[seq[start]] + [MASK] * (BLOCK - 1)])
        hidden = ref(states, target.embed_tokens(block), torch.arange(start + BLOCK)[None])
        proposed = target.lm_head(hidden[:, 1:]).argmax(-1)[0].tolist()
        drafts.append(proposed)
        verify = target.hf_model(torch.tensor([seq[:start] + [seq[start]] + proposed])).logits[0, start:].argmax(-1)
        accepted = 0
        while accepted < len(proposed) and proposed[accepted] == int(verify[accepted]):
            accepted += 1
        seq += proposed[:accepted] + [int(verify[accepted])]
    return drafts, seq[len(prompt) :]


@torch.no_grad()
def test_decoding_proposes_what_the_official_loop_proposes_cycle_by_cycle(tmp_path, target):
    ref = official_checkpoint(tmp_path / "dflash", target, [1, 3], seed=4, layers=1)
    draft = load(tmp_path / "dflash", target)
    drafter = drafter_for("dflash", draft, target, DynamicTreeConfig(BLOCK, BLOCK - 2, 1))  # the official chain
    seen = []
    original = drafter.draft

    def recording(*args):
        tree = original(*args)
        seen.append(tree.tokens[0, 1:].tolist())
        return tree

    drafter.draft = recording
    prompt = torch.randint(0, 79, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    result = SpeculativeGenerator(target, drafter).generate([prompt], 24)[0]
    drafts, official = official_greedy_drafts(ref, target, prompt, 24)
    assert result.tokens == official[:24]
    assert len(seen) > 3 and seen[:-1] == drafts[: len(seen) - 1]  # the last cycle may be cut to the length left


def test_default_target_layers_are_the_official_spread():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]


def edit(key, value):
    def change(config):
        if "." in key:
            outer, inner = key.split(".")
            config[outer][inner] = value
        else:
            config[key] = value

    return change


@pytest.mark.parametrize(
    "change, message",
    [
        (edit("dflash_config.target_layer_ids", [0, 4]), "target_layer_ids is [0, 4]"),
        (edit("dflash_config.target_layer_ids", [2, 1]), "distinct ascending"),
        (edit("dflash_config.mask_token_id", 80), "mask_token_id is 80"),
        (edit("block_size", 1), "block_size is 1"),
        (edit("layer_types", ["sliding_attention", "sliding_attention"]), "sliding-window or causal"),
        (edit("hidden_size", 96), "hidden_size does not fit the target: expected 64, found 96"),
        (edit("num_target_layers", 6), "num_target_layers does not fit the target: expected 5, found 6"),
        (lambda c: c.pop("block_size"), "'block_size' is missing"),
        (lambda c: c.pop("dflash_config"), "'dflash_config.mask_token_id' is missing"),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_problem(tmp_path, target, change, message):
    official_checkpoint(tmp_path / "dflash", target, [0, 2, 3])
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    change(config)
    (tmp_path / "dflash" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load(tmp_path / "dflash", target)


def test_a_missing_tensor_is_refused_naming_it(tmp_path, target):
    from safetensors.torch import load_file, save_file

    official_checkpoint(tmp_path / "dflash", target, [0, 2, 3])
    state = load_file(str(tmp_path / "dflash" / "model.safetensors"))
    del state["layers.1.self_attn.k_norm.weight"]
    save_file(state, str(tmp_path / "dflash" / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="'layers.1.self_attn.k_norm.weight' is missing"):
        load(tmp_path / "dflash", target)


@torch.no_grad()
def test_a_saved_head_is_the_official_layout_and_loads_back(tmp_path, target):
    draft = random_dflash(target, block_size=4, layers=2).float()
    save_draft(draft, tmp_path / "saved", "dflash", safetensors=True)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 79, "target_layer_ids": list(draft.target_layer_ids)}
    assert (config["block_size"], config["num_target_layers"], config["rope_theta"]) == (4, 5, 10000.0)
    ref = RefDFlash(config, target.hidden_size)
    from safetensors.torch import load_file

    ref.load_state_dict(load_file(str(tmp_path / "saved" / "model.safetensors")), strict=True)  # the official keys
    back = load(tmp_path / "saved", target)
    for (name, a), (_, b) in zip(draft.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


@torch.no_grad()
def test_a_head_over_a_reduced_vocabulary_scores_with_its_own_head(tmp_path, target):
    """A DFlash head whose ``draft_vocab_size`` is below the target's (speculators trains them so by default)
    scores the block with an LM head of its own, its draft id i being target id i + d2t[i]: with the target's rows of
    those tokens as its head, each slot's distribution is the full head's renormalised over the draft vocabulary and
    -inf outside it. It saves in the official layout (``lm_head.weight``, ``d2t``, ``t2d``, ``draft_vocab_size``)
    and loads back; a file with ``d2t`` alone gets ``t2d`` from it; maps outside the vocabulary are refused."""
    from safetensors.torch import load_file, save_file

    from specdec_kit.runtime.synthetic import dflash_with_draft_vocab

    full = random_dflash(target, block_size=4, layers=2).float()
    reduced = dflash_with_draft_vocab(full, target, 50)
    save_draft(reduced, tmp_path / "reduced", "dflash", safetensors=True)
    config = json.loads((tmp_path / "reduced" / "config.json").read_text())
    state = load_file(str(tmp_path / "reduced" / "model.safetensors"))
    assert config["draft_vocab_size"] == 50 and state["lm_head.weight"].shape == (50, 64)
    assert state["d2t"].shape == (50,) and int(state["t2d"].sum()) == 50
    back = load(tmp_path / "reduced", target)
    assert back.has_own_head and torch.equal(back.d2t, reduced.d2t) and torch.equal(back.t2d, reduced.t2d)
    tree = DynamicTreeConfig(4, 2, 1)
    b, n = 2, 7
    ids = torch.randint(0, 80, (b, n + 1), generator=torch.Generator().manual_seed(1))
    _, states = target_states(target, ids[:, :n], full.target_layer_ids)
    proposed = []
    for draft in (full, back):
        drafter = drafter_for("dflash", draft, target, tree)
        drafter.reset(b, 32)
        proposed.append(drafter.proposals(states, ids[:, 1:], torch.full((b,), n)))
    inside = back.t2d
    assert (proposed[1][..., inside] - torch.log_softmax(proposed[0][..., inside], dim=-1)).abs().max() < 1e-5
    assert torch.isneginf(proposed[1][..., ~inside]).all()
    del state["t2d"]  # vLLM reads d2t alone
    save_file(state, str(tmp_path / "reduced" / "model.safetensors"))
    assert torch.equal(load(tmp_path / "reduced", target).t2d, reduced.t2d)
    state["d2t"] = state["d2t"] + 40  # draft ids mapped past the vocabulary
    save_file(state, str(tmp_path / "reduced" / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="d2t maps draft ids outside the target vocabulary"):
        load(tmp_path / "reduced", target)


def test_a_reduced_vocabulary_head_builds_an_onnx_runtime_engine_that_decodes_losslessly(demo_checkpoints, tmp_path):
    """The ONNX Runtime engine folds the head's own LM head into its block graph; decoding is the target's greedy
    decoding, and each cycle's drafts are the PyTorch drafter's. SGLang's DFLASH drafter scores with the target's LM
    head alone: an SGLang engine of the head is refused, saying so."""
    from conftest import hf_greedy

    from specdec_kit.export.builder import build_engine
    from specdec_kit.export.inputs import BuildError, BuildInputs
    from specdec_kit.runtime.core.trees import tree_to_dict
    from specdec_kit.runtime.engine import open_engine
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.runtime.synthetic import dflash_with_draft_vocab

    target = TargetModel.from_pretrained(demo_checkpoints["target"], dtype="float32", device="cpu")
    head = dflash_with_draft_vocab(random_dflash(target, block_size=4), target, 3 * target.vocab_size // 4)
    save_draft(head, tmp_path / "head", "dflash", safetensors=True)
    tree = DynamicTreeConfig(6, 2, 2)
    inputs = BuildInputs(
        draft="dflash",
        target=demo_checkpoints["target"],
        draft_path=tmp_path / "head",
        tokenizer=demo_checkpoints["target"],
        backend="onnxruntime",
        dtype="float32",
        tree=tree_to_dict(tree),
    )
    engine = open_engine(build_engine(inputs, tmp_path / "engine").path, device="cpu")
    with pytest.raises(BuildError, match="proposes a reduced vocabulary .*which sglang's own DFLASH drafter does not"):
        build_engine(dataclasses.replace(inputs, backend="sglang", file_hashes={}), tmp_path / "sglang")
    prompt = torch.randint(0, target.vocab_size, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    drafts = []
    for decoder, drafter in (
        (engine.target, engine.drafter_for(tree)),
        (target, drafter_for("dflash", head, target, tree)),
    ):
        seen, original = [], drafter.draft

        def recording(*args, original=original, seen=seen):
            tree = original(*args)
            seen.append(tree.tokens[0].tolist())
            return tree

        drafter.draft = recording
        assert SpeculativeGenerator(decoder, drafter).generate([prompt], 20)[0].tokens == hf_greedy(
            target.hf_model, prompt, 20
        )
        drafts.append(seen)
    assert len(drafts[0]) > 3 and drafts[0] == drafts[1]
