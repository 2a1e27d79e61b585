"""``specdec-bench-lookup``: drafting without a head (prompt lookup, suffix trees), a head, and the two merged, against
plain decoding where copying pays and where it does not: Spec-Bench's summarization, RAG, QA, math reasoning and
translation, multi-turn chat (MT-Bench's second turns, asked after the target's own first answers) and code editing
(held-out HumanEval functions in the prompt, asked to be renamed, type-hinted or documented). Batch 1, methods
interleaved prompt by prompt, medians; every method runs on one target (the head's engine, ONNX Runtime by default).

The suffix trees keep earlier responses, as a server's do: each prompt runs once per method (a repeat would find its
own answer there), in category order. The hybrid runs under the kit's merge rule (``hybrid``: ``calibrated``, the
head's path probability against the lookup node's measured chance of acceptance) and, as methods of their own, the
alternatives it was chosen over (``hybrid-probability``: the lookup's raw share of earlier occurrences;
``hybrid-lookup-first``), and without its choice of cycles that draft the lookup's tree alone (``hybrid-merged``:
every cycle merges). ``head-own-vocab``: the head without the request's own tokens joining its reduced draft
vocabulary (``runtime/decoding/joined_vocab.py``), beside the head as the runtime drafts with it.

``ceiling.md`` says what each category leaves to gain (``copy_ceiling.py``): the share of plain decoding's answer
tokens that any lookup could copy, and the best of the methods prompt by prompt, the most a choice among them gives.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec_kit.bench.head_engine import add_draft_weights_argument, build_head_engine, effective_draft_weights

CATEGORIES = "summarization,rag,code_editing,multi_turn,qa,math_reasoning,translation"
METHODS = "plain,ngram,suffix,head,head-own-vocab,hybrid,hybrid-probability,hybrid-lookup-first,hybrid-merged"
# each hybrid method: its merge rule, whether cycles may draft the lookup's tree alone, and its label's suffix
HYBRIDS = {
    "hybrid": ("calibrated", True, ""),
    "hybrid-probability": ("probability", True, " (probability)"),
    "hybrid-lookup-first": ("lookup-first", True, " (lookup first)"),
    "hybrid-merged": ("calibrated", False, " (always merged)"),  # what choosing lookup-only cycles is worth
}
DEFAULT_METHODS = "plain,ngram,suffix,head,hybrid,hybrid-lookup-first"


def add_target_and_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """The options both lookup benchmarks share: which engine runs the target, and which prompts, how many, how long
    (``head_engine`` and ``prompt_sets`` read them)."""
    p.add_argument("--target", default="smollm2", help="smollm2 (the named chat target) or zoo (the demo zoo's target)")
    p.add_argument("--head", default="griffin", help="the head kind (its engine is built or reused)")
    p.add_argument("--categories", default=CATEGORIES)
    p.add_argument(
        "--prompts",
        type=int,
        default=8,
        help="prompts per category (8: every question Spec-Bench's categories hold out from training; a median over 5 "
        "moved by a tenth between runs)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--backend",
        default="onnxruntime",
        choices=["onnxruntime", "torch"],
        help="the head engine's backend (torch: PyTorch eager, no graph export)",
    )
    add_draft_weights_argument(p)
    p.add_argument("--engines", type=Path, default=Path("engines"))
    p.add_argument("--out", type=Path, help="default bench/results/lookup/<target>")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the tests")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specdec-bench-lookup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_and_prompt_arguments(p)
    p.add_argument("--lookup", default="suffix", choices=["ngram", "suffix"], help="the hybrid's model-free kind")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"any of {METHODS}")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--lookup-tree", help="the model-free drafts' tree, dynamic:TOTAL:DEPTH:TOP_K (default: the kind's)")
    return p.parse_args(argv)


def head_engine(args) -> Path:
    """The head's engine on the target (built by the kit's builder; an identical rebuild is reused)."""
    return build_head_engine(args.target, args.head, args.backend, args.draft_weights, args.engines)


def encode(tokenizer, messages: list[dict]) -> list[int]:
    """Through the chat template where the tokenizer has one; otherwise the turns' text, one after another."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer("\n\n".join(m["content"] for m in messages) + "\n\n")["input_ids"]


def prompt_sets(categories: list[str], n: int, tokenizer, plain, max_new: int) -> dict[str, list[list[int]]]:
    """Each category's prompts as token ids; multi-turn second turns follow the target's own greedy first answers."""
    from specdec_kit.data.prompts import code_editing, multi_turn, spec_bench_category

    sets = {}
    for category in categories:
        if category == "code_editing":
            chats = code_editing(n)
        elif category == "multi_turn":
            chats = []
            for first, second in multi_turn(n):
                ids = encode(tokenizer, [{"role": "user", "content": first}])
                answer = tokenizer.decode(plain.generate([ids], max_new)[0].tokens, skip_special_tokens=True)
                chats.append(
                    [
                        {"role": "user", "content": first},
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": second},
                    ]
                )
        else:
            chats = spec_bench_category(category, n)
        sets[category] = [encode(tokenizer, chat) for chat in chats]
    return sets


def generators(engine, methods: list[str], head_tree, lookup_kind: str, lookup_tree) -> dict:
    """One generator per method over the engine's target (each model-free draft its own, with its own shared trie)."""
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.decoding.joined_vocab import keep_draft_vocabulary
    from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter
    from specdec_kit.runtime.registry import lookup_drafter

    head = engine.draft_kind
    out = {}
    for method in methods:
        if method == "plain":
            drafter = NoDrafter()
        elif method in ("ngram", "suffix"):
            drafter = lookup_drafter(method, tree=lookup_tree)
            drafter.choices = []  # each cycle's estimate and outcome, for ``lookup_calibration``
        elif method == "head":
            method, drafter = head, engine.drafter_for(head_tree)
        elif method == "head-own-vocab":  # the head without the request's tokens joining its draft vocabulary
            method, drafter = f"{head} (own vocabulary)", engine.drafter_for(head_tree)
            if getattr(drafter, "joined", None) is None:
                raise ValueError(f"--methods head-own-vocab: {head}'s drafter joins no tokens to its vocabulary")
            keep_draft_vocabulary(drafter)
        elif method in HYBRIDS:
            rule, lookup_alone, label = HYBRIDS[method]
            lookup = lookup_drafter(lookup_kind, tree=lookup_tree)
            method = f"{head}+{lookup_kind}{label}"
            drafter = HybridDrafter(engine.drafter_for(head_tree), lookup, rule, lookup_alone)
            drafter.choices = []  # each cycle's choice, for ``hybrid_choices``
        else:
            raise ValueError(f"--methods: unknown method {method!r}; expected some of {METHODS}")
        out[method] = SpeculativeGenerator(engine.target, drafter)
    return out


def pivot(rows: list[dict], names: list[str]) -> list[str]:
    """Per category and method: the speedup over plain decoding end to end and in the decoding phase alone, and the
    acceptance length tau; one table per temperature."""
    lines = []
    for temp in sorted({r["temperature"] for r in rows}):
        sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
        lines += [
            f"T={temp:g}: speedup over plain decoding end to end / decoding alone (acceptance length tau); plain: "
            "tokens/s end to end",
            "",
        ]
        lines += ["| category | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for ps in sets:
            cells = []
            for name in names:
                r = next(r for r in rows if (r["prompt_set"], r["temperature"], r["method"]) == (ps, temp, name))
                if name == "plain":
                    cells.append(f"{r['tokens_per_s']:.1f}")
                    continue
                tau = f" ({r['acceptance_length']:.2f})" if r["acceptance_length"] else ""
                cells.append(f"{r['speedup']:.2f}x / {r['decode_speedup']:.2f}x{tau}")
            lines.append(f"| {ps} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def hybrids_against_parts(results: dict, rows: list[dict], head: str, lookup: str) -> list[dict]:
    """Each hybrid against the better of its two parts (the part with the higher median speedup in that category),
    prompt by prompt: the two ran the same prompt one after the other, so their ratio leaves out what moves every
    method together (a slower minute of the machine). The spread of those ratios is the run's noise for this
    comparison: a median below 1 with the range above 1 is no measured loss."""
    from specdec_kit.bench.speedup import median

    speedup = {(r["prompt_set"], r["temperature"], r["method"]): r["speedup"] for r in rows}
    out = []
    for (ps, temp, method), runs in results.items():
        if not method.startswith(f"{head}+{lookup}"):
            continue
        parts = [m for m in (head, lookup) if (ps, temp, m) in results]
        if not parts:
            continue
        better = max(parts, key=lambda m: speedup[(ps, temp, m)])
        part_runs = results[(ps, temp, better)]
        ratios = sorted(r["tps"] / part_runs[k]["tps"] for k, r in runs.items() if k in part_runs)
        out.append(
            {
                "prompt_set": ps,
                "temperature": temp,
                "method": method,
                "better_part": better,
                "median_ratio": median(ratios),
                "min_ratio": ratios[0],
                "max_ratio": ratios[-1],
                "prompts_faster": sum(r > 1 for r in ratios),
                "prompts": len(ratios),
            }
        )
    return out


def records_in(records: list, runs: dict) -> list:
    """The drafter's settled records made while one of ``runs`` (a row's prompts, ``measure``'s spans) ran."""
    spans = [r["span"] for r in runs.values()]
    return [c for c in records if c.seconds is not None and any(a <= c.started <= b for a, b in spans)]


def hybrid_choices(results: dict, gens: dict) -> list[dict]:
    """Per category and hybrid, its cycles grouped by whether the lookup found a proposal and which way the hybrid
    chose: how many, the tokens a second each way promised when it chose, and what the chosen cycles gave (each
    cycle's committed tokens over its seconds, from the choice to the next draft), all three means over the cycles
    (an estimate is a cycle's, so it is set against cycles' rates, not against a pooled one)."""
    from statistics import fmean

    from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter

    out = []
    for (ps, temp, method), runs in results.items():
        drafter = gens[method].drafter if method in gens else None
        records = drafter.choices if isinstance(drafter, HybridDrafter) else None
        if not records:
            continue
        mine = records_in(records, runs)
        for matched in (True, False):
            for lookup_only in (True, False):
                group = [c for c in mine if (c.matched, c.lookup_only) == (matched, lookup_only)]
                if not group:
                    continue
                lookup = [c.lookup_rate for c in group if c.lookup_rate is not None]
                merged = [c.merged_rate for c in group if c.merged_rate is not None]
                out.append(
                    {
                        "prompt_set": ps,
                        "temperature": temp,
                        "method": method,
                        "matched": matched,
                        "lookup_only": lookup_only,
                        "cycles": len(group),
                        "lookup_promised": fmean(lookup) if lookup else None,
                        "merged_promised": fmean(merged) if merged else None,
                        "given": fmean(c.tokens / c.seconds for c in group),
                    }
                )
    return out


def lookup_calibration(results: dict, gens: dict, bins: int = 4) -> list[dict]:
    """Per category and model-free method, its cycles with a proposal in ``bins`` groups by the tokens a second the
    sizing estimated for them (lowest first): how many, the mean estimate, and the mean of what they gave (each
    cycle's committed tokens over its seconds). A hybrid sets such estimates against its merged trees', so where they
    run low or high it chooses wrong."""
    from statistics import fmean

    from specdec_kit.runtime.decoding.lookup_drafting import HybridDrafter

    out = []
    for (ps, temp, method), runs in results.items():
        drafter = gens[method].drafter if method in gens else None
        if isinstance(drafter, HybridDrafter) or not getattr(drafter, "choices", None):
            continue
        mine = sorted(
            (c for c in records_in(drafter.choices, runs) if c.matched and c.seconds and c.lookup_rate),
            key=lambda c: c.lookup_rate,
        )
        for i in range(bins):
            group = mine[len(mine) * i // bins : len(mine) * (i + 1) // bins]
            if group:
                out.append(
                    {
                        "prompt_set": ps,
                        "temperature": temp,
                        "method": method,
                        "group": i + 1,
                        "cycles": len(group),
                        "promised": fmean(c.lookup_rate for c in group),
                        "given": fmean(c.tokens / c.seconds for c in group),
                    }
                )
    return out


def calibration_table(groups: list[dict], bins: int = 4) -> list[str]:
    """``lookup_calibration``'s groups as a markdown table."""
    lines = [
        f"Each model-free draft's cycles with a proposal in {bins} equal groups by the tokens a second its sizing "
        "estimated (1: the lowest estimates): the mean estimate and the mean of what the cycles gave",
        "",
        "| category | T | method | group | cycles | promised | given | given / promised |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for g in groups:
        lines.append(
            f"| {g['prompt_set']} | {g['temperature']:g} | {g['method']} | {g['group']} | {g['cycles']} | "
            f"{g['promised']:.0f} | {g['given']:.0f} | {g['given'] / g['promised']:.2f} |"
        )
    return lines


def choice_table(choices: list[dict]) -> list[str]:
    """``hybrid_choices``' groups as a markdown table."""
    rate = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    lines = [
        "Each hybrid's cycles by whether its lookup found a proposal and which way it chose: the tokens a second each "
        "way promised when it chose and what the chosen cycles gave (each cycle's tokens committed over its seconds "
        "from the choice to the next draft), means over the cycles",
        "",
        "| category | T | hybrid | lookup found | chose | cycles | lookup alone promised | merged promised | given |",
        "|---|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for c in choices:
        lines.append(
            f"| {c['prompt_set']} | {c['temperature']:g} | {c['method']} | {'yes' if c['matched'] else 'no'} | "
            f"{'lookup alone' if c['lookup_only'] else 'merged'} | {c['cycles']} | {rate(c['lookup_promised'])} | "
            f"{rate(c['merged_promised'])} | {c['given']:.0f} |"
        )
    return lines


def paired_table(paired: list[dict]) -> list[str]:
    lines = [
        "Each hybrid against the better of its parts, prompt by prompt (tokens/s end to end, the two run one after the "
        "other): median ratio [least, most], prompts where the hybrid was faster",
        "",
        "| category | T | hybrid | better part | hybrid / part | faster on |",
        "|---|---:|---|---|---:|---:|",
    ]
    for p in paired:
        lines.append(
            f"| {p['prompt_set']} | {p['temperature']:g} | {p['method']} | {p['better_part']} | "
            f"{p['median_ratio']:.2f} [{p['min_ratio']:.2f}, {p['max_ratio']:.2f}] | {p['prompts_faster']} of {p['prompts']} |"
        )
    return lines


def plot_speedups(rows: list[dict], names: list[str], out: Path) -> None:
    """Bars: speedup over plain decoding per category, one bar per method (T=0)."""
    from specdec_kit.plots import pyplot

    plt = pyplot()
    temp = min(r["temperature"] for r in rows)
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    shown = [n for n in names if n != "plain"]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(1.4 * len(sets) + 3, 4))
    width = 0.8 / len(shown)
    for j, name in enumerate(shown):
        values = [
            next(r["speedup"] for r in rows if (r["prompt_set"], r["temperature"], r["method"]) == (ps, temp, name))
            for ps in sets
        ]
        ax.bar([i + j * width for i in range(len(sets))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets, rotation=20)
    ax.set_ylabel(f"speedup over plain (T={temp:g}, batch 1)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup_by_category.png", dpi=120)
    plt.close(fig)


def run(args) -> int:
    from specdec_kit.bench.copy_ceiling import best_per_prompt, ceiling_table, copy_shares
    from specdec_kit.bench.report import write_all
    from specdec_kit.bench.speedup import machine, measure, summarize
    from specdec_kit.runtime.core.trees import parse_tree_spec
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.engine import open_engine
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.runtime.registry import draft_kind

    if args.smoke:
        args.prompts, args.max_new_tokens = 1, 8
    set_threads()
    out = args.out or Path("bench/results/lookup") / args.target
    engine = open_engine(head_engine(args))
    lookup_tree = parse_tree_spec(args.lookup_tree or draft_kind(args.lookup).default_tree)
    categories = [c for c in args.categories.split(",") if c]
    plain = SpeculativeGenerator(engine.target, NoDrafter())
    print(f"prompts: {args.prompts} per category ({', '.join(categories)})", file=sys.stderr)
    sets = prompt_sets(categories, args.prompts, engine.tokenizer, plain, args.max_new_tokens)
    gens = generators(engine, args.methods.split(","), engine.tree, args.lookup, lookup_tree)
    temps = [float(t) for t in args.temperatures.split(",")]
    results = measure(gens, sets, temps, 1, args.max_new_tokens)
    names = list(gens)
    rows = summarize(results, names)
    meta = {
        "target": args.target,
        "head": args.head,
        "head_tree": [engine.tree.total_tokens, engine.tree.depth, engine.tree.top_k],
        "draft_weights": effective_draft_weights(args.backend, args.draft_weights),
        "lookup_tree": [lookup_tree.total_tokens, lookup_tree.depth, lookup_tree.top_k],
        "batch": 1,
        "prompts_per_category": args.prompts,
        "max_new_tokens": args.max_new_tokens,
    }
    write_all(rows, out, machine(results), meta)
    table = pivot(rows, names)
    (out / "by_category.md").write_text("\n".join(table))
    plot_speedups(rows, names, out)
    paired = hybrids_against_parts(results, rows, engine.draft_kind, args.lookup)
    if paired:
        paired_lines = paired_table(paired)
        (out / "hybrid_vs_parts.json").write_text(json.dumps(paired, indent=1) + "\n")
        (out / "hybrid_vs_parts.md").write_text("\n".join(paired_lines) + "\n")
        table += ["", *paired_lines]
    shares, best = copy_shares(results, sets), best_per_prompt(rows)
    (out / "ceiling.json").write_text(json.dumps({"copyable": shares, "best_per_prompt": best}, indent=1) + "\n")
    (out / "ceiling.md").write_text("\n".join(ceiling_table(shares, best)) + "\n")
    calibration = lookup_calibration(results, gens)
    if calibration:
        (out / "lookup_calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
        (out / "lookup_calibration.md").write_text("\n".join(calibration_table(calibration)) + "\n")
    choices = hybrid_choices(results, gens)
    if choices:
        (out / "hybrid_choices.json").write_text(json.dumps(choices, indent=1) + "\n")
        (out / "hybrid_choices.md").write_text("\n".join(choice_table(choices)) + "\n")
    print("\n".join(table))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
