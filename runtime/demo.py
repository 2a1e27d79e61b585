"""A self-contained demo checkpoint set, written in the official layouts, for the pre-zoo main job.

The target is a synthetic, mostly-bigram Llama (``synthetic.tiny_hf_model``) with a character-level
tokenizer; the drafts are the constructed ``oracle_*``/``fitted_medusa`` drafts. Its text is not
language: it exists to run every draft type end to end through the real loading path
(``from_pretrained``, strict draft loading, ``AutoTokenizer``) until the trained zoo replaces it.
"""

from __future__ import annotations

import string
from pathlib import Path

from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.synthetic import fitted_medusa, oracle_eagle, oracle_griffin, tiny_hf_model

CHARS = string.ascii_letters + string.digits + " .,;:!?'-()\n"


def write_char_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


# deep and narrow like real targets in cost: one draft step is a small fraction of a target step
DEMO_TARGET = dict(hidden_size=256, layers=12, heads=4, kv_heads=2, intermediate=768)


def write_demo(root: Path, shape: dict | None = None) -> dict[str, Path]:
    """Write target + tokenizer + one draft per kind under ``root``; returns their directories.
    ``shape`` overrides the target's size (tests use a smaller one)."""
    root.mkdir(parents=True, exist_ok=True)
    vocab = len(CHARS) + 1
    hf = tiny_hf_model(
        **(shape or DEMO_TARGET), vocab=vocab, context_mix=0.05, logit_scale=20.0, seed=17, max_positions=2048
    )
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(root / "target")
    write_char_tokenizer(root / "target")
    target = TargetModel(hf)
    paths = {"target": root / "target"}
    for kind, draft in (
        ("griffin", oracle_griffin(target)),
        ("eagle", oracle_eagle(target)),
        ("eagle2", oracle_eagle(target)),
        ("hass", oracle_eagle(target)),
        ("medusa", fitted_medusa(target, heads=4)),
    ):
        paths[kind] = root / kind
        save_draft(draft, paths[kind], kind, base_model=str(root / "target"))
    return paths
