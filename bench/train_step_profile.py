"""``python -m specdec_kit.bench.train_step_profile smollm2-chat``: where one training step of a recipe's head spends
its time, on the recipe's own distilled data (the first shards), by phase (building the batch, the passes' forwards,
the backward, the optimizer) and by operator (PyTorch's profiler), with the head trained in float32 or under bfloat16
autocast side by side (interleaved, medians). What the trainer should do about its cost starts from this table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specdec_kit.bench.train_step_profile", description=__doc__)
    p.add_argument("recipe", help="recipe file or name (train/recipes), e.g. smollm2-chat")
    p.add_argument("--head", default="griffin", help="the recipe's head to profile (default griffin)")
    p.add_argument("--data", type=Path, help="distilled data directory (default: $SPECDEC_CACHE/data/<name>)")
    p.add_argument("--answer-tokens", type=int, default=200_000, help="load only the first shards holding this many")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant (after one warm-up step each)")
    p.add_argument("--variants", default="float32,bfloat16", help="head precision: float32, bfloat16 (autocast)")
    p.add_argument("--ops", type=int, default=15, help="operators listed from the profiler (0: none)")
    return p.parse_args(argv)


class Phases:
    """Seconds per named phase of a step."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds.setdefault(name, []).append(time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec_kit.runtime.models.pretrained import resolve_target
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.train.distilled import DistilledData, ShardSelection
    from specdec_kit.train.heads import feature_step, head_vocab, new_head
    from specdec_kit.train.methods import trainer_for
    from specdec_kit.train.recipe import RECIPES, HeadSettings, data_dir, training_data

    path = Path(args.recipe) if args.recipe.endswith(".json") else RECIPES / f"{args.recipe}.json"
    recipe = json.loads(path.read_text())
    head_settings = HeadSettings.of(args.head, recipe["heads"][args.head])
    method, budget = head_settings.method, head_settings.tokens_per_batch
    if method == "eagle3":
        print("this profile covers the EAGLE/HASS/GRIFFIN trainer; EAGLE-3 has its own", file=sys.stderr)
        return 2
    target = TargetModel.from_pretrained(resolve_target(recipe["target"]), dtype="float32", device="cpu")
    trainer = trainer_for(method)
    spec = trainer.make_spec(method, **head_settings.schedule)
    where = training_data(recipe, data_dir(recipe, args.data))
    data = DistilledData(
        where,
        trainer.distilled_layers(spec, target.num_layers),
        tokens_per_batch=budget,
        shards=ShardSelection(answer_tokens=args.answer_tokens),
    )
    from specdec_kit.train.eagle3 import draft_vocabulary

    seen = data.answer_tokens()
    vocab = draft_vocabulary(seen, target.vocab_size, spec.draft_vocab) if spec.draft_vocab else None
    variants = args.variants.split(",")
    heads = {}
    for variant in variants:
        head = new_head(method, target, spec, vocab).float()
        lm_head, to_head = head_vocab(head, target)
        params = [p for p in head.parameters() if p.requires_grad]
        heads[variant] = (head, lm_head, to_head, torch.optim.AdamW(params, lr=spec.lr))
    data.lm_rows = heads[variants[0]][1].weight.data
    phases = {v: Phases() for v in variants}
    tokens_per_step = []

    def step(variant: str, n: int) -> None:
        head, lm_head, to_head, opt = heads[variant]
        timer = phases[variant]
        autocast = replace(spec, precision=variant).autocast(torch.device("cpu"))
        with timer("batch"):
            tokens, feats, logits, masks = data.batch(n)
        tokens_per_step.append(int(masks.valid.sum()))
        with timer("forward (all passes, losses)"), autocast:
            loss, _ = feature_step(head, lm_head, spec, tokens, feats, logits, torch.Generator(), masks, to_head)
        with timer("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with timer("optimizer"):
            opt.step()

    for variant in variants:  # warm-up
        step(variant, 0)
    for variant in variants:
        phases[variant].seconds.clear()
    for n in range(1, args.steps + 1):
        for variant in variants:
            step(variant, n)
    print(
        f"{args.head} ({method}, {spec.passes} passes) on {where.name}: batches of <= {budget} tokens, "
        f"median {statistics.median(tokens_per_step):.0f} real tokens; medians of {args.steps} steps (seconds):"
    )
    names = list(phases[variants[0]].seconds)
    print(f"{'phase':<30}" + "".join(f"{v:>12}" for v in variants))
    for name in [*names, "step"]:
        row = [
            statistics.median(phases[v].seconds[name])
            if name != "step"
            else statistics.median(map(sum, zip(*phases[v].seconds.values())))
            for v in variants
        ]
        print(f"{name:<30}" + "".join(f"{x:>12.3f}" for x in row))
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        for variant in variants:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(variant, args.steps + 1)
            print(f"\n{variant}: operators by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
