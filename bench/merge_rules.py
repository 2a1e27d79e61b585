"""``python -m specdec_kit.bench.merge_rules``: how a hybrid's merge rule ranks its two kinds of node, apart from any
machine's timing. On held-out prompts of the chat benchmark's sets (past the ones it measures, the prompts its tree
search calibrates on), the head alone and the hybrid under each rule decode greedily with every cycle merged (which
part drafts a cycle is the hybrid's choice from measured times; this compares the merged trees themselves), the
outputs checked identical: acceptance length and first-draft acceptance per set.

And the calibration a rule leans on: of the nodes each part put into merged trees under the kit's rule, the share
verification accepted, by score (the head's path probability, the lookup's chance as its sizing measured it). Ranking
the two against each other is only as good as both scores are calibrated.

Writes merge_rules.json and merge_rules.md to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_kit.bench.chat_target import DEFAULT_TREES, parse_trees
from specdec_kit.bench.head_engine import add_draft_weights_argument, build_head_engine, effective_draft_weights

if TYPE_CHECKING:  # the runtime (torch) loads when a run starts, so that --help answers at once
    from specdec_kit.runtime.core.lookup import Proposal

RULES = "calibrated,probability,lookup-first"
KIT_RULE = "calibrated"
BINS = 10  # score bins of the calibration table, 0.1 wide


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.bench.merge_rules",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="smollm2", help="smollm2 (the named chat target) or zoo (the demo zoo's target)")
    p.add_argument("--head", default="griffin", help="the head kind (its engine is built or reused)")
    p.add_argument("--lookup", default="suffix", choices=["ngram", "suffix"], help="the hybrid's model-free kind")
    p.add_argument("--rules", default=RULES, help=f"merge rules to compare, any of {RULES}")
    p.add_argument("--sets", default="humaneval,spec_bench,chat", help="the chat benchmark's prompt sets")
    p.add_argument("--prompts", type=int, default=6, help="prompts per set, past the measured ones")
    p.add_argument("--past", type=int, default=8, help="the prompts per set the chat benchmark measures (skipped)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch"])
    add_draft_weights_argument(p)
    p.add_argument("--engines", type=Path, default=Path("engines"))
    p.add_argument("--out", type=Path, default=Path("bench/results/smollm2/merge_rules"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the tests")
    return p.parse_args(argv)


def every_cycle_merged(head, lookup, rule: str):
    """A hybrid that merges every cycle and counts, per score bin, the nodes each part placed in its merged trees and
    how many of them verification accepted (``counts[part][bin] = [placed, accepted]``)."""
    from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter, verified_part
    from specdec_kit.runtime.decoding.proposal_sizing import walk

    class EveryCycleMerged(HybridDrafter):
        def __init__(self):
            super().__init__(head, lookup, rule)
            self.counts = {part: [[0, 0] for _ in range(BINS)] for part in ("head", "lookup")}
            self.placed: list[tuple[Proposal, Proposal]] | None = None

        def lookup_suffices(self, found) -> bool:
            return False

        def reset(self, batch: int, capacity: int) -> None:
            super().reset(batch, capacity)
            self.placed = None

        def merge(self, heads, ranked, nodes):
            trees = super().merge(heads, ranked, nodes)
            self.placed = [(verified_part(h, t), verified_part(r, t)) for h, r, t in zip(heads, ranked, trees)]
            return trees

        def draft(self, features, tokens, counts):
            if self.placed is not None:  # the tokens after the last merged tree: its verdict
                for (head_part, lookup_part), toks, n in zip(self.placed, tokens.tolist(), counts.tolist()):
                    for part, proposal in (("head", head_part), ("lookup", lookup_part)):
                        accepted = walk(proposal, toks[: n - 1])[0]
                        for i, score in enumerate(proposal.scores):
                            cell = self.counts[part][min(BINS - 1, int(score * BINS))]
                            cell[0] += 1
                            cell[1] += i in accepted
                self.placed = None
            return super().draft(features, tokens, counts)

    return EveryCycleMerged()


def held_out_prompts(tokenizer, sets: list[str], past: int, count: int) -> dict[str, list[list[int]]]:
    """Each set's ``count`` prompts after the ``past`` the chat benchmark measures, as token ids."""
    from specdec_kit.bench.chat_target import calibration_messages
    from specdec_kit.bench.lookup_bench import encode

    return {name: [encode(tokenizer, m) for m in calibration_messages([name], past, count)] for name in sets}


def decode(generator, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], dict]:
    """Greedy outputs and the acceptance they had: tau and the share of cycles accepting the first draft (every
    cycle drafts here)."""
    from specdec_kit.runtime.decoding.generate import RequestStats

    results = [generator.generate([ids], max_new)[0] for ids in prompts]
    st = RequestStats.combined([r.stats for r in results])
    first = st.accepted_per_depth[0] if st.accepted_per_depth else 0
    return [r.tokens for r in results], {
        "tau": st.acceptance_length,
        "first": first / max(st.cycles, 1),
        "cycles": st.cycles,
    }


def run(args) -> dict:
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.decoding.lookup_drafting import MERGE_RULES
    from specdec_kit.runtime.engine import open_engine
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.runtime.registry import lookup_drafter

    rules = [r for r in args.rules.split(",") if r]
    unknown = sorted(set(rules) - set(MERGE_RULES))
    if unknown:
        raise SystemExit(f"--rules: unknown merge rules {unknown}; expected some of {list(MERGE_RULES)}")
    if args.smoke:
        args.prompts, args.max_new_tokens = 1, 8
    set_threads()
    trees = parse_trees(DEFAULT_TREES)
    weights = effective_draft_weights(args.backend, args.draft_weights)
    # the chat benchmark's candidate trees: the same engine as its tree search, reused
    engine = open_engine(build_head_engine(args.target, args.head, args.backend, weights, args.engines, trees))
    prompts = held_out_prompts(engine.tokenizer, args.sets.split(","), args.past, args.prompts)
    hybrid = f"{args.head}+{args.lookup}"
    rows, calibration = [], None
    for name, ids in prompts.items():
        print(f"{name}: {len(ids)} prompts", file=sys.stderr)
        reference, stats = decode(SpeculativeGenerator(engine.target, engine.drafter), ids, args.max_new_tokens)
        rows.append({"set": name, "method": args.head, **stats})
        for rule in rules:
            drafter = every_cycle_merged(engine.drafter_for(engine.tree), lookup_drafter(args.lookup), rule)
            outputs, stats = decode(SpeculativeGenerator(engine.target, drafter), ids, args.max_new_tokens)
            if outputs != reference:
                raise SystemExit(f"{name}: {hybrid} ({rule}) changed the greedy output")
            rows.append({"set": name, "method": f"{hybrid} ({rule})", "rule": rule, **stats})
            if rule == KIT_RULE:
                calibration = add_counts(calibration, drafter.counts)
    result = {
        "target": args.target,
        "head": args.head,
        "lookup": args.lookup,
        "tree": [engine.tree.total_tokens, engine.tree.depth, engine.tree.top_k],
        "prompts_per_set": args.prompts,
        "past_measured": args.past,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
        "calibration_rule": KIT_RULE,
        "calibration": calibration,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "merge_rules.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "merge_rules.md").write_text("\n".join(tables(result)) + "\n")
    return result


def add_counts(total: dict | None, counts: dict) -> dict:
    if total is None:
        return {part: [list(cell) for cell in cells] for part, cells in counts.items()}
    for part, cells in counts.items():
        for into, cell in zip(total[part], cells):
            into[0] += cell[0]
            into[1] += cell[1]
    return total


def tables(result: dict) -> list[str]:
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    sets = list(dict.fromkeys(r["set"] for r in result["rows"]))
    by = {(r["set"], r["method"]): r for r in result["rows"]}
    lines = [
        f"Every cycle merged, greedy, tree {tuple(result['tree'])}: acceptance length tau (first-draft acceptance per "
        f"cycle) on {result['prompts_per_set']} held-out prompts a set (past the {result['past_measured']} the chat "
        f"benchmark measures), {result['max_new_tokens']} new tokens; outputs identical in every column",
        "",
        "| set | " + " | ".join(methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for name in sets:
        cells = [f"{by[(name, m)]['tau']:.2f} ({by[(name, m)]['first']:.2f})" for m in methods]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if result["calibration"]:
        lines += [
            "",
            f"Nodes placed in merged trees under `{result['calibration_rule']}`, by score: the share verification "
            "accepted (nodes)",
            "",
            "| score | head's path probability | lookup's calibrated chance |",
            "|---|---:|---:|",
        ]
        head, lookup = result["calibration"]["head"], result["calibration"]["lookup"]
        for b, (h, lk) in enumerate(zip(head, lookup)):
            cells = [f"{c[1] / c[0]:.2f} ({c[0]})" if c[0] else "-" for c in (h, lk)]
            lines.append(f"| {b / BINS:.1f}-{(b + 1) / BINS:.1f} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    print("\n".join(tables(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
