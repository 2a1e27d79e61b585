"""``python -m specdec_kit.train.heldout_report RECIPE``: saved heads measured on the recipe's held-out conversations.

The trainers measure held-out acceptance while they train; this measures heads already saved (the committed ones, or
heads trained before the count changed) on the same held-out split of the recipe's data: greedy chains of 3 drafts
from the target's stored features, counted per decoding cycle as the benchmark counts (``train/heldout.py``: the
runtime's own greedy decoding of those prompts gives the same counts) and, beside it, per answer position. Writes
``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FEATURE_DRAFTS = ("eagle", "eagle2", "hass", "griffin")  # one-layer drafts of the final hidden state
MEASURED = (*FEATURE_DRAFTS, "eagle3", "peagle", "dflash")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.train.heldout_report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "recipe",
        type=Path,
        help="a recipe (train/recipes/NAME.json, or a recipe file): its target, data, held-out split",
    )
    p.add_argument(
        "--heads",
        default="griffin,eagle3",
        help=f"the recipe's heads to measure (of {', '.join(MEASURED)}), comma-separated; an entry LABEL=NAME@DIR "
        "measures the head in DIR (trained elsewhere, e.g. on part of the data) with the recipe's NAME settings and "
        "reports it as LABEL",
    )
    p.add_argument("--heads-dir", type=Path, default=None, help="where the heads are (default: the recipe's out)")
    p.add_argument("--data", type=Path, default=None, help="the recipe's data folder (default: the kit's cache)")
    p.add_argument("--depth", type=int, default=3, help="drafts per chain")
    p.add_argument("--max-new-tokens", type=int, default=None, help="decode no further into an answer (default: all)")
    p.add_argument("--out", type=Path, default=None, help="write the measurements here (JSON)")
    return p.parse_args(argv)


def head_entry(entry: str, heads_dir: Path) -> tuple[str, str, Path]:
    """``NAME`` or ``LABEL=NAME@DIR`` -> (label, the recipe's head name, the head's folder)."""
    label, rest = entry.split("=", 1) if "=" in entry else (entry, entry)
    name, folder = rest.split("@", 1) if "@" in rest else (rest, str(heads_dir / rest))
    return label, name, Path(folder).expanduser()


def measure_head(kind: str, folder: Path, target, recipe: dict, data: Path, layers: list[int], settings, args):
    """A saved head's ``ChainCounts`` on the recipe's held-out samples of ``data`` (those its trainer measures)."""
    from specdec_kit.runtime.loader import load_draft_for
    from specdec_kit.train.heldout import feature_draft_acceptance
    from specdec_kit.train.recipe import heldout_split

    _, heldout = heldout_split(recipe, data, layers, settings)
    draft = load_draft_for(target, kind, folder).float().eval()
    if kind in ("eagle3", "peagle"):
        from specdec_kit.train.eagle3 import draft_vocab_rows, eagle3_acceptance

        heldout.lm_rows = draft_vocab_rows(target, draft)
        return eagle3_acceptance(draft, heldout, args.depth, args.max_new_tokens)
    if kind == "dflash":
        from specdec_kit.train.dflash import dflash_acceptance

        heldout.lm_rows = target.lm_head.weight.data[:1]  # not read: the target's top tokens are the answers
        return dflash_acceptance(draft, target.embed_tokens, target.lm_head, heldout, args.depth, args.max_new_tokens)
    from specdec_kit.train.heads import head_vocab

    lm_head, to_head = head_vocab(draft, target)
    heldout.lm_rows = lm_head.weight.data
    return feature_draft_acceptance(draft, kind, lm_head, to_head, heldout, args.depth, args.max_new_tokens)


def run(args: argparse.Namespace) -> int:
    import torch

    from specdec_kit.runtime.models.pretrained import resolve_target
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.train.methods import trainer_for
    from specdec_kit.train.recipe import RECIPES, HeadSettings, data_dir, data_fingerprint, training_data

    recipe_file = args.recipe if args.recipe.suffix == ".json" else RECIPES / f"{args.recipe}.json"
    if not recipe_file.is_file():
        raise SystemExit(f"{recipe_file}: no such recipe (the kit's: {sorted(q.stem for q in RECIPES.glob('*.json'))})")
    recipe = json.loads(recipe_file.read_text())
    data = training_data(recipe, data_dir(recipe, args.data))
    heads_dir = args.heads_dir or Path(recipe["out"])
    target = TargetModel.from_pretrained(resolve_target(recipe["target"]), dtype="float32", device="cpu")
    rows = {}
    for entry in [h for h in args.heads.split(",") if h]:
        label, name, folder = head_entry(entry, heads_dir)
        if name not in recipe["heads"]:
            raise SystemExit(f"{recipe_file}: no head {name!r}; it has {sorted(recipe['heads'])}")
        settings = HeadSettings.of(name, recipe["heads"][name])
        if settings.method not in MEASURED:
            raise SystemExit(f"{name}: a {settings.method} head is measured while it trains; this measures {MEASURED}")
        trainer = trainer_for(settings.method)
        layers = trainer.distilled_layers(trainer.make_spec(settings.method, **settings.schedule), target.num_layers)
        with torch.no_grad():
            counts = measure_head(settings.method, folder, target, recipe, data, layers, settings, args)
        per_cycle, per_position = counts.per_cycle(), counts.per_position()
        rows[label] = {
            "acceptance": [round(a, 4) for a in per_cycle],
            "tau": round(1 + sum(per_cycle), 4),
            "cycles": counts.cycles,
            "per_position": [round(a, 4) for a in per_position],
            "tau_per_position": round(1 + sum(per_position), 4),
            "positions": counts.positions,
            **({"folder": str(folder)} if folder != heads_dir / name else {}),
        }
        print(
            f"{label}: tau {rows[label]['tau']:.3f} per cycle ({counts.cycles} cycles, acceptance "
            f"{' '.join(f'{a:.3f}' for a in per_cycle)}); {rows[label]['tau_per_position']:.3f} per position "
            f"({counts.positions} positions, {' '.join(f'{a:.3f}' for a in per_position)})"
        )
    result = {
        "recipe": recipe_file.stem,
        "data_fingerprint": data_fingerprint(data),
        "heads_dir": str(heads_dir),
        "depth": args.depth,
        "max_new_tokens": args.max_new_tokens,
        "heads": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
