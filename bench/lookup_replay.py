"""``python -m specdec_kit.bench.lookup_replay``: what drafting without a head can reach on a task, apart from any
machine's timing. The target writes its greedy answers once; each model-free kind's proposals are then replayed over
them at several node budgets, each cycle accepting the longest path of its proposal that the answer continues (as
greedy verification would) and the next token. The acceptance length tau per budget is copying's ceiling there: with
what the target costs to verify that many tokens (``specdec-verify-cost``, or the cycle times of
``specdec-bench-lookup``), it bounds what any sizing of the proposals can gain. Each kind keeps its shared state
(suffix trees: earlier responses) over a category's prompts, as a server's drafter would.

Writes replay.json, replay.md and replay.png (tau against budget per category and kind) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # the runtime (torch) loads when a replay runs, so that --help answers at once
    from specdec_kit.runtime.core.lookup import Budget
    from specdec_kit.runtime.decoding.lookup_drafting import LookupSource

KINDS = "ngram,suffix"
BUDGETS = "1,2,4,8,16,24"


def replay(source: LookupSource, prompt: Sequence[int], answer: Sequence[int], budget: Budget) -> tuple[int, int]:
    """(tokens, cycles) of drafting ``answer`` after ``prompt`` with ``source`` under ``budget``: the answer's first
    token comes from the prefill, as in decoding, and every cycle after it gains its accepted path and one token."""
    from specdec_kit.runtime.decoding.proposal_sizing import walk

    row = source.open()
    source.extend(row, list(prompt))
    source.prompt_read(row)
    source.extend(row, list(answer[:1]))
    first = at = min(1, len(answer))
    cycles = 0
    while at < len(answer):
        accepted = len(walk(source.propose(row, budget), answer[at:])[0])
        gained = min(accepted + 1, len(answer) - at)
        source.extend(row, list(answer[at : at + gained]))
        at, cycles = at + gained, cycles + 1
    source.finish(row)
    return len(answer) - first, cycles


def category_taus(
    kind: str, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], budgets: Sequence[int]
) -> dict[int, float]:
    """tau per node budget of ``kind`` (its default settings and tree depth) over one category's answers."""
    from specdec_kit.runtime.core.lookup import Budget
    from specdec_kit.runtime.core.trees import parse_tree_spec
    from specdec_kit.runtime.decoding.lookup_drafting import lookup_budget, source_for
    from specdec_kit.runtime.registry import default_settings, draft_kind

    tree = lookup_budget(parse_tree_spec(draft_kind(kind).default_tree))
    out = {}
    for nodes in budgets:
        source = source_for(default_settings(kind))  # fresh shared state per budget: each replays the same order
        tokens = cycles = 0
        for prompt, answer in zip(prompts, answers):
            t, c = replay(source, prompt, answer, Budget(nodes, tree.depth, tree.branches))
            tokens, cycles = tokens + t, cycles + c
        out[nodes] = tokens / cycles if cycles else 1.0
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from specdec_kit.bench.lookup_bench import add_target_and_prompt_arguments

    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.bench.lookup_replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_and_prompt_arguments(p)
    p.add_argument("--kinds", default=KINDS, help=f"model-free kinds to replay, any of {KINDS}")
    p.add_argument("--budgets", default=BUDGETS, help="node budgets (draft tokens per cycle at most)")
    return p.parse_args(argv)


def table(taus: dict, budgets: Sequence[int]) -> list[str]:
    lines = [
        "Acceptance length tau of model-free proposals replayed on the target's greedy answers, by node budget (the",
        "most draft tokens a cycle verifies)",
        "",
        "| category | kind | " + " | ".join(f"tau at {b}" for b in budgets) + " |",
        "|---|---|" + "---:|" * len(budgets),
    ]
    for category, kinds in taus.items():
        for kind, by_budget in kinds.items():
            lines.append(f"| {category} | {kind} | " + " | ".join(f"{by_budget[b]:.2f}" for b in budgets) + " |")
    return lines


def plot(taus: dict, budgets: Sequence[int], path: Path) -> None:
    from specdec_kit.plots import legend_below, pyplot, save_figure

    plt = pyplot()
    kinds = sorted({k for by_kind in taus.values() for k in by_kind})
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for category, by_kind in taus.items():
            ax.plot(budgets, [by_kind[kind][b] for b in budgets], marker="o", label=category)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(budgets), [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("node budget (draft tokens per cycle)")
        ax.set_ylabel("tau")
        ax.set_title(kind)
        ax.grid(alpha=0.3)
    legend_below(fig, axes[0][0])
    save_figure(fig, path, tight=False)
    plt.close(fig)


def run(args) -> int:
    from specdec_kit.bench.lookup_bench import head_engine, prompt_sets
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.engine import open_engine
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.runtime.registry import lookup_kinds

    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(lookup_kinds()))
    if unknown:
        raise SystemExit(f"--kinds: {unknown} are not model-free kinds; expected some of {sorted(lookup_kinds())}")
    try:
        budgets = sorted({int(b) for b in args.budgets.split(",") if b})
    except ValueError:
        raise SystemExit(f"--budgets: expected whole numbers separated by commas, got {args.budgets!r}") from None
    if not budgets or budgets[0] < 1:
        raise SystemExit(f"--budgets: expected node budgets of at least 1, got {args.budgets!r}")
    if args.smoke:
        args.prompts, args.max_new_tokens = 1, 8
    set_threads()
    out = args.out or Path("bench/results/lookup") / args.target
    engine = open_engine(head_engine(args))
    plain = SpeculativeGenerator(engine.target, NoDrafter())
    categories = [c for c in args.categories.split(",") if c]
    sets = prompt_sets(categories, args.prompts, engine.tokenizer, plain, args.max_new_tokens)
    taus: dict[str, dict[str, dict[int, float]]] = {}
    for category in categories:
        prompts = sets[category]
        answers = [plain.generate([p], args.max_new_tokens)[0].tokens for p in prompts]
        taus[category] = {kind: category_taus(kind, prompts, answers, budgets) for kind in kinds}
        print(
            f"{category}: " + "; ".join(f"{k} {v[budgets[-1]]:.2f}" for k, v in taus[category].items()), file=sys.stderr
        )
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": args.target, "prompts_per_category": args.prompts, "max_new_tokens": args.max_new_tokens}
    (out / "replay.json").write_text(json.dumps({"meta": meta, "budgets": budgets, "tau": taus}, indent=1) + "\n")
    lines = table(taus, budgets)
    (out / "replay.md").write_text("\n".join(lines) + "\n")
    plot(taus, budgets, out / "replay.png")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
