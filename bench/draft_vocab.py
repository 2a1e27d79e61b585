"""``specdec-bench-vocab``: how much a head's reduced draft vocabulary costs it, category by category.

A GRIFFIN/EAGLE/HASS head with a draft vocabulary ranks its children over the target's LM head rows of that
vocabulary alone (SmolLM2's heads: 8,192 of 49,152 ids, the tokens most frequent in their training answers), so a
token outside it is never drafted: wherever the target emits one, the cycle's path ends before it. Text that copies
names, numbers and foreign words from its prompt (summaries, RAG answers, translations) emits more of them than chat.
For each category this measures, on the target's own greedy answers: the share of answer tokens outside the draft
vocabulary and, of those, the share the prompt holds; then the head's tau (greedy, batch 1, the kind's CPU tree) with
its vocabulary as trained, with the request's own tokens joined to it as the runtime joins them (its prompt's and its
verified output's outside the vocabulary: ``runtime/decoding/joined_vocab.py``), and with the target's whole
vocabulary. The head itself is unchanged (the rows are the target's LM head's), so the gap between the three is what
the vocabulary alone costs; what remains below the other categories is the head's. PyTorch eager (no engine graphs:
acceptance does not depend on the backend); prompts as ``specdec-bench-lookup`` builds them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

VARIANTS = ("draft vocabulary", "+ the request's tokens", "whole vocabulary")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from specdec_kit.bench.lookup_bench import add_target_and_prompt_arguments

    p = argparse.ArgumentParser(
        prog="specdec-bench-vocab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_and_prompt_arguments(p)
    p.set_defaults(
        backend="torch", categories="summarization,rag,translation,qa,math_reasoning,multi_turn,code_editing"
    )
    p.add_argument("--tree", help="dynamic:TOTAL:DEPTH:TOP_K (default: the engine's, the kind's CPU tree)")
    return p.parse_args(argv)


def vocabulary_head(head, weight, ids):
    """The draft's LM head ranking over the target rows of ``ids`` (sorted, unique target ids)."""
    widened = copy.copy(head)
    widened._buffers = dict(head._buffers, ids=ids, rows=weight[ids].to(head.rows.dtype))
    return widened


def answer_coverage(prompt: list[int], answer: list[int], draft_ids: set[int]) -> tuple[int, int, int]:
    """(answer tokens, those outside the draft vocabulary, those of them the prompt holds)."""
    held = set(prompt)
    outside = [t for t in answer if t not in draft_ids]
    return len(answer), len(outside), sum(t in held for t in outside)


def measure(engine, sets: dict[str, list[list[int]]], max_new: int, tree) -> list[dict]:
    import torch

    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.decoding.generate import RequestStats, SpeculativeGenerator
    from specdec_kit.runtime.decoding.joined_vocab import joins_request_tokens

    drafter = engine.drafter_for(tree)
    head, joined = drafter.step.lm_head, drafter.joined
    if not joins_request_tokens(head) or joined is None:
        raise ValueError(
            f"{engine.draft_kind}: its head ranks over {type(head).__name__}, not the target's LM head rows of a "
            "draft vocabulary (a GRIFFIN/EAGLE/HASS head with draft_vocab_size); nothing to measure"
        )
    weight = engine.target.lm_head.weight.detach()
    draft_ids = set(head.ids.tolist())
    every_id = torch.arange(weight.shape[0], device=head.ids.device)
    plain = SpeculativeGenerator(engine.target, NoDrafter())
    spec = SpeculativeGenerator(engine.target, drafter)
    rows = []
    for category, prompts in sets.items():
        counts = [0, 0, 0]
        stats: dict[str, list] = {v: [] for v in VARIANTS}
        for prompt in prompts:
            answer = plain.generate([prompt], max_new)[0].tokens
            counts = [a + b for a, b in zip(counts, answer_coverage(prompt, answer, draft_ids))]
            vocabularies = {  # (the head, the tokens joining it)
                VARIANTS[0]: (head, None),
                VARIANTS[1]: (head, joined),
                VARIANTS[2]: (vocabulary_head(head, weight, every_id), None),
            }
            for variant, (drafter.step.lm_head, drafter.joined) in vocabularies.items():
                result = spec.generate([prompt], max_new)[0]
                if result.tokens != answer:
                    raise AssertionError(f"{category}: the {variant} draft changed the greedy output (lossless broken)")
                stats[variant].append(result.stats)
            drafter.step.lm_head, drafter.joined = head, joined
        row = {
            "category": category,
            "prompts": len(prompts),
            "answer_tokens": counts[0],
            "outside_share": counts[1] / max(counts[0], 1),
            "outside_in_prompt_share": counts[2] / max(counts[1], 1),
        }
        for variant, runs in stats.items():
            pooled = RequestStats.combined(runs)
            row[variant] = {
                "tau": pooled.acceptance_length,
                "acceptance_per_depth": [a / pooled.cycles for a in pooled.accepted_per_depth],
            }
        rows.append(row)
        print(table([row])[-1], file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    head = "| category | answer tokens | outside the draft vocabulary | of them in the prompt | " + " | ".join(
        f"tau, {v}" for v in VARIANTS
    )
    lines = [head + " |", "|---|---:|---:|---:|" + "---:|" * len(VARIANTS)]
    for r in rows:
        taus = " | ".join(f"{r[v]['tau']:.3f}" for v in VARIANTS)
        lines.append(
            f"| {r['category']} | {r['answer_tokens']} | {r['outside_share']:.1%} | {r['outside_in_prompt_share']:.0%} "
            f"| {taus} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from specdec_kit.bench.chat_target import at_tree
    from specdec_kit.bench.lookup_bench import head_engine, prompt_sets
    from specdec_kit.runtime.core.trees import parse_tree_spec
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.engine import open_engine
    from specdec_kit.runtime.loader import set_threads

    set_threads()
    if args.smoke:
        args.prompts, args.max_new_tokens = 1, 16
    engine = open_engine(head_engine(args))
    tree = parse_tree_spec(args.tree) if args.tree else engine.tree
    categories = [c for c in args.categories.split(",") if c]
    plain = SpeculativeGenerator(engine.target, NoDrafter())
    sets = prompt_sets(categories, args.prompts, engine.tokenizer, plain, args.max_new_tokens)
    rows = measure(engine, sets, args.max_new_tokens, tree)
    out = args.out or Path("bench/results/draft_vocab") / args.target
    out.mkdir(parents=True, exist_ok=True)
    head_at_tree = at_tree(args.head, tree)
    meta = {"target": args.target, "head": head_at_tree, "max_new_tokens": args.max_new_tokens}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"{head_at_tree} on {args.target} (PyTorch {torch.__version__}, float32), greedy, {args.prompts} "
        f"prompts per category, {args.max_new_tokens} new tokens; tau counts the tokens of a cycle (accepted + 1):",
        "",
        *table(rows),
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
