"""Regenerated training data for the real target (SmolLM2): the prompt pool holds at least 20k distinct user turns
from the packaged sources and none of the benchmark's held-out prompts; the answers are the target's own greedy
answers, asked turn by turn through its chat template; the teacher-forced features equal the target's hidden states
and its next-token choices; both stages resume where they stopped and refuse other settings; the trainers' data
reader takes the result."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from specdec_kit.data.prompts import DEFAULT_SPEC_BENCH
from specdec_kit.runtime.loader import load_tokenizer
from specdec_kit.runtime.models.pretrained import resolve_target
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.distill import INDEX, read_shard
from specdec_kit.train.distilled import DistilledData
from specdec_kit.train.prompt_pool import (
    Conversation,
    PoolSpec,
    build_pool,
    held_out_texts,
    normalise,
    read_pool,
    write_pool,
)
from specdec_kit.train.recipe import RECIPES
from specdec_kit.train.regenerate import ANSWERS_INDEX, BackendSpec, RegenSpec, read_answers, regenerate, template_ids
from specdec_kit.train.schedule import resolved_precision
from specdec_kit.train.teacher_features import FeatureSpec, features_for, shared_forwards, teacher_features

SPEC = RegenSpec(max_prompt_tokens=200, max_new_tokens=24, max_turns=2, chunk=2)
CONVERSATIONS = [
    Conversation("t/0", "test", ("Answer with one word: what colour is the sky on a clear day?", "And at night?")),
    Conversation("t/1", "test", ("What is 2 + 2? Reply with the number only.", "Multiply it by 3.")),
    Conversation("t/2", "test", ("Name a fruit.",)),
]


@pytest.fixture(scope="module")
def pool():
    return build_pool(PoolSpec(), RECIPES / "smollm2_prompts.jsonl", DEFAULT_SPEC_BENCH)


def test_the_pool_holds_20k_distinct_user_turns_and_none_of_the_benchmarks(pool, tmp_path):
    conversations, manifest = pool
    turns = [normalise(t) for c in conversations for t in c.turns]
    assert len(turns) >= 20_000 and len(set(turns)) == len(turns) == manifest["user_turns"]
    assert {s for s, m in manifest["mix"].items() if m["conversations"]} == {"recipe", "sharegpt", "chitchat"}
    held_out = [t for t in held_out_texts(DEFAULT_SPEC_BENCH) if t]
    assert len(held_out) >= 60
    assert not set(turns) & set(held_out)
    joined = "\n".join(turns)
    assert not [t for t in held_out if t in joined]  # nor quoted inside a longer turn
    written = write_pool(conversations, manifest, tmp_path)
    assert read_pool(tmp_path) == conversations and len(written["fingerprint"]) == 64


def test_the_documents_recipe_asks_the_long_turns_the_chat_pool_leaves_out(pool):
    """The long-document recipe's pool: prompts of the length summarization and RAG send, none in the chat pool and
    none of the benchmark's, and its answers and prompt windows sized for them."""
    recipe = json.loads((RECIPES / "smollm2-documents.json").read_text())
    section = recipe["regenerate"]
    spec = PoolSpec(**section["pool"])
    documents, manifest = build_pool(spec, RECIPES / "smollm2_prompts.jsonl", DEFAULT_SPEC_BENCH)
    turns = [normalise(t) for c in documents for t in c.turns]
    assert len(turns) >= 800 and all(len(c.turns) == 1 and 3000 < len(c.turns[0]) <= 8000 for c in documents)
    assert manifest["mix"]["recipe"]["conversations"] >= 50  # Spec-Bench's summarization and RAG questions
    assert not set(turns) & {normalise(t) for c in pool[0] for t in c.turns}
    joined = "\n".join(turns)
    assert not [t for t in held_out_texts(DEFAULT_SPEC_BENCH) if t and t in joined]
    answers, features = RegenSpec(**section["answers"]), FeatureSpec(**section["features"])
    assert answers.max_prompt_tokens >= 2048 and features.context_tokens >= 1024


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_target("smollm2")


@pytest.fixture(scope="module")
def regenerated(smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    write_pool(CONVERSATIONS, {"source": "test"}, root / "pool")
    regenerate(smollm2, root / "pool", root / "answers", SPEC, BackendSpec("kit", batch=2), progress=False)
    return root


@pytest.mark.slow
def test_answers_are_the_targets_greedy_answers_asked_turn_by_turn(smollm2, regenerated):
    samples = [s for shard in sorted((regenerated / "answers").glob("answers-*.jsonl")) for s in read_answers(shard)]
    target = TargetModel.from_pretrained(smollm2, dtype="float32")
    tokenizer = load_tokenizer(smollm2)
    eos = target.eos_token_ids()
    by_turn = {(s["conversation"], s["turn"]): s for s in samples}
    for s in samples:
        ids = torch.tensor([s["prompt"]])
        answer = target.hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=SPEC.max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )[0, ids.shape[1] :]
        assert s["answer"] == answer.tolist()
        assert (s["finish"] == "stop") == (s["answer"][-1] in eos)
        history = []
        for turn in range(s["turn"]):  # the follow-up sees the target's own answer to the turn before
            before = by_turn[(s["conversation"], turn)]
            assert before["finish"] == "stop"
            text = tokenizer.decode([t for t in before["answer"] if t not in eos], skip_special_tokens=True)
            history += [{"role": "user", "content": conv_turn(s, turn)}, {"role": "assistant", "content": text}]
        assert s["prompt"] == template_ids(tokenizer, history + [{"role": "user", "content": conv_turn(s, s["turn"])}])
    asked = {(s["conversation"], s["turn"]) for s in samples}
    assert {("t/0", 0), ("t/1", 0), ("t/2", 0)} <= asked and any(turn == 1 for _, turn in asked)
    index = json.loads((regenerated / "answers" / ANSWERS_INDEX).read_text())
    assert index["answer_tokens"] == sum(len(s["answer"]) for s in samples) and len(index["shards"]) == 2


def conv_turn(sample: dict, turn: int) -> str:
    return next(c for c in CONVERSATIONS if c.id == sample["conversation"]).turns[turn]


@pytest.mark.slow
def test_features_are_the_targets_hidden_states_and_next_tokens(smollm2, regenerated):
    spec = FeatureSpec(context_tokens=16, tokens_per_batch=256, hidden_indices=[3, 15, 27, 30])
    index = teacher_features(smollm2, regenerated / "answers", regenerated / "data", spec, progress=False)
    assert index["answer_tokens"] == json.loads((regenerated / "answers" / ANSWERS_INDEX).read_text())["answer_tokens"]
    target = TargetModel.from_pretrained(smollm2, dtype="float32")
    samples = {
        (s["conversation"], f"turn{s['turn']}"): s
        for shard in sorted((regenerated / "answers").glob("answers-*.jsonl"))
        for s in read_answers(shard)
    }
    checked = 0
    for shard in index["shards"]:
        data = read_shard(regenerated / "data" / shard["file"])
        for n, meta in enumerate(shard["samples"]):
            a, b = int(data["offsets"][n]), int(data["offsets"][n + 1])
            s = samples[(meta["prompt_id"], meta["variant"])]
            whole = s["prompt"] + s["answer"][:-1]
            first = len(s["prompt"]) - 16
            start = int(data["answer_start"][n])
            assert data["tokens"][a:b].tolist() == whole[first:] and start == 16
            with torch.no_grad():  # each sample alone, where the pass shares a conversation's forward
                ref = target.hf_model(torch.tensor([whole]), output_hidden_states=True)
            expected = torch.stack([ref.hidden_states[i][0, first:] for i in spec.hidden_indices], dim=1)
            assert torch.allclose(data["features"][a:b].float(), expected, atol=3e-2, rtol=1e-2)  # float16 storage
            top = data["top"][a:b].tolist()
            assert top[: start - 1] == [-1] * (start - 1)
            assert top[start - 1 :] == s["answer"]  # greedy answers: the target's argmax at every answer position
            assert ref.logits[0, len(s["prompt"]) - 1 :].argmax(-1).tolist() == s["answer"]
            checked += 1
    assert checked == sum(len(sh["samples"]) for sh in index["shards"]) >= 4
    # each follow-up shared its first turn's forward: one pass per conversation, over its last turn
    one_by_one = sum(len(s["prompt"]) + len(s["answer"]) - 1 for s in samples.values())
    last = {}
    for s in sorted(samples.values(), key=lambda s: s["turn"]):
        last[s["conversation"]] = s
    shared = sum(len(s["prompt"]) + len(s["answer"]) - 1 for s in last.values())
    follow_ups = [s for s in samples.values() if s["turn"] > 0]
    assert follow_ups and sum(sh["forward_tokens"] for sh in index["shards"]) == shared < one_by_one
    # the LM head's argmax, where answers are not known to be greedy, gives the same next tokens
    first_shard = read_answers(sorted((regenerated / "answers").glob("answers-*.jsonl"))[0])
    computed, _ = features_for(target, first_shard, spec, greedy=False)
    assert [x.top for x in computed] == [x.top for x in features_for(target, first_shard, spec, greedy=True)[0]]
    reader = DistilledData(regenerated / "data", [27], target.lm_head.weight.data, tokens_per_batch=512)
    assert sum(len(b) for b in reader.batches) == checked
    # under bfloat16 autocast: the same samples, features within a few percent of the float32 pass's
    exact = torch.cat([x.features.float() for x in computed])
    fast_samples, _ = features_for(target, first_shard, replace(spec, compute_dtype="bfloat16"), greedy=False)
    fast = torch.cat([x.features.float() for x in fast_samples])
    tops = [(a, b) for x, y in zip(fast_samples, computed) for a, b in zip(x.top, y.top) if b >= 0]
    assert fast.shape == exact.shape and sum(a == b for a, b in tops) >= 0.9 * len(tops)  # near-ties may flip
    error = (fast - exact).pow(2).mean((0, 2)).sqrt() / exact.pow(2).mean((0, 2)).sqrt()
    assert (error < 0.03).all() and (error > 0).all(), error  # computed otherwise, and close


def test_a_follow_up_shares_its_conversations_forward_only_where_its_prompt_extends_the_history():
    def sample(conversation: str, turn: int, prompt: list[int], answer: list[int]) -> dict:
        return {"conversation": conversation, "turn": turn, "prompt": prompt, "answer": answer}

    samples = [
        sample("a", 0, [1, 2], [3, 4]),
        sample("b", 0, [1, 5], [6]),
        sample("a", 1, [1, 2, 3, 4, 7], [8, 9]),  # extends a's turn 0
        sample("b", 1, [1, 5, 60, 7], [8]),  # b's answer tokenized otherwise in the history: a forward of its own
        sample("a", 2, [1, 2, 3, 4, 7, 8, 9, 10], [11]),
    ]
    assert shared_forwards(samples) == [
        ([1, 2, 3, 4, 7, 8, 9, 10], [0, 2, 4]),
        ([1, 5], [1]),
        ([1, 5, 60, 7], [3]),
    ]


def test_prompts_and_answers_longer_than_the_targets_context_are_refused_before_an_engine_starts(smollm2, tmp_path):
    context = json.loads((smollm2 / "config.json").read_text())["max_position_embeddings"]
    write_pool(CONVERSATIONS, {"source": "test"}, tmp_path / "pool")
    spec = RegenSpec(max_prompt_tokens=context, max_new_tokens=16)
    with pytest.raises(
        ValueError, match=f"max_prompt_tokens {context} \\+ max_new_tokens 16 exceeds the target's context"
    ):
        regenerate(smollm2, tmp_path / "pool", tmp_path / "answers", spec, BackendSpec("vllm"), progress=False)
    assert not list((tmp_path / "answers").glob("*.log"))  # no vLLM worker was started


@pytest.mark.slow
def test_both_stages_resume_and_refuse_other_settings(smollm2, regenerated):
    answers, data = regenerated / "answers", regenerated / "data"
    if not (data / INDEX).is_file():
        teacher_features(
            smollm2, answers, data, FeatureSpec(context_tokens=16, hidden_indices=[3, 15, 27, 30]), progress=False
        )
    stamps = {p.name: p.stat().st_mtime_ns for p in [*answers.glob("answers-*"), *data.glob("*.safetensors")]}
    before = json.loads((answers / ANSWERS_INDEX).read_text())
    resumed = regenerate(smollm2, regenerated / "pool", answers, SPEC, BackendSpec("kit"), progress=False)
    assert resumed == {**before, "complete": True}  # nothing left to answer: the index as written, the data whole
    again = teacher_features(
        smollm2, answers, data, FeatureSpec(context_tokens=16, hidden_indices=[3, 15, 27, 30]), progress=False
    )
    assert again["fingerprint"] == json.loads((data / INDEX).read_text())["fingerprint"]
    assert stamps == {p.name: p.stat().st_mtime_ns for p in [*answers.glob("answers-*"), *data.glob("*.safetensors")]}
    with pytest.raises(ValueError, match="written with another spec"):
        regenerate(
            smollm2, regenerated / "pool", answers, RegenSpec(max_new_tokens=8), BackendSpec("kit"), progress=False
        )
    for other in (dict(context_tokens=8), dict(context_tokens=16, compute_dtype="bfloat16")):
        with pytest.raises(ValueError, match="written with another spec"):
            teacher_features(
                smollm2, answers, data, FeatureSpec(**other, hidden_indices=[3, 15, 27, 30]), progress=False
            )
    # auto: bfloat16 where this machine computes it natively (another precision than the data's), else float32
    auto = FeatureSpec(context_tokens=16, hidden_indices=[3, 15, 27, 30], compute_dtype="auto")
    if resolved_precision("auto", torch.device("cpu")) == "bfloat16":
        with pytest.raises(ValueError, match="written with another spec"):
            teacher_features(smollm2, answers, data, auto, progress=False)
    else:
        assert teacher_features(smollm2, answers, data, auto, progress=False)["fingerprint"] == again["fingerprint"]
    with pytest.raises(ValueError, match="features compute_dtype 'float16': expected float32, bfloat16 or auto"):
        FeatureSpec(compute_dtype="float16")


def test_vllm_gives_the_same_answers_as_the_kit(smollm2, regenerated, vllm_python, monkeypatch, tmp_path):
    """vLLM's offline engine (its CPU build, float32, no compilation to start quickly), as two data-parallel replicas
    (a core each, each answering half of every request), answers every turn with the same greedy tokens as the kit's
    runtime, through the same prompts."""
    monkeypatch.setenv("SPECDEC_VLLM_PYTHON", vllm_python)
    how = BackendSpec("vllm", eager=True, replicas=2)
    index = regenerate(smollm2, regenerated / "pool", tmp_path, SPEC, how, progress=False)
    kit = json.loads((regenerated / "answers" / ANSWERS_INDEX).read_text())
    assert [s["sha256"] for s in index["shards"]] == [s["sha256"] for s in kit["shards"]]
    assert {s["backend"] for s in index["shards"]} == {"vllm"}
    assert (tmp_path / "vllm-worker-0.log").is_file() and (tmp_path / "vllm-worker-1.log").is_file()


def test_vllm_answers_a_sampled_pass_whose_prompts_outgrow_one_step(smollm2, vllm_python, monkeypatch, tmp_path):
    """A seeded sampled pass through vLLM's CPU build in a run of its own (the greedy pass answered before, here by
    the kit's runtime, as a recipe resumes), its prompts together more than one step prefills (vLLM's CPU budget, 4,096 tokens, none of
    them cached): with chunked prefill, vLLM rewinds a partly prefilled seeded request's generator by an offset a CPU
    generator does not have and its engine stops; the worker prefills whole prompts, and every conversation is
    answered."""
    monkeypatch.setenv("SPECDEC_VLLM_PYTHON", vllm_python)
    turns = []
    for i in range(8):  # no two prompts share more than the chat template's opening
        days = " ".join(f"On day {d} caravan {i} crossed river {d % 7} and counted {d * i} goats." for d in range(40))
        turns.append(Conversation(f"long/{i}", "test", (f"Caravan {i}. {days} Which day had the most goats?",)))
    write_pool(turns, {"source": "test"}, tmp_path / "pool")
    greedy = RegenSpec(max_prompt_tokens=1024, max_new_tokens=4, max_turns=1, chunk=8)
    regenerate(smollm2, tmp_path / "pool", tmp_path / "answers", greedy, BackendSpec("kit", batch=8), progress=False)
    prompts = [len(s["prompt"]) for s in read_answers(tmp_path / "answers" / "answers-00000.jsonl")]
    assert len(prompts) == 8 and sum(prompts) > 4096, prompts
    sampled = replace(greedy, passes=[{"temperature": 1.0, "seed": 3}])
    how = BackendSpec("vllm", eager=True)
    index = regenerate(smollm2, tmp_path / "pool", tmp_path / "answers", sampled, how, progress=False)
    assert [s["file"] for s in index["shards"]] == ["answers-00000.jsonl", "answers-p1-00000.jsonl"]
    answers = read_answers(tmp_path / "answers" / "answers-p1-00000.jsonl")
    assert sorted(s["conversation"] for s in answers) == sorted(c.id for c in turns)
    assert all(s["pass"] == 1 and s["answer"] for s in answers)


def session_members(session: int) -> list[int]:
    """The live processes of a session (from /proc: the fields after the command's closing parenthesis are state,
    parent, process group, session)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_a_stopped_regeneration_ends_its_engines_processes(smollm2, regenerated, vllm_python, tmp_path):
    """SIGTERM to a regeneration (``kill``, a session's end) ends the vLLM worker it started in a session of its own,
    engine processes and all: Python's default for SIGTERM would end the regeneration alone and leave them running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**asdict(SPEC), "max_new_tokens": 200}))
    command = [sys.executable, "-m", "specdec_kit.train.regenerate", "--target", str(smollm2)]
    command += ["--pool", str(regenerated / "pool"), "--out", str(tmp_path / "answers"), "--spec", str(spec)]
    command += ["--backend", "vllm", "--enforce-eager"]
    job = subprocess.Popen(command, env={**os.environ, "SPECDEC_VLLM_PYTHON": vllm_python}, stderr=subprocess.DEVNULL)
    try:
        worker, started = None, time.monotonic()
        while time.monotonic() - started < 300:  # until the worker has started its engine's own process
            assert job.poll() is None, "the regeneration stopped before its engine started"
            children = [int(p) for p in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]
            worker = next((c for c in children if os.getsid(c) == c), None)
            if worker is not None and len(session_members(worker)) >= 2:
                break
            time.sleep(0.5)
        assert worker is not None and len(session_members(worker)) >= 2, "no engine process in 300 s"
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while session_members(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_members(worker) == []
    finally:
        job.kill()
        job.wait()
        if worker is not None and session_members(worker):  # the test failed: leave nothing running
            os.killpg(worker, signal.SIGKILL)


@pytest.mark.slow
def test_transformers_generate_gives_the_same_answers_as_the_kit(smollm2, regenerated, tmp_path):
    """Hugging Face's batched generate (left-padded rows; what a GPU machine without vLLM uses), with both chunks of
    the pool answered together, writes the kit's greedy answers shard for shard."""
    index = regenerate(
        smollm2, regenerated / "pool", tmp_path, SPEC, BackendSpec("transformers", batch=4, group=2), progress=False
    )
    kit = json.loads((regenerated / "answers" / ANSWERS_INDEX).read_text())
    assert [s["file"] for s in index["shards"]] == [s["file"] for s in kit["shards"]]
    assert [s["sha256"] for s in index["shards"]] == [s["sha256"] for s in kit["shards"]]
    assert {s["backend"] for s in index["shards"]} == {"transformers"}


@pytest.mark.slow
def test_no_group_starts_past_the_deadline_and_a_rerun_writes_the_rest(smollm2, regenerated, tmp_path, monkeypatch):
    """A deadline stops regeneration between groups (the shards written are whole); a rerun without one writes the
    rest, and the result is the uninterrupted run's shard for shard."""
    import time
    from types import SimpleNamespace

    from specdec_kit.train import regenerate as module

    clock = iter(range(10_000))  # one second a reading: the first group starts at 0, the second would at 1
    monkeypatch.setattr(module, "time", SimpleNamespace(time=time.time, monotonic=lambda: float(next(clock))))
    how = BackendSpec("kit", batch=2)
    first = regenerate(smollm2, regenerated / "pool", tmp_path, SPEC, how, progress=False, deadline=0.5)
    kit = json.loads((regenerated / "answers" / ANSWERS_INDEX).read_text())
    assert [s["sha256"] for s in first["shards"]] == [s["sha256"] for s in kit["shards"][:1]]
    rest = regenerate(smollm2, regenerated / "pool", tmp_path, SPEC, how, progress=False)
    assert [s["sha256"] for s in rest["shards"]] == [s["sha256"] for s in kit["shards"]] and len(kit["shards"]) == 2
    assert not first["complete"] and rest["complete"]


@pytest.mark.slow
def test_chosen_chunks_are_answered_alone_and_a_rerun_fills_in_the_others(smollm2, regenerated, tmp_path):
    """``chunks`` answers only those chunks of the pool, each shard the same as the uninterrupted run's; a rerun
    without it writes the chunks left out, in their own files, and the index ends as the whole run's."""
    how = BackendSpec("kit", batch=2)
    kit = json.loads((regenerated / "answers" / ANSWERS_INDEX).read_text())
    later = regenerate(smollm2, regenerated / "pool", tmp_path, SPEC, how, progress=False, chunks={1})
    assert [(s["file"], s["sha256"]) for s in later["shards"]] == [(s["file"], s["sha256"]) for s in kit["shards"][1:]]
    rest = regenerate(smollm2, regenerated / "pool", tmp_path, SPEC, how, progress=False)
    assert sorted(s["sha256"] for s in rest["shards"]) == sorted(s["sha256"] for s in kit["shards"])
    assert rest["answer_tokens"] == kit["answer_tokens"]
    assert not later["complete"] and rest["complete"]


def test_chunk_ranges_read_as_the_shard_numbers_they_name():
    import argparse

    from specdec_kit.train.regenerate import chunk_ranges

    assert chunk_ranges("0-2,7, 10-11") == {0, 1, 2, 7, 10, 11}
    for wrong in ("5-3", "a-b", "-1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="chunks"):
            chunk_ranges(wrong)


def test_only_complete_data_rewrites_the_training_logs_data_record(tmp_path, capsys):
    """A run of chosen chunks (or one cut by its time limit) must not pass its part of the data off as the data the
    log records; a complete run records its own."""
    from specdec_kit.train.recipe import record_data, update_log

    log_path = tmp_path / "training_log.json"
    update_log(log_path, "r", lambda log: log.update(data={"answer_tokens": 4_800_000}, heads={"griffin": {}}))
    index = {
        "fingerprint": "f",
        "tokens": 30,
        "answer_tokens": 20,
        "shards": [{"samples": [{}, {}]}],
        "skipped": [],
        "spec": {},
        "prompts_sha256": "p",
    }
    assert record_data(log_path, "r", {**index, "complete": False})["data"] == {"answer_tokens": 4_800_000}
    assert "partial so far (20 answer tokens" in capsys.readouterr().err
    assert json.loads(log_path.read_text())["data"] == {"answer_tokens": 4_800_000}
    recorded = json.loads(log_path.read_text()) | record_data(log_path, "r", {**index, "complete": True})
    assert recorded["data"]["answer_tokens"] == 20 and recorded["data"]["samples"] == 2
    assert recorded["heads"] == {"griffin": {}} and json.loads(log_path.read_text()) == recorded


def test_a_recipe_head_is_not_started_past_the_time_limit(tmp_path, capsys):
    import time

    from specdec_kit.train.recipe import run_head

    recipe = {"name": "r", "target": "smollm2"}
    assert run_head("griffin", {"epochs": 1}, recipe, tmp_path, tmp_path, False, deadline=time.monotonic() - 1) is None
    assert "griffin: not started: the time limit has passed" in capsys.readouterr().err


@pytest.mark.slow
def test_sampled_passes_answer_the_pool_again_after_the_greedy_shards(smollm2, regenerated, tmp_path):
    """A pass at a temperature answers every conversation again, into shards after the first pass's (which stay as
    they are); its features carry the pass in the sample's variant, keep the conversation as the prompt id (the
    held-out bucket is the same in every pass) and take the target's own next tokens, not the sampled ones."""
    import shutil

    answers, data = tmp_path / "answers", tmp_path / "data"
    shutil.copytree(regenerated / "answers", answers)
    greedy_index = json.loads((answers / ANSWERS_INDEX).read_text())
    stamps = {p.name: p.stat().st_mtime_ns for p in answers.glob("answers-*.jsonl")}
    sampled = replace(SPEC, passes=[{"temperature": 1.0, "seed": 3}])
    index = regenerate(smollm2, regenerated / "pool", answers, sampled, BackendSpec("kit", batch=2), progress=False)
    assert [s["file"] for s in index["shards"]] == [
        *(s["file"] for s in greedy_index["shards"]),
        "answers-p1-00000.jsonl",
        "answers-p1-00001.jsonl",
    ]
    assert index["shards"][: len(greedy_index["shards"])] == greedy_index["shards"]
    assert stamps == {p.name: p.stat().st_mtime_ns for p in answers.glob("answers-*.jsonl") if p.name in stamps}
    greedy = {(s["conversation"], s["turn"]): s for f in stamps for s in read_answers(answers / f)}
    later = [s for f in ("answers-p1-00000.jsonl", "answers-p1-00001.jsonl") for s in read_answers(answers / f)]
    assert all(s["pass"] == 1 for s in later)
    assert {(s["conversation"], 0) for s in later} == {k for k in greedy if k[1] == 0}
    first_turns = [s for s in later if s["turn"] == 0]
    assert all(s["prompt"] == greedy[(s["conversation"], 0)]["prompt"] for s in first_turns)
    assert any(s["answer"] != greedy[(s["conversation"], 0)]["answer"] for s in first_turns)  # sampled, not greedy
    with pytest.raises(ValueError, match="written with another spec"):  # passes may grow, not change
        other = replace(SPEC, passes=[{"temperature": 0.7, "seed": 3}])
        regenerate(smollm2, regenerated / "pool", answers, other, BackendSpec("kit", batch=2), progress=False)
    with pytest.raises(ValueError, match=r"passes\[0\]"):
        RegenSpec(passes=[{"temp": 0.7}])
    index = teacher_features(
        smollm2, answers, data, FeatureSpec(context_tokens=16, hidden_indices=[3, 15, 27, 30]), progress=False
    )
    assert index["answer_tokens"] == sum(
        s["answer_tokens"] for s in json.loads((answers / ANSWERS_INDEX).read_text())["shards"]
    )
    target = TargetModel.from_pretrained(smollm2, dtype="float32")
    by_key = {(s["conversation"], f"turn{s['turn']}-pass1"): s for s in later}
    off_greedy = []  # per sample checked: whether its sampled answer leaves the target's greedy path
    for shard in index["shards"][len(greedy_index["shards"]) :]:
        tensors = read_shard(data / shard["file"])
        for n, meta in enumerate(shard["samples"]):
            s = by_key[(meta["prompt_id"], meta["variant"])]  # the conversation's id, the pass in the variant
            a, b = int(tensors["offsets"][n]), int(tensors["offsets"][n + 1])
            best = best_of(target, s)
            assert tensors["top"][a:b].tolist()[-len(best) :] == best  # the target's choices, not the draws
            off_greedy.append(s["answer"][:-1] != best[:-1])
    assert len(off_greedy) == len(later) and any(off_greedy)


def best_of(target, sample: dict) -> list[int]:
    """The target's most likely next token at each of a sample's answer positions."""
    whole = sample["prompt"] + sample["answer"][:-1]
    with torch.no_grad():
        return target.hf_model(torch.tensor([whole])).logits[0, len(sample["prompt"]) - 1 :].argmax(-1).tolist()
