"""The target adapter reproduces transformers' forward, through trees and KV compaction."""

from __future__ import annotations

import pytest
import torch

from specdec_kit.runtime.core.trees import buffers_from_parents
from specdec_kit.runtime.models.target import TargetLoadError, TargetModel
from specdec_kit.runtime.synthetic import tiny_hf_model


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tree_forward_matches_transformers(family):
    hf = tiny_hf_model(family=family, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=70, seed=3)
    target = TargetModel(hf)
    prompts = [[5, 9, 11, 3, 2], [7, 1]]
    cache = target.new_cache(2, 4)  # deliberately small: the cache must grow
    width = 5
    tokens = torch.tensor([prompts[0], prompts[1] + [0, 0, 0]])
    ar = torch.arange(width)
    causal = (ar[None, :] <= ar[:, None]).expand(2, width, width)
    counts = torch.tensor([5, 2])
    target(tokens, ar.expand(2, width), causal, cache)
    cache.commit(ar.expand(2, width), counts)
    # a tree on top: root r, children a and b of r, c child of a
    parents = [-1, 0, 0, 1]
    buf = buffers_from_parents(parents)
    tree_tokens = torch.tensor([[4, 6, 8, 10], [12, 14, 16, 18]])
    out = target(tree_tokens, cache.lengths[:, None] + buf.position_offsets, buf.tree_mask.expand(2, 4, 4), cache)
    for b, prompt in enumerate(prompts):
        for node in range(4):
            path = [int(tree_tokens[b, i]) for i in range(4) if buf.tree_mask[node, i]]
            ref = hf(torch.tensor([prompt + path]), output_hidden_states=True)
            torch.testing.assert_close(out.logits[b, node], ref.logits[0, -1], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(out.features[b, node], ref.hidden_states[-1][0, -1], atol=2e-5, rtol=1e-4)
    # accept path r -> a -> c in row 0 and r -> b in row 1, compact, then continue with one token
    from specdec_kit.runtime.core.verify import path_of

    path, n = path_of(buf.tree_mask.expand(2, 4, 4), torch.tensor([3, 2]))
    assert path.tolist() == [[0, 1, 3], [0, 2, 0]] and n.tolist() == [3, 2]
    cache.commit(path, n)
    assert cache.lengths.tolist() == [8, 4]
    nxt = torch.tensor([[20], [21]])
    one = torch.ones(2, 1, 1, dtype=torch.bool)
    out = target(nxt, cache.lengths[:, None], one, cache)
    for b, accepted in enumerate([[4, 6, 10], [12, 16]]):
        ref = hf(torch.tensor([prompts[b] + accepted + [int(nxt[b])]])).logits[0, -1]
        torch.testing.assert_close(out.logits[b, 0], ref, atol=2e-5, rtol=1e-4)


def test_unsupported_and_missing_targets(tmp_path):
    with pytest.raises(TargetLoadError, match="config.json: missing"):
        TargetModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(TargetLoadError, match=r"'architectures' is \['GPT2LMHeadModel'\]"):
        TargetModel.from_pretrained(tmp_path)


def test_from_pretrained_round_trip(tmp_path):
    hf = tiny_hf_model(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=40)
    hf.save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(tmp_path, device="cpu")
    assert target.architecture == "LlamaForCausalLM" and target.hidden_size == 32 and target.dtype == torch.float32
    ids = torch.tensor([[1, 2, 3]])
    cache = target.new_cache(1, 8)
    out = target(ids, torch.arange(3)[None], torch.tril(torch.ones(3, 3, dtype=torch.bool))[None], cache)
    torch.testing.assert_close(out.logits, hf(ids).logits, atol=1e-5, rtol=1e-4)
