"""``python -m specdec_kit.bench.lookup_replay``: what drafting without a head can reach on a task, apart from any
machine's timing. The target writes its greedy answers once; each model-free kind's proposals are then replayed over
them at several node budgets, each cycle accepting the longest path of its proposal that the answer continues (as
greedy verification would) and the next token. The acceptance length tau per budget is copying's ceiling there: with
what the target costs to verify that many tokens (``specdec-verify-cost``, or the cycle times of
``specdec-bench-lookup``), it bounds what any sizing of the proposals can gain. Each kind keeps its shared state
(suffix trees: earlier responses) over a category's prompts, as a server's drafter would.

How close the kit's sizing comes to that ceiling, apart from timing too: with a cycle's cost as a line in its tree's
width (``--cost-line``: in plain decoding steps, as ``specdec-verify-cost`` measures them), each kind is replayed
again with each fixed budget, with the sizing the drafter runs (``proposal_sizing.py``: its calibration learning from
the replayed verdicts, its cost line given) and with an oracle that verifies exactly the nodes the answer accepts
(no sizing does better): the decoding phase's simulated speedup over plain decoding for each.

Writes replay.json, replay.md and replay.png (tau against budget per category and kind) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # the runtime (torch) loads when a replay runs, so that --help answers at once
    from specdec_kit.runtime.core.lookup import Budget, Proposal
    from specdec_kit.runtime.decoding.lookup_drafting import LookupSource

KINDS = "ngram,suffix"
BUDGETS = "1,2,4,8,16,24"
# a cycle verifying w tokens costs 1.08 + 0.033 (w - 1) plain steps: the line through SmolLM2's verification cost at
# 1024 tokens of context with the kit's MatMul, N = 1 to 16 (bench/results/smollm2/verify_cost/matmul-context-1024:
# t(N)/t(1) 1.06 / 1.09 / 1.14 / 1.18 / 1.36 / 1.51 at N = 2 / 4 / 6 / 8 / 12 / 16), and 8% more for a cycle's own
# work beside the target's step (the proposal, the tree, the acceptance: about 1 ms of a 12-16 ms step)
COST_LINE = "1.08,0.033"


class Cut:
    """Which of a proposal's nodes a replayed cycle verifies (the whole proposal: the budget alone bounds it)."""

    def keep(self, proposal: Proposal, answer: Sequence[int]) -> Proposal:
        return proposal

    def read(self, tokens: Sequence[int]) -> None:
        """The cycle gained ``tokens`` (its accepted path, then the next token)."""


class FixedCut(Cut):
    """The proposal's best ``nodes`` nodes (best first: a smaller budget's proposal)."""

    def __init__(self, nodes: int):
        self.nodes = nodes

    def keep(self, proposal: Proposal, answer: Sequence[int]) -> Proposal:
        from specdec_kit.runtime.decoding.proposal_sizing import prefix

        return prefix(proposal, self.nodes)


class OracleCut(Cut):
    """Exactly the nodes the answer accepts: what no sizing can beat."""

    def keep(self, proposal: Proposal, answer: Sequence[int]) -> Proposal:
        from specdec_kit.runtime.decoding.proposal_sizing import walk

        return proposal.subset(sorted(walk(proposal, answer)[0]))


class SizingCut(Cut):
    """The drafter's own sizing (its calibration learning from each replayed verdict), over a given cost line."""

    def __init__(self, intercept: float, slope: float):
        from specdec_kit.runtime.decoding.proposal_sizing import ProposalSizing

        self.sizing = ProposalSizing()
        for width in list(range(1, 26)) * 3:  # the cycles its cost line is fit to, as if measured (its window's last)
            self.sizing.cost.observe(1, width, intercept + slope * (width - 1))
        self.last_accepted = 0

    def keep(self, proposal: Proposal, answer: Sequence[int]) -> Proposal:
        proposal.last_accepted = self.last_accepted
        kept = self.sizing.cut([proposal])[0]
        self.sizing.begin([kept], None)  # no start time: the cost line stays the one given
        return kept

    def read(self, tokens: Sequence[int]) -> None:
        self.sizing.settle([list(tokens)], 0.0)
        self.last_accepted = len(tokens) - 1


def replay_cycles(
    source: LookupSource, prompt: Sequence[int], answer: Sequence[int], budget: Budget, cut: Cut | None = None
) -> list[tuple[int, int]]:
    """(tokens verified, tokens gained) of each cycle drafting ``answer`` after ``prompt`` with ``source`` under
    ``budget``, ``cut`` choosing the nodes verified: the answer's first token comes from the prefill, as in decoding,
    and every cycle after it gains its accepted path and one token."""
    from specdec_kit.runtime.decoding.proposal_sizing import walk

    cut = cut or Cut()
    row = source.open()
    source.extend(row, list(prompt))
    source.prompt_read(row)
    source.extend(row, list(answer[:1]))
    at = min(1, len(answer))
    cycles = []
    while at < len(answer):
        verified = cut.keep(source.propose(row, budget), answer[at:])
        gained = min(len(walk(verified, answer[at:])[0]) + 1, len(answer) - at)
        cut.read(answer[at : at + gained])
        source.extend(row, list(answer[at : at + gained]))
        at += gained
        cycles.append((1 + len(verified), gained))
    source.finish(row)
    return cycles


def replay(source: LookupSource, prompt: Sequence[int], answer: Sequence[int], budget: Budget) -> tuple[int, int]:
    """(tokens, cycles) of drafting ``answer`` after ``prompt`` with ``source`` under ``budget`` (``replay_cycles``)."""
    cycles = replay_cycles(source, prompt, answer, budget)
    return sum(gained for _, gained in cycles), len(cycles)


def simulated_speedup(
    kind: str,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    cut: Callable[[], Cut],
    cost_line: tuple[float, float],
) -> float:
    """The decoding phase's speedup over plain decoding (one plain step a token) of ``kind``'s proposals over one
    category's answers, each cycle costing ``intercept + slope * (width - 1)`` plain steps; one ``cut()`` (its
    learned state) and one shared state of the kind over the category, as a server's drafter keeps them."""
    from specdec_kit.runtime.core.trees import parse_tree_spec
    from specdec_kit.runtime.decoding.lookup_drafting import lookup_budget, source_for
    from specdec_kit.runtime.registry import default_settings, draft_kind

    budget = lookup_budget(parse_tree_spec(draft_kind(kind).default_tree))
    source, chosen = source_for(default_settings(kind)), cut()
    intercept, slope = cost_line
    tokens = steps = 0.0
    for prompt, answer in zip(prompts, answers):
        for width, gained in replay_cycles(source, prompt, answer, budget, chosen):
            tokens, steps = tokens + gained, steps + intercept + slope * (width - 1)
    return tokens / steps if steps else 1.0


def category_speedups(
    kind: str,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    budgets: Sequence[int],
    cost_line: tuple[float, float],
) -> dict[str, float]:
    """Simulated speedups of ``kind`` on one category: per fixed budget (``"4"``), with the drafter's sizing and with
    the oracle."""
    out = {
        str(nodes): simulated_speedup(kind, prompts, answers, lambda n=nodes: FixedCut(n), cost_line)
        for nodes in budgets
    }
    out["sizing"] = simulated_speedup(kind, prompts, answers, lambda: SizingCut(*cost_line), cost_line)
    out["oracle"] = simulated_speedup(kind, prompts, answers, OracleCut, cost_line)
    return out


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
    p.add_argument(
        "--cost-line",
        default=COST_LINE,
        help="INTERCEPT,SLOPE: a cycle verifying w tokens costs INTERCEPT + SLOPE * (w - 1) plain decoding steps, for "
        "the simulated speedups (default: SmolLM2 at 1024 tokens of context with the kit's MatMul, from "
        "specdec-verify-cost, and 8%% for the cycle's own work)",
    )
    return p.parse_args(argv)


def cost_line(text: str) -> tuple[float, float]:
    """``--cost-line`` as (intercept, slope), each checked."""
    try:
        intercept, slope = (float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--cost-line: expected INTERCEPT,SLOPE (e.g. {COST_LINE}), got {text!r}") from None
    if intercept <= 0 or slope < 0:
        raise SystemExit(f"--cost-line: expected a positive intercept and a slope of at least 0, got {text!r}")
    return intercept, slope


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


def speedup_table(speedups: dict, budgets: Sequence[int], line: tuple[float, float]) -> list[str]:
    lines = [
        "Simulated decoding-phase speedup over plain decoding of the same replays, a cycle verifying w tokens costing "
        f"{line[0]:g} + {line[1]:g} (w - 1) plain steps:",
        "each fixed budget's best, the drafter's sizing (learning as it drafts), and the oracle that verifies exactly "
        "the nodes accepted",
        "",
        "| category | kind | " + " | ".join(f"budget {b}" for b in budgets) + " | sizing | oracle |",
        "|---|---|" + "---:|" * (len(budgets) + 2),
    ]
    for category, kinds in speedups.items():
        for kind, by_cut in kinds.items():
            best = max((str(b) for b in budgets), key=lambda b: by_cut[b])
            cells = [f"**{by_cut[str(b)]:.2f}**" if str(b) == best else f"{by_cut[str(b)]:.2f}" for b in budgets]
            lines.append(
                f"| {category} | {kind} | "
                + " | ".join(cells)
                + f" | {by_cut['sizing']:.2f} | {by_cut['oracle']:.2f} |"
            )
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
    line = cost_line(args.cost_line)
    if args.smoke:
        args.prompts, args.max_new_tokens = 1, 8
    set_threads()
    out = args.out or Path("bench/results/lookup") / args.target
    engine = open_engine(head_engine(args))
    plain = SpeculativeGenerator(engine.target, NoDrafter())
    categories = [c for c in args.categories.split(",") if c]
    sets = prompt_sets(categories, args.prompts, engine.tokenizer, plain, args.max_new_tokens)
    taus: dict[str, dict[str, dict[int, float]]] = {}
    speedups: dict[str, dict[str, dict[str, float]]] = {}
    for category in categories:
        prompts = sets[category]
        answers = [plain.generate([p], args.max_new_tokens)[0].tokens for p in prompts]
        taus[category] = {kind: category_taus(kind, prompts, answers, budgets) for kind in kinds}
        speedups[category] = {kind: category_speedups(kind, prompts, answers, budgets, line) for kind in kinds}
        print(
            f"{category}: " + "; ".join(f"{k} {v[budgets[-1]]:.2f}" for k, v in taus[category].items()), file=sys.stderr
        )
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "target": args.target,
        "prompts_per_category": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "cost_line": list(line),
    }
    result = {"meta": meta, "budgets": budgets, "tau": taus, "simulated_speedup": speedups}
    (out / "replay.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = table(taus, budgets) + [""] + speedup_table(speedups, budgets, line)
    (out / "replay.md").write_text("\n".join(lines) + "\n")
    plot(taus, budgets, out / "replay.png")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
