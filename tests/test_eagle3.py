"""EAGLE-3 drafts: an official-layout checkpoint loads strictly and computes the reference's function.

The reference draft (SafeAILab/EAGLE ``main``, ``eagle/model/cnets.py::Model``) is not installable, so it is
recreated here from its documented structure, written independently of the kit's modules: its RMSNorm, rotary
cache, attention with a float32 softmax, ``LlamaDecoderLayeremb`` and ``Model.forward`` (``fc`` applied only when
the input is wider than d). Seeded random weights are saved as the reference saves them (``torch.save`` of the
state dict as ``pytorch_model.bin``, plus its config.json fields) and loaded by the kit.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import SMALL_DEMO
from safetensors.torch import load_file
from test_trtllm_interface import check_against_llm_args
from torch import nn

from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.checkpoint import load_draft, save_draft
from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_to_dict
from specdec_kit.runtime.demo import write_demo
from specdec_kit.runtime.drafts.eagle3 import default_feature_layers
from specdec_kit.runtime.drafts.layers import DraftVocabHead
from specdec_kit.runtime.drafts.loading import DraftLoadError
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.synthetic import random_eagle3, tiny_target
from specdec_kit.train.eagle3 import TrainingTimeTest, draft_vocabulary, tapped_outputs

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 48,
    "intermediate_size": 96,
    "max_position_embeddings": 256,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": 120,
    "draft_vocab_size": 40,
}
TARGET_HIDDEN = 32
TARGET_SHAPE = (8, 64)  # an 8-layer target: feature layers (2, 4, 5)


def load_eagle3(path, target_hidden, target_vocab, target_shape=TARGET_SHAPE):
    return load_draft(path, "eagle3", target_hidden, target_vocab, target_shape=target_shape)


class RefRMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RefAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, self.heads, self.kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = d // self.heads
        self.q_proj = nn.Linear(2 * d, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * d, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * d, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, d, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(c["max_position_embeddings"]).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x, positions, past):
        b, q, _ = x.shape
        qs = self.q_proj(x).view(b, q, self.heads, self.hd).transpose(1, 2)
        ks = self.k_proj(x).view(b, q, self.kv, self.hd).transpose(1, 2)
        vs = self.v_proj(x).view(b, q, self.kv, self.hd).transpose(1, 2)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        qs, ks = qs * cos + rotate_half(qs) * sin, ks * cos + rotate_half(ks) * sin
        if past is not None:
            ks, vs = torch.cat((past[0], ks), dim=2), torch.cat((past[1], vs), dim=2)
        present = (ks, vs)
        rep = self.heads // self.kv
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        scores = qs @ ks.transpose(2, 3) / math.sqrt(self.hd)
        total = ks.shape[2]
        causal = torch.full((q, total), torch.finfo(torch.float32).min).triu(total - q + 1)
        weights = (scores + causal).softmax(dim=-1, dtype=torch.float32).to(qs.dtype)
        out = (weights @ vs).transpose(1, 2).reshape(b, q, -1)
        return self.o_proj(out), present


class RefMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class RefMidLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, eps = c["hidden_size"], c["rms_norm_eps"]
        self.self_attn, self.mlp = RefAttention(c), RefMLP(c)
        self.hidden_norm, self.input_layernorm = RefRMSNorm(d, eps), RefRMSNorm(d, eps)
        self.post_attention_layernorm = RefRMSNorm(d, eps)

    def forward(self, emb, hidden, positions, past):
        residual = hidden
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)
        attn, present = self.self_attn(x, positions, past)
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), present


class RefModel(nn.Module):
    def __init__(self, c, target_hidden):
        super().__init__()
        d = c["hidden_size"]
        self.embed_tokens = nn.Embedding(c["vocab_size"], d, c["pad_token_id"])
        self.lm_head = nn.Linear(d, c["draft_vocab_size"], bias=False)
        self.midlayer = RefMidLayer(c)
        self.fc = nn.Linear(3 * target_hidden, d, bias=False)
        self.norm = RefRMSNorm(d, c["rms_norm_eps"])
        self.register_buffer("d2t", torch.zeros(c["draft_vocab_size"], dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c["vocab_size"], dtype=torch.bool))

    def forward(self, hidden, input_ids, positions, past=None):
        emb = self.embed_tokens(input_ids)
        if hidden.shape[-1] != emb.shape[-1]:
            hidden = self.fc(hidden)
        return self.midlayer(emb, hidden, positions, past)


def reference_checkpoint(path, config=CONFIG, target_hidden=TARGET_HIDDEN, seed=0):
    torch.manual_seed(seed)
    ref = RefModel(config, target_hidden).float()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # norms away from 1, so a swapped norm shows
        used = torch.randperm(config["vocab_size"])[: config["draft_vocab_size"]].sort().values
        ref.d2t.copy_(used - torch.arange(len(used)))
        ref.t2d[used] = True
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            dict(config, **({"target_hidden_size": target_hidden} if target_hidden != config["hidden_size"] else {}))
        )
    )
    torch.save(ref.state_dict(), path / "pytorch_model.bin")
    return ref.eval()


@torch.no_grad()
def test_official_checkpoint_loads_and_matches_the_reference_forward(tmp_path):
    ref = reference_checkpoint(tmp_path / "eagle3")
    assert len(torch.load(tmp_path / "eagle3" / "pytorch_model.bin")) == 16  # the reference's 16 tensors
    draft = load_eagle3(tmp_path / "eagle3", TARGET_HIDDEN, CONFIG["vocab_size"])
    torch.manual_seed(1)
    b, n = 2, 6
    feats, ids = torch.randn(b, n, 3 * TARGET_HIDDEN), torch.randint(0, CONFIG["vocab_size"], (b, n))
    pos = torch.arange(n).expand(b, n)
    # first call: the target's three layers over the prompt
    ref_out, past = ref(feats, ids, pos)
    cache = draft.new_cache(b, 16)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(b, n, n)
    out, _ = draft.step(feats, ids, pos, causal, cache)
    assert (out - ref_out).abs().max() < 1e-5
    ref_logits = ref.lm_head(ref.norm(ref_out))
    assert (draft.logits(out) - ref_logits).abs().max() < 1e-5
    # second call: the draft's own output fed back (d wide, no fc), attending to the first call's keys
    cache.commit(pos, torch.full((b,), n))
    next_ids = ref_logits[:, -1].argmax(-1)
    ref_next, _ = ref(ref_out[:, -1:], (next_ids + ref.d2t[next_ids])[:, None], pos[:, -1:] + 1, past)
    got, _ = draft.step(
        out[:, -1:], draft.target_ids(next_ids)[:, None], pos[:, -1:] + 1, torch.ones(b, 1, 1, dtype=torch.bool), cache
    )
    assert (got - ref_next).abs().max() < 1e-5
    assert torch.equal(draft.target_ids(torch.arange(40)), torch.nonzero(ref.t2d).flatten())


def test_draft_vocabulary_equal_to_the_target_needs_no_maps(tmp_path):
    config = dict(CONFIG, draft_vocab_size=CONFIG["vocab_size"])
    reference_checkpoint(tmp_path / "e3", config, target_hidden=config["hidden_size"])
    state = torch.load(tmp_path / "e3" / "pytorch_model.bin")
    torch.save({k: v for k, v in state.items() if k not in ("d2t", "t2d")}, tmp_path / "e3" / "pytorch_model.bin")
    draft = load_eagle3(tmp_path / "e3", config["hidden_size"], config["vocab_size"])
    assert torch.equal(draft.target_ids(torch.arange(120)), torch.arange(120))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("midlayer.hidden_norm.weight"), "key 'midlayer.hidden_norm.weight' is missing"),
        (lambda s: s.update({"layers.0.input_layernorm.weight": torch.ones(48)}), "unexpected key 'layers.0.input"),
        (
            lambda s: s.update({"fc.weight": torch.zeros(48, 64)}),
            "key 'fc.weight' has shape [48, 64], expected [48, 96]",
        ),
        (lambda s: s["d2t"].add_(1000), "d2t maps draft ids outside the target vocabulary"),
        (lambda s: s["t2d"].logical_not_(), "t2d marks 80 target ids, d2t maps to 40 distinct ones"),
    ],
)
def test_a_checkpoint_that_is_not_eagle3_is_refused_naming_the_problem(tmp_path, change, message):
    reference_checkpoint(tmp_path / "e3")
    file = tmp_path / "e3" / "pytorch_model.bin"
    state = torch.load(file)
    change(state)
    torch.save(state, file)
    with pytest.raises(DraftLoadError, match="pytorch_model.bin") as err:
        load_eagle3(tmp_path / "e3", TARGET_HIDDEN, CONFIG["vocab_size"])
    assert message in str(err.value)


def test_a_draft_for_another_target_is_refused(tmp_path):
    reference_checkpoint(tmp_path / "e3")
    with pytest.raises(DraftLoadError, match="target_hidden_size does not fit the target: expected 64, found 32"):
        load_eagle3(tmp_path / "e3", 64, CONFIG["vocab_size"])
    with pytest.raises(DraftLoadError, match="vocab_size does not fit the target: expected 50, found 120"):
        load_eagle3(tmp_path / "e3", TARGET_HIDDEN, 50)


def test_the_three_feature_layers_are_the_reference_defaults():
    assert default_feature_layers(32) == (2, 16, 29)
    assert default_feature_layers(7) == (2, 3, 4)
    with pytest.raises(ValueError, match="needs at least 7"):
        default_feature_layers(6)


def test_feature_layers_come_from_the_config_or_the_reference_defaults(tmp_path):
    reference_checkpoint(tmp_path / "e3")
    assert load_eagle3(tmp_path / "e3", TARGET_HIDDEN, CONFIG["vocab_size"]).feature_layers == (2, 4, 5)
    config_file = tmp_path / "e3" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(dict(config, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]})))
    assert load_eagle3(tmp_path / "e3", TARGET_HIDDEN, CONFIG["vocab_size"]).feature_layers == (1, 3, 7)
    config_file.write_text(json.dumps(dict(config, eagle_aux_hidden_state_layer_ids=[1, 3, 9])))
    with pytest.raises(DraftLoadError, match=r"eagle_aux_hidden_state_layer_ids is \[1, 3, 9\], expected .* in 0..7"):
        load_eagle3(tmp_path / "e3", TARGET_HIDDEN, CONFIG["vocab_size"])


def test_a_deepspeed_save_of_the_official_trainer_loads_with_the_targets_embedding(tmp_path):
    """The official trainer saves through DeepSpeed with its frozen parameters left out (no ``embed_tokens.weight``:
    it is the target's) and the wrapped target's rotary buffers in: such a file loads against its target, with the
    target's embedding; without a target to take it from, the refusal says so; other stray keys stay refused."""
    ref = reference_checkpoint(tmp_path / "e3")
    file = tmp_path / "e3" / "pytorch_model.bin"
    state = torch.load(file)
    embedding = state.pop("embed_tokens.weight")
    state |= {f"target_model.model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(6) for i in range(20)}
    torch.save(state, file)
    draft = load_draft(tmp_path / "e3", "eagle3", TARGET_HIDDEN, 120, target_shape=TARGET_SHAPE, embedding=embedding)
    assert torch.equal(draft.embed_tokens.weight, embedding) and torch.equal(draft.fc.weight, ref.fc.weight)
    with pytest.raises(DraftLoadError, match="has no embed_tokens.weight .* load it against its target"):
        load_eagle3(tmp_path / "e3", TARGET_HIDDEN, 120)
    torch.save(state | {"target_model.lm_head.weight": torch.ones(2)}, file)
    with pytest.raises(DraftLoadError, match="unexpected key 'target_model.lm_head.weight'"):
        load_draft(tmp_path / "e3", "eagle3", TARGET_HIDDEN, 120, target_shape=TARGET_SHAPE, embedding=embedding)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_a_saved_head_tells_the_official_code_its_rope(tmp_path, scaling):
    """The official code reads top-level ``rope_theta`` / ``rope_scaling`` (current transformers writes only
    ``rope_parameters``): a head of a rope_theta 500000 target says so in both forms, and loads back unchanged."""
    target = tiny_target(hidden_size=32, layers=8, heads=4, kv_heads=2, intermediate=64, vocab=120)
    target.config.rope_parameters = {"rope_theta": 500000.0, "rope_type": "default", **(scaling or {})}
    head = random_eagle3(target)
    save_draft(head, tmp_path / "e3", "eagle3")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["rope_theta"] == 500000.0 and config["rope_parameters"]["rope_theta"] == 500000.0
    if scaling is None:
        assert config["rope_scaling"] is None
    else:
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0, "type": "linear"}
    loaded = load_draft(tmp_path / "e3", "eagle3", 32, 120, target_shape=(8, 64), embedding=head.embed_tokens.weight)
    assert loaded.config.rope_parameters == head.config.rope_parameters
    positions = torch.arange(5)[None]
    x = torch.randn(1, 5, 8)
    for a, b in zip(loaded.rotary_emb(x, positions), head.rotary_emb(x, positions)):
        torch.testing.assert_close(a, b)


# -- in the runtime: the target's taps, training-time test against decoding ---------------------------------------


def tiny_case_target(layers: int = 3):
    return tiny_target(hidden_size=32, layers=layers, heads=4, kv_heads=2, intermediate=64, vocab=50, seed=3)


@torch.no_grad()
def test_the_target_returns_the_hidden_states_entering_the_tapped_layers_from_one_forward():
    target = tiny_case_target(layers=4)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = target.hf_model(ids, output_hidden_states=True)
    plain, target = target, target.tapped((0, 2, 3))
    assert target.feature_size == 3 * 32 and plain.feature_layers is None and plain.feature_size == 32
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 9, 9)
    out = target(ids, torch.arange(9).expand(2, 9), causal, target.new_cache(2, 16))
    expected = torch.cat([ref.hidden_states[i] for i in (0, 2, 3)], dim=-1)
    assert (out.features - expected).abs().max() < 1e-5
    assert (out.logits - ref.logits).abs().max() < 1e-4  # logits still from the last layer
    for bad in ((2, 1), (0, 4), (1, 1)):
        with pytest.raises(ValueError, match="expected distinct ascending layer ids in 0..3"):
            plain.tapped(bad)


@torch.no_grad()
def test_training_time_test_step_j_is_what_the_jth_draft_step_computes_when_decoding():
    """The reference's TTT attention (step 0's keys causally, the chain's own keys at the same position, rotary at
    t + j) must equal decoding: a context step over positions 0..t, then the draft fed its own output."""
    target = tiny_case_target()
    draft = random_eagle3(target).float()
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    taps, logits = tapped_outputs(target, tokens, draft.feature_layers)
    ttt = TrainingTimeTest(draft, taps, tokens, logits)
    hiddens = []
    for j in range(4):
        ttt.step(j)
        hiddens.append(ttt.hidden)
    for t in (3, 7):
        cache = draft.new_cache(2, 32)
        pos = torch.arange(t + 1).expand(2, -1)
        causal = torch.ones(t + 1, t + 1, dtype=torch.bool).tril().expand(2, -1, -1)
        out, _ = draft.step(taps[:, : t + 1], tokens[:, 1 : t + 2], pos, causal, cache)
        cache.commit(pos, torch.full((2,), t + 1))
        assert (out[:, t] - hiddens[0][:, t]).abs().max() < 1e-5
        hidden = out[:, t : t + 1]
        for j in range(1, 4):
            hidden, _ = draft.step(
                hidden,
                tokens[:, t + j + 1 : t + j + 2],
                torch.full((2, 1), t + j),
                torch.ones(2, 1, 1, dtype=torch.bool),
                cache,
            )
            cache.commit(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
            assert (hidden[:, 0] - hiddens[j][:, t]).abs().max() < 1e-5, f"step {j}, position {t}"


def test_the_draft_vocabulary_is_the_most_frequent_tokens_in_the_reference_order():
    tokens = torch.tensor([[5, 5, 5, 2, 2, 9, 9, 9, 9, 1]])
    d2t, t2d = draft_vocabulary(tokens, 12, 3)
    assert torch.equal(torch.arange(3) + d2t, torch.tensor([2, 5, 9]))  # ids ascending, as the reference sorts
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.tensor([2, 5, 9]))
    d2t, _ = draft_vocabulary(tokens, 12, 6)  # fewer distinct tokens than asked: unseen ids by id
    assert torch.equal(torch.arange(6) + d2t, torch.tensor([0, 1, 2, 3, 5, 9]))


@torch.no_grad()
def test_proposals_never_leave_the_draft_vocabulary():
    target = tiny_case_target()
    draft = random_eagle3(target, draft_vocab=20).float()
    logits = DraftVocabHead(draft)(torch.randn(2, 5, 32))
    finite = torch.isfinite(logits)
    assert torch.equal(finite[0, 0], draft.t2d) and bool(finite.sum(-1).eq(20).all())


# -- engine exports: vLLM, SGLang, TensorRT-LLM ---------------------------------------------------------------------


def export(backend: str, draft_dir, checkpoints, out, tree=DynamicTreeConfig(12, 3, 3)):
    inputs = BuildInputs(
        draft="eagle3",
        target=checkpoints["target"],
        draft_path=draft_dir,
        tokenizer=checkpoints["target"],
        backend=backend,
        dtype="float32",
        tree=tree_to_dict(tree),
    )
    return build_engine(inputs, out).path


def test_server_exports_name_the_tapped_layers_in_each_engines_convention(tmp_path):
    """vLLM (like the kit and the reference) names the hidden states entering layers i; SGLang and TensorRT-LLM name
    the outputs of layers i - 1. All three load the official layout with its maps."""
    checkpoints = write_demo(tmp_path / "demo", shape=dict(SMALL_DEMO, layers=4))
    target = TargetModel.from_pretrained(checkpoints["target"], dtype="float32")
    save_draft(random_eagle3(target, draft_vocab=30, layers=(1, 2, 3)), tmp_path / "e3", "eagle3")
    vllm = export("vllm", tmp_path / "e3", checkpoints, tmp_path / "vllm")
    config = json.loads((vllm / "vllm" / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["draft_vocab_size"] == 30
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert '"method":"eagle3"' in (vllm / "vllm" / "serve.sh").read_text()
    sglang = export("sglang", tmp_path / "e3", checkpoints, tmp_path / "sglang")
    config = json.loads((sglang / "sglang" / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert "--speculative-algorithm EAGLE3" in (sglang / "sglang" / "serve.sh").read_text()
    weights = load_file(str(sglang / "sglang" / "draft" / "model.safetensors"))
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert {k.split(".")[0] for k in weights} == {"d2t", "t2d", "embed_tokens", "fc", "midlayer", "norm", "lm_head"}
    trt = export("tensorrt-llm", tmp_path / "e3", checkpoints, tmp_path / "trt")
    spec = check_against_llm_args(trt / "trtllm" / "serve.yaml")  # the keys and types TensorRT-LLM declares
    assert spec["decoding_type"] == "Eagle3" and spec["eagle3_layers_to_capture"] == [0, 1, 2]
    assert spec["speculative_model"] == "trtllm/draft" and spec["max_draft_len"] == 4
    assert "--custom_module_dirs" not in (trt / "trtllm" / "serve.sh").read_text()  # TensorRT-LLM's own class
    assert "draft_vocab_size" in json.loads((trt / "trtllm" / "draft" / "config.json").read_text())


def test_an_engine_that_captures_layer_outputs_refuses_a_draft_reading_the_embeddings(demo_checkpoints, tmp_path):
    target = TargetModel.from_pretrained(demo_checkpoints["target"], dtype="float32")
    save_draft(random_eagle3(target, layers=(0, 1)), tmp_path / "e3", "eagle3")
    with pytest.raises(BuildError, match="SGLang captures layer outputs.*entering layer 0"):
        export("sglang", tmp_path / "e3", demo_checkpoints, tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()


def test_an_offline_feature_cache_gives_eagle3_the_batches_it_streams_and_trains_it(tmp_path):
    """Offline hidden states: the cache holds the inputs of the head's three layers beside the last layer's features,
    so its batches are the streamed ones (fp16 apart), the head trains from it, and a cache of other layers is
    refused."""
    from specdec_kit.train.eagle3 import Eagle3Spec, train_eagle3
    from specdec_kit.train.features import CachedFeatures, write_cache

    target = tiny_case_target(layers=4)
    data = torch.randint(0, 50, (6, 16), generator=torch.Generator().manual_seed(2))
    write_cache(target, data, tmp_path / "cache", shard_blocks=4, taps=[0, 2, 3])
    cached = CachedFeatures(tmp_path / "cache", target, [0, 2, 3])
    idx = torch.tensor([1, 4, 5])
    tokens, taps, logits = cached.batch(idx)
    streamed_taps, streamed_logits = tapped_outputs(target, data[idx], (0, 2, 3))
    assert torch.equal(tokens, data[idx])
    torch.testing.assert_close(taps, streamed_taps, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(logits, streamed_logits, atol=2e-2, rtol=1e-2)
    spec = Eagle3Spec(steps=2, batch=2, seq_len=16, warmup=1, ttt_length=2, feature_layers=[0, 2, 3])
    result = train_eagle3(target, cached, spec, tmp_path / "head", progress=False)
    assert result["steps"] == 2 and (tmp_path / "head" / "config.json").is_file()
    with pytest.raises(ValueError, match=r"holds the inputs of layers \[0, 2, 3\], expected \[1, 2, 3\]"):
        CachedFeatures(tmp_path / "cache", target, [1, 2, 3])
    other = Eagle3Spec(steps=2, batch=2, seq_len=16, warmup=1, feature_layers=[1, 2, 3])
    with pytest.raises(ValueError, match=r"holds the inputs of layers \[0, 2, 3\]; this head reads \[1, 2, 3\]"):
        train_eagle3(target, cached, other, tmp_path / "other", progress=False)
