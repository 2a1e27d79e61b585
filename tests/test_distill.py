"""Self-distilled training data: the answers are the target's own (greedy: its greedy decoding; sampled: the same
seeded draws on every run), the features written while generating equal the target's hidden states over the finished
sequence, the recorded next tokens are its argmax, a run resumes where it stopped; and draft heads trained on the
data (a reduced draft vocabulary, the embedding taken from the target) load and decode losslessly."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SMALL_DEMO, hf_greedy

from specdec_kit.export.builder import build_engine
from specdec_kit.export.inputs import BuildError, BuildInputs
from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_to_dict
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.demo import write_demo
from specdec_kit.runtime.engine import open_engine
from specdec_kit.runtime.loader import load_draft_for, load_tokenizer, make_drafter
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import draft_kind
from specdec_kit.train.distill import INDEX, DistillSpec, Variant, chat_ids, distill, fingerprint, read_shard
from specdec_kit.train.distilled import DistilledData, ShardSelection
from specdec_kit.train.prompt_sources import Prompt, read_prompts, write_prompts

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}> {% endif %}"
SPEC = dict(
    max_new_tokens=12,
    batch=3,
    chunk=4,
    hidden_indices=[1, 2, 3, 4],
    variants=[Variant("greedy"), Variant("t1", 1.0, 0.9)],
)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A small 4-layer demo target whose tokenizer has a chat template."""
    paths = write_demo(tmp_path_factory.mktemp("chat"), shape=dict(SMALL_DEMO, layers=4))
    config_file = paths["target"] / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TEMPLATE}))
    return paths["target"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    texts = ["the quick brown fox", "def main():", "hello", "a b c d e f", "speculative decoding is", "x"]
    write_prompts([Prompt(f"p/{i}", "test", t) for i, t in enumerate(texts)], path)
    return path


@pytest.fixture(scope="module")
def distilled(chat_target, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "d"
    return out, distill(chat_target, prompts_file, out, DistillSpec(**SPEC), progress=False)


def samples(out):
    index = json.loads((out / INDEX).read_text())
    for shard in index["shards"]:
        data = read_shard(out / shard["file"])
        offsets = data["offsets"]
        for n, meta in enumerate(shard["samples"]):
            a, b = int(offsets[n]), int(offsets[n + 1])
            yield meta, data["tokens"][a:b].long(), data["features"][a:b], data["top"][a:b].long()


def test_answers_features_and_next_tokens_are_the_targets_own(chat_target, prompts_file, distilled):
    out, index = distilled
    target = TargetModel.from_pretrained(chat_target, dtype="float32")
    tokenizer = load_tokenizer(chat_target)
    prompts = {p.id: chat_ids(tokenizer, p) for p in read_prompts(prompts_file)}
    seen = {"greedy": 0, "t1": 0}
    for meta, tokens, feats, top in samples(out):
        seen[meta["variant"]] += 1
        prompt = prompts[meta["prompt_id"]]
        start = meta["answer_start"]
        assert tokens[:start].tolist() == prompt and len(tokens) == start + meta["answer_tokens"] - 1
        if meta["variant"] == "greedy":  # the target's own greedy decoding (this target never ends a turn)
            assert tokens[start:].tolist() == hf_greedy(target.hf_model, prompt, meta["answer_tokens"])[:-1]
        with torch.no_grad():
            ref = target.hf_model(tokens[None], output_hidden_states=True)
        expected = torch.stack([ref.hidden_states[i][0] for i in SPEC["hidden_indices"]], dim=1)
        assert torch.allclose(feats.float(), expected, atol=2e-2, rtol=1e-2)  # float16 storage
        assert top[: start - 1].eq(-1).all()
        assert top[start - 1 :].tolist() == ref.logits[0, start - 1 :].argmax(-1).tolist()
    assert seen == {"greedy": 6, "t1": 6} and index["tokens"] == sum(len(t) for _, t, _, _ in samples(out))


def test_a_run_is_reproducible_resumes_and_refuses_other_settings(chat_target, prompts_file, distilled, tmp_path):
    out, index = distilled
    again = distill(chat_target, prompts_file, tmp_path / "again", DistillSpec(**SPEC), progress=False)
    assert again["fingerprint"] == index["fingerprint"]  # seeded sampling: the same draws on every run
    partial = json.loads((tmp_path / "again" / INDEX).read_text())  # lose one shard: the rerun makes only that one
    lost = partial["shards"].pop()
    (tmp_path / "again" / lost["file"]).unlink()
    (tmp_path / "again" / INDEX).write_text(json.dumps(partial))
    kept = {s["file"]: (tmp_path / "again" / s["file"]).stat().st_mtime_ns for s in partial["shards"]}
    resumed = distill(chat_target, prompts_file, tmp_path / "again", DistillSpec(**SPEC), progress=False)
    assert resumed["fingerprint"] == index["fingerprint"]
    assert all((tmp_path / "again" / f).stat().st_mtime_ns == m for f, m in kept.items())
    with pytest.raises(ValueError, match="written with another spec"):
        distill(
            chat_target, prompts_file, tmp_path / "again", DistillSpec(**{**SPEC, "max_new_tokens": 5}), progress=False
        )
    # fewer prompts: the shards of the chunks whose prompts stay the same are kept, the others dropped
    fewer = distill(chat_target, prompts_file, tmp_path / "again", DistillSpec(**SPEC), limit=4, progress=False)
    assert sorted(s["file"] for s in fewer["shards"]) == ["greedy-0000.safetensors", "t1-0000.safetensors"]
    assert all(
        (tmp_path / "again" / f).stat().st_mtime_ns == m for f, m in kept.items() if f.endswith("-0000.safetensors")
    )


def test_batches_mark_padding_and_the_answers(chat_target, distilled):
    out, _ = distilled
    target = TargetModel.from_pretrained(chat_target, dtype="float32")
    data = DistilledData(out, [4], target.lm_head.weight.data, tokens_per_batch=64, seed=1)
    assert sorted(i for b in data.batches for i in b) == list(range(12))
    for step in range(len(data)):
        tokens, feats, logits, masks = data.batch(step)
        assert tokens.numel() <= 64 or tokens.shape[0] == 1
        for r, i in enumerate(data.batches[step]):
            n, start = data.tokens[i].shape[0], data.starts[i]
            assert masks.valid[r].tolist() == [True] * n + [False] * (tokens.shape[1] - n)
            assert masks.counted[r].nonzero().flatten().tolist() == list(range(start - 1, n))
        assert torch.allclose(logits, feats @ target.lm_head.weight.data.T, atol=1e-5)


def test_prefetched_batches_are_the_batches_asked_for(chat_target, distilled):
    """With prefetching (a GPU's default) each step's batch is the one gathered without it, in order, wrapping
    around, and when a step other than the prefetched one is asked for."""
    out, _ = distilled
    rows = TargetModel.from_pretrained(chat_target, dtype="float32").lm_head.weight.data
    plain = DistilledData(out, [1, 2, 3], rows, tokens_per_batch=64, seed=1)
    ahead = DistilledData(out, [1, 2, 3], rows, tokens_per_batch=64, seed=1)
    ahead.prefetch = True
    for step in [*range(2 * len(plain) + 1), 0, 5, 6, 2]:
        want, got = plain.batch(step), ahead.batch(step)
        assert all(torch.equal(a, b) for a, b in zip(want[:3], got[:3]))
        assert all(torch.equal(getattr(want[3], m), getattr(got[3], m)) for m in ("valid", "counted", "top"))
    assert ahead._pending is not None and plain._pending is None


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["griffin", "eagle3"])
def test_heads_trained_on_distilled_data_decode_losslessly(chat_target, distilled, tmp_path, kind):
    """A reduced draft vocabulary (half the target's) and the target's embedding (left out of the checkpoint)."""
    out, _ = distilled
    target = TargetModel.from_pretrained(chat_target, dtype="float32")
    vocab = target.vocab_size // 2
    if kind == "eagle3":
        from specdec_kit.train.eagle3 import Eagle3Spec, train_eagle3

        spec = Eagle3Spec(steps=8, lr=3e-3, warmup=1, draft_vocab=vocab, ttt_length=3, feature_layers=[1, 2, 3])
        train_eagle3(
            target,
            DistilledData(out, [1, 2, 3], tokens_per_batch=128),
            spec,
            tmp_path,
            progress=False,
            embedding_from_target=True,
        )
    else:
        from specdec_kit.train.heads import HeadSpec, train_head

        spec = HeadSpec.defaults("griffin", steps=8, lr=3e-3, warmup=1, draft_vocab=vocab)
        train_head(
            target,
            DistilledData(out, [4], tokens_per_batch=128),
            spec,
            tmp_path,
            progress=False,
            embedding_from_target=True,
        )
    config = json.loads((tmp_path / "config.json").read_text())
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert config["draft_vocab_size"] == vocab and config["embedding_from_target"] is True
    assert "embed_tokens.weight" not in state and state["d2t"].shape == (vocab,)
    module = load_draft_for(target, kind, tmp_path)
    assert torch.equal(module.embed_tokens.weight, target.embed_tokens.weight)
    head = draft_kind(kind).family.head(module, target)
    logits = head(torch.randn(2, target.hidden_size))  # placed on the target's vocabulary, -inf outside the draft's
    assert logits.shape[-1] == target.vocab_size and int(torch.isfinite(logits[0]).sum()) == vocab
    prompts = [[5, 9, 11], [3, 3, 8, 1, 2]]
    plain = [r.tokens for r in SpeculativeGenerator(target, None).generate(prompts, 24)]
    tree = DynamicTreeConfig(8, 3, 2)
    assert [
        r.tokens for r in SpeculativeGenerator(target, make_drafter(target, kind, tmp_path, tree)).generate(prompts, 24)
    ] == plain
    # the ONNX Runtime engine folds the head in (the LM-head rows of the draft vocabulary, or EAGLE-3's own)
    inputs = BuildInputs(
        draft=kind,
        target=chat_target,
        draft_path=tmp_path,
        tokenizer=chat_target,
        backend="onnxruntime",
        dtype="float32",
        tree=tree_to_dict(tree),
        draft_tree=False,
    )
    engine = open_engine(build_engine(inputs, tmp_path / "engine").path)
    assert [r.tokens for r in SpeculativeGenerator(engine.target, engine.drafter).generate(prompts, 24)] == plain
    if kind == "griffin":  # the servers' drafters score the whole vocabulary: they refuse the head, saying so
        with pytest.raises(BuildError, match="proposes a reduced vocabulary"):
            build_engine(dataclasses.replace(inputs, backend="sglang", file_hashes={}), tmp_path / "sglang")


def test_the_learning_curve_trains_on_growing_parts_of_the_data_and_measures_the_same_held_out_prompts(
    chat_target, distilled, tmp_path, capsys
):
    """The recipe's learning curve: a head trained on the first shards holding N answer tokens, for each N, every
    one measured on the same held-out prompts; the full head is the last point; a finished point is read back, not
    trained again; ``--curve-sizes`` trains only the points it names (a size the recipe lacks is refused before any
    stage). The head's name is not its method (as SmolLM2's griffin-stable)."""
    from specdec_kit.train.recipe import main

    out, _ = distilled
    heads = tmp_path / "heads"
    settings = {
        "epochs": 2,
        "lr": 3e-3,
        "warmup": 1,
        "draft_vocab": 64,
        "tokens_per_batch": 128,
        "eval_every": 2,
        "heldout_percent": 50,
    }
    index = json.loads((out / INDEX).read_text())
    first = sorted(index["shards"], key=lambda s: s["file"])[0]
    first_tokens = sum(s["answer_tokens"] for s in first["samples"])
    recipe = {
        **tiny_recipe(chat_target, heads, {"griffin-stable": {"method": "griffin", **settings}}),
        "prompts": "unused.jsonl",
        "learning_curve": {"heads": ["griffin-stable"], "answer_tokens": [1, first_tokens + 1]},
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe))
    assert main([str(path), "--data", str(out), "--stages", "heads,curve", "--curve-sizes", "3,1"]) == 2
    assert "[3] not among tiny.json's learning_curve answer_tokens" in capsys.readouterr().err
    assert not heads.exists()
    second = str(first_tokens + 1)
    assert main([str(path), "--data", str(out), "--stages", "heads,curve", "--curve-sizes", second]) == 0
    assert not (heads / "curve" / "griffin-stable-1").exists()
    assert len(json.loads((heads / "learning_curve.json").read_text())) == 2  # that point and the full head
    assert main([str(path), "--data", str(out), "--stages", "curve"]) == 0
    points = json.loads((heads / "learning_curve.json").read_text())
    sizes = [p["answer_tokens"] for p in points]
    assert [p["head"] for p in points] == ["griffin-stable"] * 3
    assert sizes[0] == first_tokens < sizes[1] <= sizes[2] == index["answer_tokens"]
    assert points[0]["steps"] < points[1]["steps"] <= points[2]["steps"]
    for point in points:
        best = point["heldout_best"]
        assert len(best["acceptance"]) == 3 and best["tau"] == pytest.approx(1 + sum(best["acceptance"]), abs=1e-3)
        assert len(point["per_position"]) == 3  # what the curve draws, as its earliest points were counted
    assert (heads / "learning_curve.png").stat().st_size > 0
    saved = heads / "curve" / "griffin-stable-1" / "curve_point.json"
    before = saved.stat().st_mtime_ns
    assert main([str(path), "--data", str(out), "--stages", "curve"]) == 0
    assert saved.stat().st_mtime_ns == before and json.loads((heads / "learning_curve.json").read_text()) == points


def test_the_held_out_samples_are_those_of_the_first_shards_however_much_data_follows(distilled):
    """Every head of a recipe is measured on the held-out bucket of the first shards holding the recipe's
    ``heldout_answer_tokens``, so numbers measured before more data was written compare with those after."""
    from specdec_kit.train.heldout import is_held_out
    from specdec_kit.train.recipe import HeadSettings, heldout_split

    out, _ = distilled
    head = HeadSettings.of("griffin", {"heldout_percent": 50})
    shards = sorted(json.loads((out / INDEX).read_text())["shards"], key=lambda s: s["file"])

    def held_out_tokens(shard: dict) -> list[list[int]]:
        data = read_shard(out / shard["file"])
        bounds = data["offsets"].tolist()
        return [
            data["tokens"][bounds[n] : bounds[n + 1]].tolist()
            for n, meta in enumerate(shard["samples"])
            if is_held_out(meta["prompt_id"], 50)
        ]

    first_tokens = sum(s["answer_tokens"] for s in shards[0]["samples"])
    _, limited = heldout_split({"heldout_answer_tokens": first_tokens}, out, SPEC["hidden_indices"][-1:], head)
    _, everything = heldout_split({}, out, SPEC["hidden_indices"][-1:], head)
    assert [t.tolist() for t in limited.tokens] == held_out_tokens(shards[0])
    assert [t.tolist() for t in everything.tokens] == [t for shard in shards for t in held_out_tokens(shard)]
    assert len(everything.tokens) > len(limited.tokens)


def _add_entries(path: str, who: str) -> None:
    from pathlib import Path

    from specdec_kit.train.recipe import update_log

    for n in range(10):
        update_log(Path(path), "tiny", lambda log: log["heads"].update({f"{who}{n}": n}))


def test_heads_trained_by_processes_at_once_each_keep_their_entry_in_the_log(tmp_path):
    import multiprocessing

    path = tmp_path / "training_log.json"
    workers = [multiprocessing.Process(target=_add_entries, args=(str(path), who)) for who in "ab"]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(json.loads(path.read_text())["heads"]) == sorted(f"{w}{n}" for w in "ab" for n in range(10))


def tiny_recipe(target: Path, out: Path, heads: dict) -> dict:
    """A recipe training ``heads`` for the tiny chat target, float32 heads written to ``out``."""
    return {"name": "tiny", "target": str(target), "out": str(out), "save_dtype": "float32", "heads": heads}


def test_the_recipe_goes_on_training_a_head_when_asked_more_epochs(
    chat_target, prompts_file, distilled, tmp_path, capsys
):
    """More epochs in the recipe continue the saved head from its state (its loss history goes on) over the data
    it was trained on, never over other data; an unchanged recipe leaves it alone; --force starts it again."""
    from specdec_kit.train.recipe import main

    out, _ = distilled
    heads = tmp_path / "heads"
    griffin = {"epochs": 1, "lr": 3e-3, "warmup": 1, "draft_vocab": 64, "tokens_per_batch": 128}
    recipe = {**tiny_recipe(chat_target, heads, {"griffin": griffin}), "prompts": "unused.jsonl"}
    path = tmp_path / "tiny.json"

    def run(epochs: int, *extra: str) -> list[int]:
        recipe["heads"]["griffin"]["epochs"] = epochs
        path.write_text(json.dumps(recipe))
        assert main([str(path), "--data", str(out), "--stages", "heads", *extra]) == 0
        return [h["step"] for h in torch.load(heads / "griffin" / "training_state.pt", weights_only=True)["history"]]

    batches = len(DistilledData(out, [4], tokens_per_batch=128))
    assert run(1) == list(range(batches))
    state = heads / "griffin" / "training_state.pt"
    before = state.stat().st_mtime_ns
    capsys.readouterr()
    assert run(1) == list(range(batches)) and state.stat().st_mtime_ns == before  # as far as asked: left alone
    assert f"griffin: already trained in {heads / 'griffin'} ({batches} steps" in capsys.readouterr().err
    assert run(2) == list(range(2 * batches))  # continued from step `batches`, not started again
    log = json.loads((heads / "training_log.json").read_text())
    assert log["heads"]["griffin"]["steps"] == 2 * batches and len(log["histories"]["griffin"]) == 2 * batches
    assert json.loads((heads / "griffin" / "training_spec.json").read_text())["steps"] == 2 * batches
    assert log["heads"]["griffin"]["data_fingerprint"] == json.loads((out / INDEX).read_text())["fingerprint"]
    fewer = tmp_path / "fewer"  # other data: fewer prompts, so another vocabulary and batch plan
    distill(chat_target, prompts_file, fewer, DistillSpec(**SPEC), limit=3, progress=False)
    recipe["heads"]["griffin"]["epochs"] = 9
    path.write_text(json.dumps(recipe))
    before = state.stat().st_mtime_ns
    capsys.readouterr()
    assert main([str(path), "--data", str(fewer), "--stages", "heads"]) == 0 and state.stat().st_mtime_ns == before
    assert "the data now is" in capsys.readouterr().err
    assert run(1, "--force") == list(range(batches))  # from the start, the old state discarded
    assert log["heads"]["griffin"]["answer_tokens"] == json.loads((out / INDEX).read_text())["answer_tokens"]
    shards = sorted(json.loads((out / INDEX).read_text())["shards"], key=lambda shard: shard["file"])
    first = sum(sample["answer_tokens"] for sample in shards[0]["samples"])
    recipe["heads"]["griffin"]["answer_tokens"] = first  # a head limited to the first shards holding that many
    fewer_batches = len(DistilledData(out, [4], tokens_per_batch=128, shards=ShardSelection(answer_tokens=first)))
    assert len(shards) > 1 and run(1, "--force") == list(range(fewer_batches)) and fewer_batches < batches
    assert json.loads((heads / "training_log.json").read_text())["heads"]["griffin"]["answer_tokens"] == first
    growing = tmp_path / "growing"  # the same first shard, then a regeneration writes the others after it
    growing.mkdir()
    shutil.copy(out / shards[0]["file"], growing / shards[0]["file"])
    index = {**json.loads((out / INDEX).read_text()), "shards": shards[:1]}
    (growing / INDEX).write_text(json.dumps({**index, "fingerprint": fingerprint(index)}))
    assert main([str(path), "--data", str(growing), "--stages", "heads", "--force"]) == 0
    assert run(2) == list(range(2 * fewer_batches))  # went on over the grown data's first shard: the same batches
    state.unlink()  # a head trained elsewhere (the committed ones): nothing to go on from, and it says so
    capsys.readouterr()
    run_without_state = main([str(path), "--data", str(out), "--stages", "heads"])
    assert run_without_state == 0 and "no training_state.pt to go on from" in capsys.readouterr().err


def test_a_recipe_head_reads_only_the_shards_from_its_first_chunk_on(chat_target, distilled, tmp_path):
    """``shards_from``: a head continued over the data an earlier run had not read trains on the shards of the pool's
    chunks from that number on, and its log names those shards' answer tokens and fingerprint."""
    from specdec_kit.train.distilled import shard_chunk
    from specdec_kit.train.recipe import index_fingerprint, main

    out, _ = distilled
    index = json.loads((out / INDEX).read_text())
    shards = sorted(index["shards"], key=lambda shard: shard["file"])
    start = shard_chunk(shards[1]["file"])
    later = [shard for shard in shards if shard_chunk(shard["file"]) >= start]
    assert 0 < len(later) < len(shards)
    reader = DistilledData(out, [4], tokens_per_batch=128, shards=ShardSelection(shards_from=start))
    assert len(reader.tokens) == sum(len(shard["samples"]) for shard in later)
    heads = tmp_path / "heads"
    griffin = {"epochs": 1, "lr": 3e-3, "warmup": 1, "draft_vocab": 64, "tokens_per_batch": 128, "shards_from": start}
    recipe = tiny_recipe(chat_target, heads, {"griffin": griffin})
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe))
    assert main([str(path), "--data", str(out), "--stages", "heads"]) == 0
    logged = json.loads((heads / "training_log.json").read_text())["heads"]["griffin"]
    assert logged["steps"] == len(reader) < len(DistilledData(out, [4], tokens_per_batch=128))
    assert logged["answer_tokens"] == sum(x["answer_tokens"] for shard in later for x in shard["samples"])
    assert (
        logged["data_fingerprint"]
        == index_fingerprint(index, ShardSelection(shards_from=start))
        != index["fingerprint"]
    )


def test_a_recipe_head_reads_only_the_passes_it_names_and_is_measured_on_the_first(
    chat_target, distilled, tmp_path, capsys
):
    """``passes``: a head continued over a new sampled pass over the pool (shards ``answers-p1-*``) trains on those
    shards alone, its log names their answer tokens and fingerprint, and its held-out samples are still the first
    pass's; a setting that names no pass is refused, naming the head and the key."""
    from specdec_kit.train.distilled import shard_pass_number
    from specdec_kit.train.heldout import is_held_out
    from specdec_kit.train.recipe import HeadSettings, heldout_split, index_fingerprint, main

    data = tmp_path / "data"
    shutil.copytree(distilled[0], data)
    index = json.loads((data / INDEX).read_text())
    shards = sorted(index["shards"], key=lambda shard: shard["file"])
    for n, shard in enumerate(shards):  # the first shard is the first pass's, the later ones a second pass's
        name = f"answers-{n:05d}.safetensors" if n == 0 else f"answers-p1-{n:05d}.safetensors"
        (data / shard["file"]).rename(data / name)
        shard["file"] = name
    (data / INDEX).write_text(json.dumps(index))
    assert [shard_pass_number(s["file"]) for s in sorted(index["shards"], key=lambda s: s["file"])] == [0] + [1] * (
        len(shards) - 1
    )
    second = ShardSelection(passes=(1,))
    assert second.pick(index["shards"]) == shards[1:]
    assert ShardSelection(passes=(0,)).pick(index["shards"]) == shards[:1]
    reader = DistilledData(data, [4], tokens_per_batch=128, shards=second)
    assert len(reader.tokens) == sum(len(shard["samples"]) for shard in shards[1:])
    heads = tmp_path / "heads"
    griffin = {"epochs": 1, "lr": 3e-3, "warmup": 1, "draft_vocab": 64, "tokens_per_batch": 128, "eval_every": 1}
    recipe = tiny_recipe(chat_target, heads, {"griffin": {**griffin, "passes": [1], "heldout_percent": 50}})
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe))
    assert main([str(path), "--data", str(data), "--stages", "heads"]) == 0
    logged = json.loads((heads / "training_log.json").read_text())["heads"]["griffin"]
    assert logged["answer_tokens"] == sum(x["answer_tokens"] for shard in shards[1:] for x in shard["samples"])
    assert logged["data_fingerprint"] == index_fingerprint(index, second) != index["fingerprint"]
    _, heldout = heldout_split(recipe, data, [4], HeadSettings.of("griffin", recipe["heads"]["griffin"]))
    first = [x for x in shards[0]["samples"] if is_held_out(x["prompt_id"], 50)]
    assert 0 < len(heldout.tokens) == len(first)
    recipe["heads"]["griffin"]["passes"] = "p1"
    path.write_text(json.dumps(recipe))
    capsys.readouterr()
    assert main([str(path), "--data", str(data), "--stages", "heads", "--force"]) == 2
    assert "heads.griffin.passes: 'p1'; expected a list of pass numbers" in capsys.readouterr().err


def test_a_shard_file_names_its_pool_chunk():
    from specdec_kit.train.distilled import shard_chunk

    assert [
        shard_chunk(f) for f in ("answers-00112.safetensors", "answers-p1-00003.jsonl", "plain-0007.safetensors")
    ] == [
        112,
        3,
        7,
    ]
    with pytest.raises(ValueError, match="not a shard file name"):
        shard_chunk("index.json")


def test_a_recipe_head_can_start_from_a_head_the_recipe_trained_before_it(chat_target, distilled, tmp_path):
    """A recipe head's ``init_from`` naming another of its heads starts from that head's folder (its weights, its
    draft vocabulary) and logs the start's held-out measurement; the learning curve's points are new heads."""
    from specdec_kit.train.recipe import main, started_at

    out, _ = distilled
    heads = tmp_path / "heads"
    common = {"lr": 3e-3, "warmup": 1, "draft_vocab": 64, "tokens_per_batch": 128, "eval_every": 2}
    stable = {"method": "griffin", "epochs": 1, "heldout_percent": 50, **common}
    griffin = {"epochs": 1, "decay": 1.0, "init_from": "stable", "heldout_percent": 50, **common}
    recipe = tiny_recipe(chat_target, heads, {"stable": stable, "griffin": griffin})
    recipe["learning_curve"] = {"heads": ["griffin"], "answer_tokens": [10**9], "epochs": 1}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe))
    assert main([str(path), "--data", str(out), "--stages", "heads,curve"]) == 0
    log = json.loads((heads / "training_log.json").read_text())["heads"]
    assert log["griffin"]["heldout_start"]["tau"] == log["stable"]["heldout_best"]["tau"]
    assert log["griffin"]["heldout_best"]["tau"] >= log["stable"]["heldout_best"]["tau"]
    assert started_at(log, "griffin") == log["stable"]["steps"] and started_at(log, "stable") == 0  # where it is drawn
    curve = json.loads((heads / "curve" / "griffin-1000000000" / "training_spec.json").read_text())
    assert curve["init_from"] == ""


JUDGED = SPEC["max_new_tokens"] - 4  # tokens decoded: every chain of 3 they judge lies within the stored answers


def decoded_counts(target: TargetModel, kind: str, head, out) -> tuple[int, list[int]]:
    """(cycles, cycles accepting depth 1..3) of greedy decoding of the data's greedy prompts with a chain of 3."""
    from specdec_kit.runtime.decoding.generate import RequestStats

    generator = SpeculativeGenerator(
        target, make_drafter(target, kind, head, DynamicTreeConfig(4, 3, 1)), eos_token_ids=[]
    )
    stats = RequestStats.combined(
        [
            generator.generate([tokens[: meta["answer_start"]].tolist()], JUDGED)[0].stats
            for meta, tokens, _, _ in samples(out)
            if meta["variant"] == "greedy"
        ]
    )
    return stats.cycles, stats.accepted_per_depth[:3]


def test_heldout_acceptance_per_cycle_is_what_greedy_decoding_measures(chat_target, distilled, tmp_path):
    """The trainers' held-out acceptance counts as the benchmark counts: greedy decoding of the data's prompts with a
    chain of the same depth runs, cycle by cycle, the walk ``ChainCounts`` makes over the stored answers (the same
    number of cycles, the same cycles reaching each depth), which the mean over every position does not."""
    import shutil

    from specdec_kit.train.heldout import feature_draft_acceptance

    out, _ = distilled
    target = TargetModel.from_pretrained(chat_target, dtype="float32")
    lm_head = target.lm_head.float()
    data = DistilledData(out, [4], tokens_per_batch=128, variants=("greedy",))
    data.lm_rows = lm_head.weight.data
    head = shutil.copytree(chat_target.parent / "griffin", tmp_path / "griffin")  # the demo's constructed GRIFFIN,
    weights = torch.load(head / "pytorch_model.bin", weights_only=True)  # blurred so that it predicts only in part
    fc = weights["fc.fc.weight"]
    fc += 0.01 * fc.std() * torch.randn(fc.shape, generator=torch.Generator().manual_seed(0))
    torch.save(weights, head / "pytorch_model.bin")
    draft = load_draft_for(target, "griffin", head).float()
    counts = feature_draft_acceptance(draft, "griffin", lm_head, None, data, max_new_tokens=JUDGED)
    assert 0 < counts.cycle_hits[1] < counts.cycle_hits[0] < counts.cycles
    assert decoded_counts(target, "griffin", head, out) == (counts.cycles, counts.cycle_hits)
    assert counts.per_position() != pytest.approx(counts.per_cycle(), abs=0.05)


def test_the_heldout_report_measures_saved_heads_on_the_recipes_split(chat_target, distilled, tmp_path):
    """``train.heldout_report`` measures a saved head on a recipe's held-out conversations, per decoding cycle and per
    position, as the trainer's own measure does, also a head trained elsewhere under a label of its own; a head the
    recipe does not name is refused, naming its heads."""
    import shutil

    from specdec_kit.train.heldout import feature_draft_acceptance, split
    from specdec_kit.train.heldout_report import main

    out, _ = distilled
    recipe = tmp_path / "tiny.json"
    settings = {"tokens_per_batch": 128, "heldout_percent": 50}
    recipe.write_text(
        json.dumps({"target": str(chat_target), "out": str(chat_target.parent), "heads": {"griffin": settings}})
    )
    assert main([str(recipe), "--heads", "griffin", "--data", str(out), "--out", str(tmp_path / "r.json")]) == 0
    assert torch.is_grad_enabled()  # measured without gradients, and the caller's mode left as it was
    measured = json.loads((tmp_path / "r.json").read_text())["heads"]["griffin"]
    target = TargetModel.from_pretrained(chat_target, dtype="float32")
    heldout = DistilledData(out, [4], tokens_per_batch=128, select=split(50)[1])
    heldout.lm_rows = target.lm_head.weight.data.float()
    draft = load_draft_for(target, "griffin", chat_target.parent / "griffin").float()
    counts = feature_draft_acceptance(draft, "griffin", target.lm_head.float(), None, heldout)
    assert measured["cycles"] == counts.cycles and measured["positions"] == counts.positions > 0
    assert measured["acceptance"] == [round(a, 4) for a in counts.per_cycle()]
    assert measured["per_position"] == [round(a, 4) for a in counts.per_position()]
    elsewhere = shutil.copytree(chat_target.parent / "griffin", tmp_path / "elsewhere")  # a head trained elsewhere
    assert (
        main(
            [str(recipe), "--heads", f"mine=griffin@{elsewhere}", "--data", str(out), "--out", str(tmp_path / "r.json")]
        )
        == 0
    )
    assert json.loads((tmp_path / "r.json").read_text())["heads"]["mine"] == {**measured, "folder": str(elsewhere)}
    with pytest.raises(SystemExit, match="no head 'eagle3'; it has \\['griffin'\\]"):
        main([str(recipe), "--heads", "eagle3", "--data", str(out)])


@pytest.mark.parametrize("kind", ["griffin", "eagle3"])
def test_heldout_acceptance_counts_chains_and_the_best_head_is_kept(chat_target, distilled, tmp_path, kind):
    """Training measures the held-out acceptance every ``eval_every`` steps, logs it, and saves the head of the best
    measurement (whose acceptance it reproduces); the held-out prompts are never trained on. Depth-1 acceptance is
    the draft's first-step agreement with the target's greedy token, as the trainer's own accuracy counts it through
    another path; deeper chains never accept more."""
    from specdec_kit.train.eagle3 import draft_vocab_rows, eagle3_acceptance
    from specdec_kit.train.heldout import feature_draft_acceptance, split

    for_training, for_evaluation = split(50)  # six prompts: half of them held out

    out, _ = distilled
    target = TargetModel.from_pretrained(chat_target, dtype="float32")
    layers = [1, 2, 3] if kind == "eagle3" else [4]
    everything = DistilledData(out, layers, tokens_per_batch=128)
    source = DistilledData(out, layers, tokens_per_batch=128, select=for_training)
    heldout = DistilledData(out, layers, tokens_per_batch=128, select=for_evaluation)
    assert heldout.tokens and len(source.tokens) + len(heldout.tokens) == len(everything.tokens)
    if kind == "eagle3":
        from specdec_kit.train.eagle3 import Eagle3Spec, eagle3_losses, train_eagle3

        spec = Eagle3Spec(
            steps=12,
            lr=3e-3,
            warmup=1,
            ttt_length=3,
            feature_layers=layers,
            eval_every=4,
            draft_vocab=target.vocab_size,
        )  # every target token countable, as the step accuracy needs
        result = train_eagle3(target, source, spec, tmp_path, progress=False, heldout=heldout)
        draft = load_draft_for(target, kind, tmp_path).float()
        everything.lm_rows = draft_vocab_rows(target, draft)
        measure = lambda data: eagle3_acceptance(draft, data)  # noqa: E731
        firsts = [
            eagle3_losses(draft, spec, taps, tokens, logits, masks)[1][0]
            for tokens, taps, logits, masks in map(everything.batch, range(len(everything)))
        ]
        firsts = [(r.accuracy, r.positions) for r in firsts]
    else:
        from specdec_kit.train.heads import HeadSpec, feature_step, train_head

        spec = HeadSpec.defaults("griffin", steps=12, lr=3e-3, warmup=1, noise=0.0, eval_every=4)
        result = train_head(target, source, spec, tmp_path, progress=False, heldout=heldout)
        lm_head = target.lm_head.float()
        everything.lm_rows = lm_head.weight.data
        oracle = load_draft_for(target, "griffin", chat_target.parent / "griffin").float()
        draft = load_draft_for(target, kind, tmp_path).float()
        measure = lambda data, d=None: feature_draft_acceptance(d or draft, "griffin", lm_head, None, data)  # noqa: E731
        gen = torch.Generator().manual_seed(0)
        firsts = [
            feature_step(oracle, lm_head, spec, tokens, feats, logits, gen, masks)[1][0]
            for tokens, feats, logits, masks in map(everything.batch, range(len(everything)))
        ]
        firsts = [(accuracy, positions) for accuracy, _, positions, _ in firsts]
        draft_acceptance = measure(everything, oracle)  # the demo's constructed GRIFFIN predicts this target well
        assert draft_acceptance.per_position()[0] > 0.5
    counts = draft_acceptance if kind == "griffin" else measure(everything)
    acceptance = counts.per_position()
    assert acceptance[0] == pytest.approx(sum(a * n for a, n in firsts) / sum(n for _, n in firsts), abs=0.02)
    assert acceptance[0] >= acceptance[1] >= acceptance[2]
    per_cycle = counts.per_cycle()
    assert per_cycle[0] >= per_cycle[1] >= per_cycle[2] and 0 < counts.cycles < counts.positions
    measured = [
        (r["step"] + 1, r["heldout"]["tau"], r["heldout"]["acceptance"])
        for r in torch.load(tmp_path / "training_state.pt", weights_only=True)["history"]
        if "heldout" in r
    ]
    assert [s for s, _, _ in measured] == [4, 8, 12]
    best_step, best_tau, best_acceptance = max(measured, key=lambda m: (m[1], -m[0]))
    assert result["heldout_best"] == {"step": best_step, "tau": best_tau, "acceptance": best_acceptance}
    heldout.lm_rows = everything.lm_rows
    assert 1 + sum(measure(heldout).per_cycle()) == pytest.approx(best_tau, abs=1e-3)
    # counted as greedy decoding counts, cycle by cycle, on the greedy answers' prompts
    greedy = DistilledData(out, layers, tokens_per_batch=128, variants=("greedy",))
    greedy.lm_rows = everything.lm_rows
    counts = (
        eagle3_acceptance(draft, greedy, max_new_tokens=JUDGED)
        if kind == "eagle3"
        else feature_draft_acceptance(draft, "griffin", lm_head, None, greedy, max_new_tokens=JUDGED)
    )
    assert decoded_counts(target, kind, tmp_path, out) == (counts.cycles, counts.cycle_hits)


@pytest.mark.parametrize("kind", ["griffin", "eagle3"])
def test_a_head_started_from_a_saved_one_is_measured_first_and_kept_unless_beaten(
    chat_target, distilled, tmp_path, kind
):
    """``init_from``: the run starts from the saved head's weights and draft vocabulary (not a seeded new head's nor
    the vocabulary its data would choose), measures it on the held-out set before its first step, and keeps it when
    no step beats it; a saved head of other settings is refused with the tensor that differs."""
    from specdec_kit.train.eagle3 import Eagle3Spec, train_eagle3
    from specdec_kit.train.heads import HeadSpec, train_head
    from specdec_kit.train.heldout import split

    out, _ = distilled
    target = TargetModel.from_pretrained(chat_target, dtype="float32")
    layers = [1, 2, 3] if kind == "eagle3" else [4]
    for_training, for_evaluation = split(50)
    first = DistilledData(out, layers, tokens_per_batch=128, select=for_training, variants=("t1",))
    source = DistilledData(out, layers, tokens_per_batch=128, select=for_training, variants=("greedy",))
    heldout = DistilledData(out, layers, tokens_per_batch=128, select=for_evaluation)
    size = target.vocab_size // 4

    def train(data, folder, **settings):
        settings = {"warmup": 1, "eval_every": 4, "draft_vocab": size, **settings}
        if kind == "eagle3":
            spec = Eagle3Spec(ttt_length=2, feature_layers=layers, **settings)
            return train_eagle3(target, data, spec, folder, progress=False, heldout=heldout)
        return train_head(target, data, HeadSpec.defaults(kind, **settings), folder, progress=False, heldout=heldout)

    saved_folder = tmp_path / "saved"
    saved_result = train(first, saved_folder, steps=8, lr=3e-3)
    saved = load_draft_for(target, kind, saved_folder)
    unchanged = train(source, tmp_path / "unchanged", steps=4, lr=0.0, init_from=str(saved_folder))
    assert unchanged["heldout_start"]["tau"] == saved_result["heldout_best"]["tau"]  # the saved head, measured again
    assert unchanged["heldout_best"]["step"] == 0  # no step beat it: the saved head is what is written
    kept = load_draft_for(target, kind, tmp_path / "unchanged")
    for key, value in saved.state_dict().items():
        assert torch.equal(kept.state_dict()[key], value), key
    train(source, tmp_path / "fresh", steps=1, lr=0.0)
    assert not torch.equal(
        load_draft_for(target, kind, tmp_path / "fresh").d2t, saved.d2t
    )  # the data alone would have chosen another vocabulary
    trained = train(source, tmp_path / "trained", steps=8, lr=3e-3, init_from=str(saved_folder))
    assert trained["heldout_best"]["tau"] >= trained["heldout_start"]["tau"]
    assert torch.equal(load_draft_for(target, kind, tmp_path / "trained").d2t, saved.d2t)
    with pytest.raises(ValueError, match=f"init_from {saved_folder}: its {kind} head does not fit.*d2t: saved"):
        train(source, tmp_path / "other", steps=1, draft_vocab=size // 2, init_from=str(saved_folder))


def test_a_reduced_vocabulary_dflash_head_trains_and_its_heldout_count_is_what_decoding_measures(
    chat_target, distilled, tmp_path
):
    """DFlash with ``draft_vocab``: an LM head of its own over the answers' most frequent tokens, starting as the
    target's rows of them (the full head's logits of those tokens), trained with the rest and saved in the official
    layout; its held-out chains, walked as greedy decoding walks the answers, are what the runtime's decoding with
    the saved head counts, cycle by cycle."""
    from specdec_kit.train.dflash import DFlashSpec, dflash_acceptance, new_dflash, train_dflash
    from specdec_kit.train.eagle3 import draft_vocabulary

    out, _ = distilled
    target = TargetModel.from_pretrained(chat_target, dtype="float32")
    layers, size = [1, 2, 3], target.vocab_size // 2
    source = DistilledData(out, layers, tokens_per_batch=128)
    greedy = DistilledData(out, layers, tokens_per_batch=128, variants=("greedy",))
    spec = DFlashSpec(steps=12, lr=3e-3, warmup=1, block_size=4, feature_layers=layers, draft_vocab=size, eval_every=4)
    result = train_dflash(target, source, spec, tmp_path, progress=False, heldout=greedy)
    d2t, t2d = draft_vocabulary(source.answer_tokens(), target.vocab_size, size)
    assert result["draft_vocab_coverage"] == round(float(t2d[source.answer_tokens()].float().mean()), 4) < 1
    start = new_dflash(target, spec, (d2t, t2d))
    states = torch.randn(3, target.hidden_size)
    assert torch.allclose(start.logits(states), target.lm_head(states)[:, t2d])
    draft = load_draft_for(target, "dflash", tmp_path).float()
    assert draft.has_own_head and torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    assert not torch.allclose(draft.lm_head.weight, start.lm_head.weight)  # its head trained
    history = torch.load(tmp_path / "training_state.pt", weights_only=True)["history"]
    assert [r["step"] + 1 for r in history if "heldout" in r] == [4, 8, 12]
    greedy.lm_rows = target.lm_head.weight.data[:1]
    counts = dflash_acceptance(draft, target.embed_tokens, target.lm_head, greedy, max_new_tokens=JUDGED)
    assert counts.cycles > 0 and counts.cycle_hits[0] > 0
    assert decoded_counts(target, "dflash", tmp_path, out) == (counts.cycles, counts.cycle_hits)
    # the held-out report measures the saved head the same way, on the recipe's held-out split
    from specdec_kit.train.heldout import split
    from specdec_kit.train.heldout_report import main

    recipe = tmp_path / "tiny.json"
    settings = {"method": "dflash", "tokens_per_batch": 128, "heldout_percent": 50, "feature_layers": layers}
    recipe.write_text(json.dumps({"target": str(chat_target), "out": str(tmp_path.parent), "heads": {"d": settings}}))
    report = tmp_path / "r.json"
    assert main([str(recipe), "--heads", f"d=d@{tmp_path}", "--data", str(out), "--out", str(report)]) == 0
    heldout = DistilledData(out, layers, tokens_per_batch=128, select=split(50)[1])
    heldout.lm_rows = greedy.lm_rows
    expected = dflash_acceptance(draft, target.embed_tokens, target.lm_head, heldout).per_cycle()
    assert json.loads(report.read_text())["heads"]["d"]["acceptance"] == [round(a, 4) for a in expected]
