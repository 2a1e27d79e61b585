"""Offline hidden states written in SpecForge's and speculators' layouts import as the kit's distilled data
(``train/foreign_features.py``): the same tokens, the target's states at the right layers, the loss counted where
their loss masks put it (several answers of a multi-turn sample, not the turns between), and heads train from them.
The files are written here from a small target's real hidden states, as those projects' writers lay them out; the
interchange tier reads the same files with SpecForge's and speculators' own dataset readers (installed from PyPI in
.venv-interchange) and checks that the kit reads what they read."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdec_kit.runtime.demo import write_char_tokenizer
from specdec_kit.runtime.drafts.eagle3 import default_feature_layers
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.synthetic import tiny_hf_model
from specdec_kit.train.distilled import DistilledData
from specdec_kit.train.foreign_features import import_features

REPO = Path(__file__).resolve().parents[1]
LAYERS = 7
TAPS = list(default_feature_layers(LAYERS))  # 2, 3, 4: what both projects capture by default
# (prompt, answer) spans of each sample: 1 for the tokens the loss counts. Sample 1 is two turns; sample 2 counts
# nothing (skipped); sample 3 is stored gzip'd by SpecForge and in float8 by speculators.
MASKS = [
    [0] * 6 + [1] * 10,
    [0] * 4 + [1] * 5 + [0] * 3 + [1] * 6,
    [0] * 9,
    [0] + [1] * 19,
]


@torch.no_grad()
def target_states(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The target's states for one sample: entering the tapped layers, the last layer's output before and after
    the final norm, and the logits."""
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, args, out: captured.update(pre=args[0]))  # returns None
    out = model(ids[None], output_hidden_states=True)
    hook.remove()
    return {
        "taps": torch.stack([out.hidden_states[i][0] for i in TAPS], dim=1),
        "final": out.hidden_states[-1][0],
        "pre": captured["pre"][0],
        "logits": out.logits[0],
    }


def write_specforge(folder: Path, samples: list[dict]) -> None:
    """SpecForge's prepare_hidden_states layout: rows_A-B/data_I.ckpt, a dict of input_ids, loss_mask, hidden_state
    [1, T, d] (the normed final state) and aux_hidden_state [1, T, 3d], in bfloat16 as SGLang captures them."""
    group = folder / "rows_0-5000"
    group.mkdir(parents=True)
    for i, s in enumerate(samples):
        record = {
            "input_ids": s["ids"],
            "loss_mask": torch.tensor(s["mask"]),
            "hidden_state": s["final"].bfloat16()[None],
            "aux_hidden_state": s["taps"].flatten(1).bfloat16()[None],
        }
        if i == 3:  # the gzip'd variant its readers accept
            buffer = io.BytesIO()
            torch.save(record, buffer)
            (group / f"data_{i}.ckpt.gz").write_bytes(gzip.compress(buffer.getvalue()))
        else:
            torch.save(record, group / f"data_{i}.ckpt")


def write_speculators(folder: Path, samples: list[dict]) -> None:
    """speculators' generate-offline-data layout: a datasets folder of input_ids, loss_mask, seq_len rows (in torch
    format) and
    hidden_states/hs_I.safetensors (token_ids, hidden_states [T, 4, d]: the taps and the last layer's output before
    the norm), row 3 in float8 with per-token scales as its FP8 connector writes them."""
    from datasets import Dataset

    rows = Dataset.from_dict(
        {
            "input_ids": [s["ids"].tolist() for s in samples],
            "loss_mask": [s["mask"] for s in samples],
            "seq_len": [len(s["mask"]) for s in samples],
        }
    )
    rows.set_format(type="torch")  # as its preprocessing leaves them
    rows.save_to_disk(str(folder))
    (folder / "hidden_states").mkdir()
    for i, s in enumerate(samples):
        states = torch.cat([s["taps"], s["pre"][:, None]], dim=1).bfloat16()
        record = {"token_ids": s["ids"], "hidden_states": states}
        if i == 3:
            scale = (states.float().abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)
            record["hidden_states"] = (states.float() / scale).to(torch.float8_e4m3fn)
            record["hidden_states_scales"] = scale
        save_file(record, str(folder / "hidden_states" / f"hs_{i}.safetensors"))


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("foreign")
    hf = tiny_hf_model(hidden_size=32, layers=LAYERS, heads=2, kv_heads=1, intermediate=64, vocab=75, seed=3)
    hf.save_pretrained(root / "target")
    write_char_tokenizer(root / "target")
    gen = torch.Generator().manual_seed(0)
    samples = []
    for mask in MASKS:
        ids = torch.randint(0, 75, (len(mask),), generator=gen)
        samples.append({"ids": ids, "mask": mask, **target_states(hf, ids)})
    write_specforge(root / "specforge", samples)
    write_speculators(root / "speculators", samples)
    return {"root": root, "target": root / "target", "samples": samples, "lm_rows": hf.lm_head.weight.data}


def imported(foreign: dict, fmt: str, layers=None, name: str = "") -> Path:
    out = foreign["root"] / f"kit-{fmt}{name}"
    import_features(fmt, foreign["root"] / fmt, foreign["target"], out, layers, progress=False)
    return out


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_their_hidden_states_import_as_the_kits_data(foreign, fmt):
    out = imported(foreign, fmt)
    index = json.loads((out / "index.json").read_text())
    assert index["spec"]["hidden_indices"] == [*TAPS, LAYERS] and index["skipped"] == [
        f"{fmt}:{'rows_0-5000/data_2.ckpt' if fmt == 'specforge' else 'row 2'}"
    ]
    data = DistilledData(out, TAPS, foreign["lm_rows"])  # EAGLE-3's view: the three taps
    kept = [s for s in foreign["samples"] if any(s["mask"][1:])]
    assert len(data.tokens) == len(kept) == 3
    order = sorted(range(3), key=lambda i: data.index["shards"][0]["samples"][i]["prompt_id"])
    for i, s in zip(order, kept):
        assert torch.equal(data.tokens[i], s["ids"])
        stored = data.stored_features(i).float()
        fp8 = fmt == "speculators" and s is kept[2]  # bfloat16 as written; speculators' row 3 in float8
        for got, want in ((stored[:, :3], s["taps"]), (stored[:, 3], s["final"])):  # speculators': normed here
            atol = 0.1 * float(want.abs().amax()) if fp8 else 0.02
            torch.testing.assert_close(got, want, atol=atol, rtol=0.03)
        counts_next = torch.tensor(s["mask"][1:] + [0]) == 1
        expected = torch.where(counts_next, s["logits"].argmax(-1), torch.full_like(s["ids"], -1))
        agree = (data.tops[i] == expected) | ~counts_next  # near-ties may flip under bfloat16: allow one
        assert torch.equal(data.tops[i] >= 0, counts_next) and int((~agree).sum()) <= 1
    for step in range(len(data)):  # the trainers count exactly the positions whose next token is an answer token
        tokens, feats, logits, masks = data.batch(step)
        for r, i in enumerate(data.batches[step]):
            n = data.tokens[i].shape[0]
            assert torch.equal(masks.counted[r, :n], data.tops[i] >= 0)
    multi = data.tops[order[1]] >= 0  # the two-turn sample: both answers count, the user turn between does not
    assert multi.nonzero().flatten().tolist() == list(range(3, 8)) + list(range(11, 17))


@pytest.mark.parametrize("method", ["eagle3", "griffin"])
def test_a_head_trains_from_imported_hidden_states(foreign, method, tmp_path):
    """``specdec-train-head --distilled``: EAGLE-3 reads the imported taps, GRIFFIN the final state."""
    from specdec_kit.train import cli

    data = imported(foreign, "specforge")
    extra = ["--draft-vocab", "40", "--ttt-length", "2"] if method == "eagle3" else []
    common = ["--target", str(foreign["target"]), "--distilled", str(data), "--steps", "3", "--batch", "4"]
    rc = cli.main(["--method", method, *common, "--seq-len", "16", "--out", str(tmp_path / method), *extra])
    assert rc == 0 and (tmp_path / method / "config.json").is_file()
    history = torch.load(tmp_path / method / "training_state.pt", weights_only=True)["history"]
    assert len(history) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)


def test_a_mismatched_import_is_refused_naming_the_file_and_key(foreign, capsys):
    from specdec_kit.train.foreign_features import main

    base = ["--target", str(foreign["target"])]
    root = foreign["root"]
    # files holding three taps read as if they held two: speculators' stack has the wrong depth
    assert (
        main(
            [str(root / "speculators"), "--format", "speculators", *base, "--out", str(root / "x1"), "--layers", "2,3"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "hs_0.safetensors: hidden_states has shape [16, 4, 32], expected [16, 3, 32]" in err
    # SpecForge's aux states hold 3 x d: refused for 2 layers
    assert (
        main([str(root / "specforge"), "--format", "specforge", *base, "--out", str(root / "x2"), "--layers", "2,3"])
        == 2
    )
    assert "data_0.ckpt: aux_hidden_state has shape [16, 96], expected [16, 64]" in capsys.readouterr().err
    # a folder of neither
    assert main([str(root / "target"), "--format", "specforge", *base, "--out", str(root / "x3")]) == 2
    assert "no SpecForge feature files" in capsys.readouterr().err
    # the final state alone (GRIFFIN's), then into the same folder with other layers: refused, nothing lost
    out = imported(foreign, "specforge", layers=[], name="-final")
    before = (out / "index.json").read_text()
    assert main([str(root / "specforge"), "--format", "specforge", *base, "--out", str(out)]) == 2
    assert "written with another spec" in capsys.readouterr().err and (out / "index.json").read_text() == before
    assert DistilledData(out, [LAYERS]).stored_features(0).shape[1] == 1
    # a rerun with the same settings goes on: nothing left to write, the same data
    shard = out / "imported-00000.safetensors"
    stamp = shard.stat().st_mtime_ns
    imported(foreign, "specforge", layers=[], name="-final")
    assert shard.stat().st_mtime_ns == stamp and json.loads((out / "index.json").read_text()) == json.loads(before)


READERS = r"""
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
src, fmt, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
tensors, names = {}, []
if fmt == "specforge":
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files
    files = list_local_files(str(src))
    data = OfflineEagle3Dataset(files, max_len=4096)
    for i in range(len(data)):
        d = data[i]
        names.append(str(Path(files[i]).relative_to(src)))
        for key in ("input_ids", "loss_mask", "hidden_state", "target"):
            tensors[f"{i}.{key}"] = d[key][0].contiguous()
else:
    from hs_connectors.transfer import FP8Transfer
    from speculators.train.data import ArrowDataset
    data = ArrowDataset(4096, str(src), transfer=FP8Transfer(src / "hidden_states", torch.float32), on_missing="raise")
    for i in range(len(data)):
        d = data[i]
        names.append(f"row {i}")
        for key in ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states"):
            tensors[f"{i}.{key}"] = torch.as_tensor(d[key]).contiguous()
save_file(tensors, str(out), metadata={"names": "\n".join(names)})
"""


@pytest.mark.interchange
@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_their_own_readers_read_what_the_kit_imports(foreign, fmt, interchange_python, tmp_path):
    """SpecForge's ``OfflineEagle3Dataset`` and speculators' ``ArrowDataset`` (with its FP8 transfer) read the same
    files: the kit holds their tokens, their tapped states side by side in their order, their final state (normed by
    the target's norm where speculators keeps it before the norm), and counts a position where their loss mask puts
    the next token."""
    script = tmp_path / "readers.py"
    script.write_text(READERS)
    read = tmp_path / "read.safetensors"
    proc = subprocess.run(
        [str(interchange_python), str(script), str(foreign["root"] / fmt), fmt, str(read)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = load_file(str(read))
    with safe_open(str(read), "pt") as f:
        names = f.metadata()["names"].split("\n")
    assert len(names) == len(MASKS)
    data = DistilledData(imported(foreign, fmt, name="-readers"), TAPS)
    by_id = {meta["prompt_id"]: i for i, meta in enumerate(data.index["shards"][0]["samples"])}
    norm = TargetModel.from_pretrained(foreign["target"], dtype="float32").hf_model.model.norm
    compared = 0
    for n, name in enumerate(names):
        if f"{fmt}:{name}" not in by_id:
            assert not theirs[f"{n}.loss_mask"][1:].any()  # the skipped sample: nothing their loss counts
            continue
        i = by_id[f"{fmt}:{name}"]
        assert torch.equal(data.tokens[i], theirs[f"{n}.input_ids"].long())
        stored = data.stored_features(i).float()
        if fmt == "specforge":
            taps, final = theirs[f"{n}.hidden_state"].float(), theirs[f"{n}.target"].float()
        else:
            taps = theirs[f"{n}.hidden_states"].float()
            final = norm(theirs[f"{n}.verifier_last_hidden_states"].float()).detach()
        torch.testing.assert_close(stored[:, :3].flatten(1), taps, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(stored[:, 3], final, atol=2e-2, rtol=1e-2)
        mask = theirs[f"{n}.loss_mask"].reshape(-1).bool()
        # the kit counts position t when their mask holds token t + 1 (SpecForge's reader zeroes its last entry)
        assert torch.equal((data.tops[i] >= 0)[:-2], mask[1:-1])
        compared += 1
    assert compared == 3


SPECFORGE_HEAD = r"""
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import LlamaConfig
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
out = Path(sys.argv[1])
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=1, vocab_size=75, max_position_embeddings=256, rms_norm_eps=1e-6,
                     rope_theta=10000.0, tie_word_embeddings=False)
config.draft_vocab_size, config.architectures = 40, ["LlamaForCausalLMEagle3"]
torch.manual_seed(0)
head = LlamaForCausalLMEagle3(config, attention_backend="sdpa").eval()
with torch.no_grad():
    for name, p in head.named_parameters():  # norms near one, the rest small: every weight matters
        p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    ids = torch.randperm(75)[:40].sort().values  # the draft vocabulary, its maps as SpecForge keeps them
    head.d2t.copy_(ids - torch.arange(40))
    head.t2d.zero_()
    head.t2d[ids] = True
head.save_pretrained(out / "head")
taps, tokens = torch.randn(2, 6, 96), torch.randint(0, 75, (2, 6))
with torch.no_grad():
    logits = head.lm_head(head(hidden_states=taps, inputs_embeds=head.embed_tokens(tokens)))
save_file({"taps": taps, "tokens": tokens, "logits": logits}, str(out / "forward.safetensors"))
"""


@pytest.mark.interchange
def test_a_head_saved_by_specforges_own_class_loads_and_computes_its_forward(interchange_python, tmp_path):
    """SpecForge's EAGLE-3 draft class (``LlamaForCausalLMEagle3``), saved with its own ``save_pretrained``
    (safetensors, ``rope_parameters`` only, the maps as buffers), loads through the kit's strict loader, and the
    kit's draft step over the same taps and tokens gives SpecForge's logits."""
    from specdec_kit.runtime.checkpoint import load_draft

    script = tmp_path / "head.py"
    script.write_text(SPECFORGE_HEAD)
    proc = subprocess.run(
        [str(interchange_python), str(script), str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    draft = load_draft(tmp_path / "head", "eagle3", 32, 75, target_shape=(8, 64))
    theirs = load_file(str(tmp_path / "forward.safetensors"))
    b, n = theirs["tokens"].shape
    positions = torch.arange(n).expand(b, n)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(b, n, n)
    with torch.no_grad():
        out, _ = draft.step(theirs["taps"], theirs["tokens"], positions, causal, draft.new_cache(b, 16))
        logits = draft.logits(out)
    assert theirs["logits"].abs().max() > 0.5  # not a degenerate head
    torch.testing.assert_close(logits, theirs["logits"], atol=1e-5, rtol=1e-5)
