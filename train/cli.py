"""``specdec-train-head``: train a GRIFFIN / HASS / EAGLE / EAGLE-3 / P-EAGLE / DFlash / Medusa / MoA head for your own
target.

Data: the stdlib corpus by default, or --data (a text file, a folder of .txt/.py/.md files, or a
.jsonl with a "text" field), tokenised with the target's tokenizer. The target's hidden states are online (the
target runs in every training step) or offline with --cache-features DIR (written there once, the size printed
before anything is written, then read by every step): online fits a target that fits beside the head, offline a
target too large for that or data trained on for several epochs. Under torchrun, --target-sharding fsdp shards the
online target's decoder layers across the ranks (a target too large for one device runs in the loop all the same).
Or --distilled DIR: data whose hidden states are already there, the kit's regenerated chat data or hidden states
imported from SpecForge or speculators (python -m specdec_kit.train.foreign_features).
The head is written in its method's official layout, with a resumable training_state.pt.
EAGLE-3 (--method eagle3) reads three target layers (--feature-layers, default the reference's 2, L/2, L-3),
picks its draft vocabulary (--draft-vocab tokens, default a quarter of the target's) by token frequency in
the training data, and trains with training-time test (--ttt-length draft steps unrolled per block).
P-EAGLE (--method peagle) is an EAGLE-3 head trained to propose --ttt-length tokens from one forward: the context,
then masked slots (a learned input and --mask-token-id) at the next positions. DFlash (--method dflash) proposes a
block of --block-size - 1 tokens from one forward of its --draft-layers layers over the target's --feature-layers;
its slots guess the target's continuation, so train it on text the target wrote (a recipe's regenerated data);
with --draft-vocab it scores its block with an LM head of its own over that many tokens (speculators' way).
EAGLE, HASS and GRIFFIN heads take --draft-vocab too: the head then proposes only those tokens, scored by the
target's own LM-head rows (a cheaper draft step; the ONNX Runtime and PyTorch engines run it, the server engines'
drafters do not). For a real target's heads from self-distilled data, see ``python -m specdec_kit.train.recipe``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_kit.train.methods import methods

if TYPE_CHECKING:  # heavy modules load in the functions that use them: --help answers before torch loads
    from specdec_kit.train.corpus import Document


def read_documents(path: Path) -> list[Document]:
    from specdec_kit.train.corpus import Document

    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".py", ".md"))
        return [Document(str(p), p.read_text(errors="replace")) for p in files]
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    docs.append(Document(f"{path}:{n}", json.loads(line)["text"]))
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: expected a JSON object with a 'text' field ({exc})") from exc
        return docs
    if path.is_file():
        return [Document(str(path), path.read_text(errors="replace"))]
    raise ValueError(f"{path}: no such file or folder")


def text_data(args: argparse.Namespace, trainer, spec, target, tokenizer):
    """Token blocks of the training text (online hidden states), or the feature cache written from them
    (``--cache-features``: offline)."""
    from specdec_kit.train.corpus import load_corpus
    from specdec_kit.train.data import blocks, token_stream

    docs = read_documents(args.data) if args.data else load_corpus().train
    need = spec.steps * spec.batch * spec.seq_len
    data = blocks(token_stream(tokenizer, docs, max_tokens=need + spec.seq_len), spec.seq_len, spec.seed)
    if data.shape[0] == 0:
        raise ValueError(f"not enough text for one block of {spec.seq_len} tokens")
    if args.cache_features:  # offline: the target's hidden states written once, then read by every step
        from specdec_kit.train.features import CachedFeatures, write_cache

        taps = trainer.cache_taps(spec, target.num_layers) if trainer.cache_taps else None
        write_cache(target, data, args.cache_features, taps=taps)
        data = CachedFeatures(args.cache_features, target, taps)
    return data


def train_distilled(args: argparse.Namespace, trainer, spec, target) -> dict:
    """A head trained on distilled data (``--distilled``), with the held-out split measured where asked."""
    from specdec_kit.train.distilled import DistilledData
    from specdec_kit.train.heldout import split

    if args.data or args.cache_features:
        raise ValueError("--distilled is the training data: leave out --data and --cache-features")
    if trainer.distilled_layers is None:
        raise ValueError(
            f"--distilled: the {args.method} trainer streams its own target passes; it reads no distilled data"
        )
    layers = trainer.distilled_layers(spec, target.num_layers)
    budget = {"tokens_per_batch": spec.batch * spec.seq_len}
    heldout, for_training = None, None
    if args.eval_every:
        spec.eval_every = args.eval_every
        for_training, for_evaluation = split()
        heldout = DistilledData(args.distilled, layers, select=for_evaluation, **budget)
    data = DistilledData(args.distilled, layers, seed=spec.seed, select=for_training, **budget)
    return trainer.train(target, data, spec, args.out, base_model=str(args.target), heldout=heldout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="specdec-train-head", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--method",
        required=True,
        choices=methods(),
        help="moa: Mixture of Attentions (LSA, SA, CA, TLI; see --tli)",
    )
    p.add_argument("--tli", type=int, default=0, help="moa: how many of the target's last layers finish a draft")
    p.add_argument(
        "--target",
        type=Path,
        required=True,
        help="Hugging Face checkpoint directory of the target, or a named one (smollm2)",
    )
    p.add_argument("--out", type=Path, required=True, help="where the head (official layout) is written")
    p.add_argument("--data", type=Path, help="training text (default: the stdlib corpus)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--decay",
        type=float,
        default=0.0,
        help="the last share of the steps over which the learning rate falls linearly to zero (e.g. 0.2; default 0: "
        "constant after warm-up)",
    )
    p.add_argument("--passes", type=int, help="forward passes per batch (default: HASS/GRIFFIN 3, EAGLE 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="draft vocabulary size, the training data's most frequent tokens (eagle3: 0 is a quarter of "
        "the target's; eagle, hass, griffin, dflash: 0 is the target's whole vocabulary)",
    )
    p.add_argument(
        "--ttt-length",
        type=int,
        help="eagle3: draft steps unrolled per block (training-time test; default 7); peagle: the tokens one draft "
        "forward proposes (the root's, then masked slots; default 4)",
    )
    p.add_argument(
        "--mask-token-id",
        type=int,
        help="peagle, dflash: the token a masked slot embeds (default: the target's last vocabulary id)",
    )
    p.add_argument("--block-size", type=int, help="dflash: the root slot plus the masked slots (default 8)")
    p.add_argument("--draft-layers", type=int, help="dflash: the draft's decoder layers (default 1)")
    p.add_argument(
        "--feature-layers",
        type=lambda s: [int(i) for i in s.split(",")],
        help="eagle3, peagle, dflash: target layer ids whose entering hidden states are fused, e.g. 2,16,29",
    )
    p.add_argument(
        "--distilled",
        type=Path,
        help="train on distilled data instead of text: the kit's regenerated data (python -m "
        "specdec_kit.train.recipe) or hidden states imported from SpecForge or speculators (python -m "
        "specdec_kit.train.foreign_features); a batch holds at most --batch x --seq-len tokens of samples of similar "
        "length",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="with --distilled: hold out a fixed 2%% of its samples (by id) and measure the head's acceptance on them "
        "every this many steps, keeping the best head",
    )
    p.add_argument(
        "--cache-features",
        type=Path,
        help="offline hidden states: write the target's features (EAGLE-3: the inputs of its three layers too) here "
        "first, then train from them; without it they are online (the target runs in every step)",
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per optimizer step: --batch rows in all (the global batch, over every rank), "
        "--batch / N at a time (less memory, the same batch)",
    )
    p.add_argument(
        "--sharding",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="under torchrun (EAGLE, HASS, GRIFFIN): ddp keeps a whole copy of the head on every rank; fsdp (FSDP2) "
        "shards its weights, gradients and optimizer state across the ranks (for heads of large targets)",
    )
    p.add_argument(
        "--target-sharding",
        choices=("replicated", "fsdp"),
        default="replicated",
        help="under torchrun with online hidden states: replicated keeps the whole frozen target on every rank; fsdp "
        "shards its decoder layers across the ranks (FSDP2, one layer gathered at a time), for a target too large to "
        "sit whole beside the head. Either way each rank runs its share of a batch's rows through it",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="minutes of training at most (0: none): the first step that begins past them is the last, measured "
        "and saved like a planned one; a rerun goes on from it",
    )
    p.add_argument(
        "--init-from",
        default="",
        help="a saved head of --method (official layout, e.g. a zoo head) to start from instead of a new one: its "
        "weights and draft vocabulary (--draft-vocab must match its size); to continue a head on more data or "
        "fine-tune it on your own. With --eval-every it is measured before the first step and kept unless beaten",
    )
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    from specdec_kit.runtime.loader import load_tokenizer, set_threads
    from specdec_kit.runtime.models.target import TargetLoadError, TargetModel
    from specdec_kit.train.methods import trainer_for

    set_threads()
    try:
        from specdec_kit.runtime.models.pretrained import resolve_target

        args.target = resolve_target(args.target)
        target = TargetModel.from_pretrained(args.target, dtype="float32", device=args.device)
        tokenizer = load_tokenizer(args.target)
        schedule = "steps batch seq_len lr decay seed accumulate time_limit sharding target_sharding init_from".split()
        overrides = {name: getattr(args, name) for name in schedule}
        trainer = trainer_for(args.method)
        if args.cache_features and trainer.cached_features:
            raise ValueError(f"--cache-features: {trainer.cached_features}")
        if args.cache_features and args.target_sharding != "replicated":
            raise ValueError(
                "--target-sharding fsdp shards the target that runs in every step (online hidden states); with "
                "--cache-features it runs once before training, on one process"
            )
        options = {name: getattr(args, name) for name in trainer.options if getattr(args, name) is not None}
        spec = trainer.make_spec(args.method, **overrides, **options)
        if args.distilled:
            result = train_distilled(args, trainer, spec, target)
        else:
            result = trainer.train(
                target, text_data(args, trainer, spec, target, tokenizer), spec, args.out, base_model=str(args.target)
            )
    except (TargetLoadError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "rank" not in result:  # under torchrun, rank 0 reports
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
