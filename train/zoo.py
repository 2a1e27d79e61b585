"""``python -m specdec_kit.train.zoo``: build the demo model zoo from ``zoo_recipe.json``.

Stages (each skipped when its output exists, unless --force): tokenizer, target, heads, draft_lm.
Everything is trained by the kit on the stdlib corpus; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy modules load in the functions that use them: --help answers before torch loads
    import torch

    from specdec_kit.train.lm import LMSpec

RECIPE = Path(__file__).with_name("zoo_recipe.json")


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def train_tokens(tokenizer, corpus, spec: LMSpec) -> torch.Tensor:
    from specdec_kit.train.data import blocks, token_stream

    need = spec.steps * spec.batch * spec.seq_len
    return blocks(token_stream(tokenizer, corpus.train, max_tokens=need + spec.seq_len), spec.seq_len, spec.seed)


def build_lm_stage(name: str, out: Path, recipe: dict, tokenizer, corpus, log: dict) -> None:
    import torch

    from specdec_kit.runtime.core.device import resolve_dtype
    from specdec_kit.train.data import blocks, token_stream
    from specdec_kit.train.lm import LMSpec, build_lm, heldout_loss, train_lm

    spec = LMSpec(**recipe[name])
    data = train_tokens(tokenizer, corpus, spec)
    model = build_lm(spec, len(tokenizer), tokenizer.eos_token_id)
    print(
        f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{data.numel() / 1e6:.2f}M training tokens",
        file=sys.stderr,
    )
    t0 = time.time()
    losses = train_lm(model, data, spec, state_path=out / f"{name}_training_state.pt", desc=name)
    held = blocks(token_stream(tokenizer, corpus.heldout, max_tokens=64 * spec.seq_len), spec.seq_len, 0)
    log[name] = {
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "heldout_loss": heldout_loss(model, held),
        "minutes": round((time.time() - t0) / 60, 1),
    }
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.to(resolve_dtype(recipe["save_dtype"], torch.device("cpu"))).save_pretrained(out / name)
    tokenizer.save_pretrained(out / name)
    print(f"{name}: {log[name]}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from specdec_kit.train.corpus import describe, load_corpus
    from specdec_kit.train.tokenizer import train_bpe

    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.train.zoo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("zoo"))
    p.add_argument("--recipe", type=Path, default=RECIPE)
    p.add_argument("--stages", default="tokenizer,target,heads,draft_lm")
    p.add_argument("--force", action="store_true", help="rebuild stages whose outputs exist")
    args = p.parse_args(argv)
    recipe = json.loads(args.recipe.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = args.out / "training_log.json"
    log = json.loads(log_file.read_text()) if log_file.is_file() else {}
    corpus = load_corpus()
    print(describe(corpus), file=sys.stderr)
    log["corpus"] = corpus.fingerprint()
    log["recipe"] = recipe_hash(recipe)
    stages = args.stages.split(",")
    tok_dir = args.out / "tokenizer"
    if "tokenizer" in stages and (args.force or not tok_dir.is_dir()):
        spec = recipe["tokenizer"]
        train_bpe((d.text for d in corpus.train[: spec["train_files"]]), spec["vocab_size"], tok_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    for name in ("target", "draft_lm"):
        if name in stages and (args.force or not (args.out / name / "config.json").is_file()):
            build_lm_stage(name, args.out, recipe, tokenizer, corpus, log)
            log_file.write_text(json.dumps(log, indent=2))
    if "heads" in stages:
        from specdec_kit.train.heads import build_heads

        build_heads(args.out, recipe, tokenizer, corpus, log, force=args.force)
    log_file.write_text(json.dumps(log, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
