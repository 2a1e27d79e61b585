"""Trainers reduce their loss on a tiny model, GRIFFIN's masks behave as worked by hand, and trained
checkpoints strict-load into the runtime and decode losslessly."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_kit.runtime.checkpoint import load_draft
from specdec_kit.runtime.core.choices import chain
from specdec_kit.runtime.core.trees import DynamicTreeConfig, StaticTree
from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter, MedusaDrafter, NoDrafter, TorchFeatureStep
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.synthetic import tiny_target
from specdec_kit.train.corpus import is_heldout, load_corpus
from specdec_kit.train.draft_forward import alignment_mask
from specdec_kit.train.heads import HeadSpec, train_head
from specdec_kit.train.lm import LMSpec, build_lm, train_lm
from specdec_kit.train.losses import next_alignment_mask, predictable


@pytest.fixture(scope="module")
def target():
    return tiny_target(
        hidden_size=32,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=64,
        vocab=40,
        logit_scale=6.0,
        context_mix=0.5,
        seed=3,
    )


@pytest.fixture(scope="module")
def data(target):
    """Text the target itself would write (its greedy continuations), so heads have something to learn."""
    gen = SpeculativeGenerator(target, NoDrafter(), eos_token_ids=[])
    prompts = [[i, (3 * i) % 40] for i in range(8)]
    return torch.tensor([p + r.tokens for p, r in zip(prompts, gen.generate(prompts, 30))])


@pytest.mark.parametrize(
    "method,precision",
    [("eagle", "float32"), ("hass", "float32"), ("griffin", "float32"), ("griffin", "bfloat16"), ("medusa", "float32")],
)
def test_trainer_reduces_loss_and_checkpoint_loads(tmp_path, target, data, method, precision):
    spec = HeadSpec.defaults(method, steps=40, batch=8, seq_len=32, lr=5e-3, warmup=1, precision=precision)
    train_head(target, data, spec, tmp_path, progress=False)
    history = torch.load(tmp_path / "training_state.pt", weights_only=True)["history"]
    # pass 1's loss: later passes of GRIFFIN average over masks that widen as the draft improves
    key = (lambda h: h["pass_loss"][0]) if "pass_loss" in history[0] else (lambda h: h["loss"])
    first, last = key(history[0]), sum(key(h) for h in history[-5:]) / 5
    assert last < 0.7 * first, f"{method}: loss {first:.3f} -> {last:.3f}"
    head = load_draft(tmp_path, method, target.hidden_size, target.vocab_size)  # strict, official layout
    if method == "medusa":
        drafter = MedusaDrafter(head, StaticTree.from_choices(chain(3)))
    else:
        drafter = FeatureTreeDrafter(TorchFeatureStep(head, target.lm_head), DynamicTreeConfig(8, 2, 3))
    prompts = [[1, 2, 3], [5, 7]]
    plain = SpeculativeGenerator(target, NoDrafter(), eos_token_ids=[]).generate(prompts, 20)
    spec_out = SpeculativeGenerator(target, drafter, eos_token_ids=[]).generate(prompts, 20)
    assert [r.tokens for r in spec_out] == [r.tokens for r in plain]


def test_the_learning_rate_warms_up_holds_and_decays_to_zero_over_the_last_share():
    spec = HeadSpec.defaults("griffin", steps=10, lr=1e-3, warmup=2, decay=0.4)
    rates = [spec.lr_at(step) for step in range(10)]
    assert rates == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert [HeadSpec.defaults("griffin", steps=10, warmup=2).lr_at(s) for s in (1, 9)] == [1e-3, 1e-3]
    with pytest.raises(ValueError, match="decay 1.5"):
        HeadSpec.defaults("griffin", decay=1.5).lr_at(0)
    lm = LMSpec(hidden_size=16, layers=1, intermediate=32, heads=2, kv_heads=1, seq_len=8, batch=2, steps=1, decay=0.2)
    with pytest.raises(ValueError, match="own cosine schedule"):
        train_lm(build_lm(lm, 40, 0), torch.zeros(2, 8, dtype=torch.long), lm, desc="lm-test")


def test_unknown_precision_is_refused(tmp_path, target, data):
    spec = HeadSpec.defaults("griffin", steps=1, batch=4, seq_len=32, precision="float16")
    with pytest.raises(ValueError, match="precision 'float16': expected float32, bfloat16 or auto"):
        train_head(target, data, spec, tmp_path, progress=False)


@pytest.mark.parametrize("flags,bfloat16", [({"avx2"}, False), ({"avx2", "avx512_bf16"}, True), ({"amx_bf16"}, True)])
def test_auto_precision_is_bfloat16_only_where_the_cpu_has_it(monkeypatch, flags, bfloat16):
    """A CPU without AVX-512 BF16 or AMX emulates bfloat16 products (about 70x slower than float32 on an AVX2 machine):
    ``auto`` keeps float32 there; ``bfloat16`` is taken as asked."""
    from specdec_kit.train import schedule

    monkeypatch.setattr(schedule, "cpu_flags", lambda: frozenset(flags))
    cpu = torch.device("cpu")
    with HeadSpec.defaults("griffin", precision="auto").autocast(cpu):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == (torch.bfloat16 if bfloat16 else torch.float32)
    with HeadSpec.defaults("griffin", precision="bfloat16").autocast(cpu):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "flags,described",
    [("fpu avx2 fma", "AMD EPYC (AVX2)"), ("avx2 avx512f avx512_bf16", "AMD EPYC (AVX-512)"), ("sse4_2", "AMD EPYC")],
)
def test_a_benchmark_names_the_cpu_and_its_widest_vector_instructions(monkeypatch, flags, described):
    """Speedups on a CPU depend on its vector width (verification binds on compute sooner with AVX2): every result
    file's machine line says which it was."""
    from specdec_kit.runtime.core import cpu

    monkeypatch.setattr(
        cpu, "cpuinfo_lines", lambda: ["processor\t: 0", "model name\t: AMD EPYC", f"flags\t\t: {flags}"]
    )
    assert cpu.cpu_description() == described


def test_training_resumes_from_state(tmp_path, target, data):
    spec = HeadSpec.defaults("griffin", steps=6, batch=4, seq_len=32, lr=1e-3, warmup=1)
    train_head(target, data, spec, tmp_path, progress=False)
    more = HeadSpec.defaults("griffin", steps=9, batch=4, seq_len=32, lr=1e-3, warmup=1)
    train_head(target, data, more, tmp_path, progress=False)
    history = torch.load(tmp_path / "training_state.pt", weights_only=True)["history"]
    assert [h["step"] for h in history] == list(range(9))


def test_griffin_masks_by_hand():
    # draft top-3 per position over a 6-token vocabulary; true next tokens below
    logits = torch.tensor(
        [
            [
                [9, 8, 7, 0, 0, 0],  # top3 {0,1,2}; truth 1 -> predictable
                [9, 8, 7, 0, 0, 0],  # truth 5 -> NOT predictable
                [0, 0, 0, 9, 8, 7],  # top3 {3,4,5}; truth 3 -> predictable
                [0, 0, 0, 9, 8, 7],  # truth 4 -> predictable
                [9, 8, 7, 0, 0, 0],
            ]
        ]
    ).float()  # truth 2 -> predictable
    truth = torch.tensor([[1, 5, 3, 4, 2]])
    top = torch.topk(logits, 3, dim=-1).indices
    assert predictable(top, truth, 3).tolist() == [[True, False, True, True, True]]
    chain = torch.ones(1, 5, dtype=torch.bool)
    pass2 = next_alignment_mask(chain, top, truth, 3)
    # pass 2: position i consumes position i-1's pass-1 output; the one after the unpredictable token drops
    assert pass2.tolist() == [[False, True, False, True, True]]
    pass3 = next_alignment_mask(pass2, top, truth, 3)
    # pass 3: positions i-1 and i-2 must both have been predictable: only position 4 keeps its loss
    assert pass3.tolist() == [[False, False, False, False, True]]


@pytest.mark.parametrize("method,align_topk", [("griffin", 12), ("griffin", 40), ("hass", 3)])
def test_passes_draft_only_where_it_counts(target, data, method, align_topk, monkeypatch):
    """The LM head runs only at the positions a pass counts and, for GRIFFIN, at the chain positions before them
    whose predictability decides later passes: drafting at every chain position instead gives the same losses,
    counted positions and gradients (a wide top-k keeps chains alive through all three passes)."""
    import specdec_kit.train.heads as heads

    spec = HeadSpec.defaults(method, steps=1, align_topk=align_topk)
    head = heads.new_head(method, target, spec).float()
    lm_head, to_head = heads.head_vocab(head, target)
    tokens = data[:, :32]
    with torch.no_grad():
        feats = target.hf_model(tokens, output_hidden_states=True).hidden_states[-1]
    logits = lm_head(feats)

    def run():
        head.zero_grad()
        loss, stats = heads.feature_step(head, lm_head, spec, tokens, feats, logits, torch.Generator().manual_seed(0))
        loss.backward()
        return float(loss.detach()), stats, [p.grad.clone() for p in head.parameters() if p.grad is not None]

    sparse = run()
    monkeypatch.setattr(heads, "chain_top_positions", lambda token_mask, chain, passes_left: chain)
    dense = run()
    assert [s[2] for s in sparse[1]] == [s[2] for s in dense[1]]  # positions counted per pass
    if method == "griffin":
        assert sparse[1][2][2] > 0, "no chain reached the third pass: the test would prove nothing"
    assert sparse[0] == pytest.approx(dense[0], rel=1e-6)
    for a, b in zip(sparse[2], dense[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_alignment_mask_by_hand():
    m = alignment_mask(4, 2, "cpu").int().tolist()
    # pass 2: target-feature keys up to i-1, then the pass-2 key at i itself
    assert m == [[0, 0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0, 1]]
    m3 = alignment_mask(4, 3, "cpu").int().tolist()
    assert m3[3] == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]  # F_0..F_1, pass-2 at 2, pass-3 at 3


def test_lm_trainer_reduces_loss(data):
    spec = LMSpec(
        hidden_size=32, layers=1, intermediate=64, heads=2, kv_heads=1, seq_len=32, batch=8, steps=30, lr=1e-2, warmup=1
    )
    model = build_lm(spec, 40, 0)
    losses = train_lm(model, data, spec, desc="lm-test")
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0]


def test_corpus_split_is_deterministic_and_disjoint():
    corpus = load_corpus()
    train_names = {d.name for d in corpus.train}
    held_names = {d.name for d in corpus.heldout}
    assert train_names and held_names and not train_names & held_names
    assert all(is_heldout(n) for n in held_names) and not any(is_heldout(n) for n in train_names)
    assert load_corpus().fingerprint() == corpus.fingerprint()


def test_cached_features_match_streamed_and_train(tmp_path, target, data, capsys):
    from specdec_kit.train.features import CachedFeatures, StreamedFeatures, write_cache

    write_cache(target, data, tmp_path / "cache", shard_blocks=3)
    assert "MiB" in capsys.readouterr().err  # the size is announced before writing
    cached, streamed = CachedFeatures(tmp_path / "cache", target), StreamedFeatures(target, data)
    idx = torch.tensor([0, 5, 7])
    for a, b in zip(cached.batch(idx), streamed.batch(idx)):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=1e-2)
    spec = HeadSpec.defaults("griffin", steps=3, batch=4, seq_len=32, lr=1e-3, warmup=1)
    train_head(target, cached, spec, tmp_path / "head", progress=False)
    assert (tmp_path / "head" / "pytorch_model.bin").is_file()


def test_train_head_cli(tmp_path, capsys):
    from specdec_kit.runtime.demo import write_char_tokenizer
    from specdec_kit.runtime.synthetic import tiny_hf_model
    from specdec_kit.train import cli

    hf = tiny_hf_model(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=75)
    hf.save_pretrained(tmp_path / "target")
    write_char_tokenizer(tmp_path / "target")
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    rc = cli.main(
        [
            "--method",
            "hass",
            "--target",
            str(tmp_path / "target"),
            "--out",
            str(tmp_path / "hass"),
            "--data",
            str(tmp_path / "text.txt"),
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--time-limit",
            "5",
            "--decay",
            "0.5",
        ]
    )
    assert rc == 0
    load_draft(tmp_path / "hass", "hass", 32, 75)
    spec = json.loads((tmp_path / "hass" / "training_spec.json").read_text())
    assert spec["steps"] == 3 and spec["time_limit"] == 5.0 and spec["decay"] == 0.5
    rc = cli.main(["--method", "hass", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "x")])
    assert rc == 2
    # a sharded target needs several ranks and a target that runs in training; MoA's step holds the whole target
    common = ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "text.txt"), "--steps", "1"]
    common += ["--batch", "2", "--seq-len", "32", "--out", str(tmp_path / "x"), "--target-sharding", "fsdp"]
    capsys.readouterr()
    for method, extra, named in (
        ("hass", [], "needs several ranks"),
        ("hass", ["--cache-features", str(tmp_path / "cache")], "with --cache-features"),
        ("moa", [], "every rank holds the whole target"),
    ):
        assert cli.main(["--method", method, *common, *extra]) == 2
        assert named in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("method", ["griffin", "eagle3"])
def test_the_cli_trains_from_offline_hidden_states(method, tmp_path):
    """``--cache-features DIR``: the target's hidden states written once (EAGLE-3's three layers' inputs too), then
    every step reads them; the head is written in its layout."""
    import json

    from specdec_kit.runtime.demo import write_char_tokenizer
    from specdec_kit.runtime.synthetic import tiny_hf_model
    from specdec_kit.train import cli

    hf = tiny_hf_model(hidden_size=32, layers=3, heads=2, kv_heads=1, intermediate=64, vocab=75)
    hf.save_pretrained(tmp_path / "target")
    write_char_tokenizer(tmp_path / "target")
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    layers = ["--feature-layers", "0,1,2", "--ttt-length", "2"] if method == "eagle3" else []
    common = ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "text.txt"), "--steps", "2"]
    rc = cli.main(
        ["--method", method, *common, "--batch", "2", "--seq-len", "32", "--out", str(tmp_path / "head"), *layers]
        + ["--cache-features", str(tmp_path / "cache")]
    )
    assert rc == 0 and (tmp_path / "head" / "config.json").is_file()
    index = json.loads((tmp_path / "cache" / "index.json").read_text())
    assert index["taps"] == ([0, 1, 2] if method == "eagle3" else [])


def test_a_time_limit_ends_training_with_a_measured_saved_last_step(tmp_path, target, data, monkeypatch):
    """With a time limit the first step that begins past it is the last: the spec, the state and the head written are
    those of the steps run, and a rerun without the limit goes on from there to the planned steps."""
    from types import SimpleNamespace

    from specdec_kit.train import schedule

    clock = iter(range(10_000))  # one second a reading
    monkeypatch.setattr(schedule, "time", SimpleNamespace(monotonic=lambda: float(next(clock))))
    spec = HeadSpec.defaults("griffin", steps=20, batch=4, seq_len=32, lr=1e-3, warmup=1, time_limit=2.5 / 60)
    result = train_head(target, data, spec, tmp_path, progress=False)
    saved = torch.load(tmp_path / "training_state.pt", weights_only=True)
    assert result["steps"] == saved["step"] == 3 and [h["step"] for h in saved["history"]] == [0, 1, 2]
    assert json.loads((tmp_path / "training_spec.json").read_text())["steps"] == 3
    load_draft(tmp_path, "griffin", target.hidden_size, target.vocab_size)
    more = HeadSpec.defaults("griffin", steps=5, batch=4, seq_len=32, lr=1e-3, warmup=1)
    train_head(target, data, more, tmp_path, progress=False)
    history = torch.load(tmp_path / "training_state.pt", weights_only=True)["history"]
    assert [h["step"] for h in history] == list(range(5))


def test_ranks_decide_together_over_a_process_group():
    """``Ranks.any`` and the mean of a logged value reduce over the process group (gloo here: CPU tensors)."""
    import torch.distributed as dist

    from specdec_kit.train.parallel import Ranks

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = Ranks(0, 2)  # two ranks' arithmetic over a one-process group: the reduction is the identity
        assert ranks.any(True) and not ranks.any(False)
        assert ranks.average(3.0) == 1.5 and Ranks.reduced([1.0, 2.0]) == [1.0, 2.0]
    finally:
        dist.destroy_process_group()


def test_freed_host_memory_goes_back_to_the_system_between_training_steps():
    """What a CPU training step frees is returned to the system (every trainer's step ends so), not kept by the heap
    for shapes the next batches may never have: without it, a long run's memory grows step after step."""
    from specdec_kit.train.host_memory import release_freed_host_memory

    def resident_mb() -> float:
        status = open("/proc/self/status").read()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    large = torch.ones(24 * 2**20, dtype=torch.uint8)  # freeing it raises the heap's threshold for its own pages
    del large
    pieces = [torch.ones(2**18) for _ in range(300)]  # 300 MB of 1 MB blocks, now from the heap
    last = pieces[-1]  # in use above the others: the heap cannot simply shrink from its top
    del pieces
    before = resident_mb()
    assert release_freed_host_memory()
    assert before - resident_mb() > 150, "the freed blocks stayed with the process"
    assert float(last.sum()) == 2**18
