"""The llama.cpp tier: llama.cpp's own converter and ``llama-server`` (release b11434, ``scripts/setup_llamacpp.sh``) run
SmolLM2 with the kit's committed EAGLE-3 head.

Greedy output with the head (``--spec-type draft-eagle3``, chains of 3) is llama.cpp's plain decoding token for token,
and the head is accepted there as in the kit: on the same prompts, llama.cpp's accepted share of drafted tokens is
the kit's within a few tokens (the kit drafts the same chain of 3 with ``dynamic:4:2:1``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tiers import missing_tool

from specdec_kit.export.llamacpp import LlamaCppError, LlamaServer, export, server_command, tool
from specdec_kit.runtime.core.cpu import process_threads
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.loader import load_draft_for, load_tokenizer
from specdec_kit.runtime.models.pretrained import resolve_target
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import drafter_for

pytestmark = pytest.mark.llamacpp

HEAD = "zoo/smollm2/eagle3"
QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three tips for staying focused while studying.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    try:
        tool("llama-server")
    except LlamaCppError as exc:
        missing_tool(str(exc))
    target_dir = resolve_target("smollm2")
    files = export(target_dir, Path(HEAD), tmp_path_factory.mktemp("gguf"))
    return target_dir, files


@pytest.fixture(scope="module")
def prompts(gguf):
    tokenizer = load_tokenizer(gguf[0])
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def served(gguf, draft: bool, port: int, tmp_path, prompts) -> list[dict]:
    _, files = gguf
    command = server_command(files["target"], files["draft"] if draft else None, port, threads=process_threads())
    with LlamaServer(command, port, tmp_path / f"llama-server-{port}.log") as server:
        return [server.complete(p, NEW_TOKENS) for p in prompts]


def test_the_kits_eagle3_head_runs_in_llama_server_losslessly_and_is_accepted_as_in_the_kit(gguf, prompts, tmp_path):
    plain = served(gguf, False, 18431, tmp_path, prompts)
    spec = served(gguf, True, 18432, tmp_path, prompts)
    for p, s in zip(plain, spec):
        assert len(s["tokens"]) == NEW_TOKENS and s["tokens"] == p["tokens"]  # greedy: llama.cpp's own output
    drafted = sum(s["timings"]["draft_n"] for s in spec)
    accepted = sum(s["timings"]["draft_n_accepted"] for s in spec)
    assert drafted > 0 and accepted > 0, "llama.cpp drafted nothing with the head"

    target = TargetModel.from_pretrained(str(gguf[0]))
    drafter = drafter_for("eagle3", load_draft_for(target, "eagle3", HEAD), target, DynamicTreeConfig(4, 2, 1))
    with torch.inference_mode():
        kit = SpeculativeGenerator(target, drafter).generate(prompts, NEW_TOKENS)
    kit_drafted = sum(r.stats.draft_tokens for r in kit)
    kit_accepted = sum(r.stats.accepted_tokens for r in kit)
    same = sum(int(a == b) for r, p in zip(kit, plain) for a, b in zip(r.tokens, p["tokens"]))
    print(
        f"llama.cpp accepted {accepted}/{drafted} drafted tokens, the kit {kit_accepted}/{kit_drafted}; "
        f"greedy tokens equal to llama.cpp's: {same}/{NEW_TOKENS * len(prompts)}"
    )
    assert abs(accepted / drafted - kit_accepted / kit_drafted) < 0.05


def test_the_cpu_side_by_side_benchmark_measures_the_kit_and_llama_server(gguf, tmp_path):
    """``specdec-bench-cpu`` end to end at a smoke size (the kit on its PyTorch backend: the ONNX Runtime engines'
    exports take minutes here): every server answers every request with every token, speculation reports its
    acceptance (plain does not), greedy texts are compared within a precision, and the goals name both programs.
    The f32 GGUF files are the module's, which the benchmark finds where it would have converted them and reuses."""
    import json

    from specdec_kit.bench.cpu_side_by_side import main

    _, files = gguf
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "smollm2-gguf-f32").symlink_to(files["target"].parent, target_is_directory=True)
    out = tmp_path / "results"
    servers = "kit:f32:plain,kit:f32:eagle3,llama.cpp:f32:plain,llama.cpp:f32:eagle3,llama.cpp:q4_1:plain"
    argv = ["--servers", servers, "--kit-backend", "torch", "--concurrency", "1,2", "--repeats", "1"]
    argv += ["--prompts", "2", "--max-tokens", "16", "--engines", str(tmp_path / "engines"), "--out", str(out)]
    argv += ["--kit-policy", "fixed"]  # the engine's tree every cycle: the cost policy may pick plain
    argv += ["--quiet-wait", "0"]  # beside other tests the CPUs never go idle: no 20 s wait before each measurement
    assert main(argv) == 0
    result = json.loads((out / "cpu_side_by_side.json").read_text())
    assert result["settings"]["quiet_wait"] == 0 and all(r["quiet_wait_s"] == 0 for r in result["rows"])
    rows = {(r["server"], r["mode"], r["streams"]): r for r in result["summary"]}
    assert set(rows) == {
        (server, mode, streams)
        for server, mode in (
            ("kit f32", "plain"),
            ("kit f32", "eagle3"),
            ("llama.cpp f32", "plain"),
            ("llama.cpp f32", "eagle3"),
            ("llama.cpp q4_1", "plain"),
        )
        for streams in (1, 2)
    }
    assert all(r["tokens"] == r["requests"] * 16 and r["failed"] == 0 for r in result["rows"])
    for (server, mode, streams), row in rows.items():
        assert (row["acceptance_length"] is None) == (mode == "plain"), row
        if server.startswith("kit"):  # lossless at every level; llama.cpp's batched kernels may round otherwise
            assert row["same_text_as_reference"] == "2/2", row
    assert [g["goal"] for g in result["goals"]] == [
        "kit f32 best >= llama.cpp f32 best at 1 stream",
        "kit f32 best >= llama.cpp f32 best at 2 streams",
    ]
    text = (out / "cpu_side_by_side.md").read_text()
    assert "| llama.cpp q4_1 | plain | 2 |" in text and (out / "cpu_side_by_side.png").stat().st_size > 0


def test_the_cpu_benchmark_refuses_servers_it_cannot_run():
    from specdec_kit.bench.cpu_side_by_side import parse_servers

    assert [s.label for s in parse_servers("kit:int4:griffin, llama.cpp:q8_0:eagle3")] == [
        "kit int4-griffin",
        "llama.cpp q8_0-eagle3",
    ]
    for bad, says in (
        ("kit:q8_0:plain", "kit runs weights ['f32', 'int4'], not 'q8_0'"),
        ("llama.cpp:f32:griffin", "llama.cpp modes are ['plain', 'eagle3'], not 'griffin'"),
        ("sglang:f32:plain", "server 'sglang'"),
        ("kit:f32", "is not server:weights:mode"),
        ("kit:f32:plain,kit:f32:plain", "listed twice"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_servers(bad)
