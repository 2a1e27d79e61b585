"""``specdec-bench-chat``: the speedup benchmark on a real chat target (SmolLM2-135M-Instruct by default) through its
ONNX Runtime engines, batch 1: plain decoding against each of the kit's heads (GRIFFIN, EAGLE-3) on HumanEval,
Spec-Bench and MT-Bench (chat) prompts held out of the heads' training, sent through the target's chat template, at
T=0 and T=0.7. Methods alternate prompt by prompt, and the sets and temperatures take turns prompt by prompt too
(each row meets the shared machine's memory-bandwidth states alike); medians over prompts and repeats.

The tree is chosen first, from measured costs: on calibration prompts (held-out prompts of the benchmark's own sets
that it does not measure, each set's after its first ``--prompts``: no head trains on them, and they ask what the
measured ones ask; the recipe's held-out prompts, close to its training prompts, had GRIFFIN at tau 3.0 against
2.0-2.3 on the measured sets, which favours larger trees), each head decodes greedily with each candidate tree,
taking turns with plain decoding prompt by prompt; the tree with the highest median speedup over plain decoding is
kept, and the candidates' table (acceptance length, verification and draft time per cycle, tokens/s, speedup, the
analytical bound tau x t_plain / (t_verify + t_draft)) is written beside the results (tree_search.md/.json).
``--measure all`` skips the search and measures every candidate in the benchmark itself, side by side.

A method may also be a hybrid, ``griffin+suffix``: the head's trees merged with a model-free draft's (the runtime's
``--draft griffin+suffix``), the head's tree chosen by the same search. Its suffix trees read each request's own
prompt and output only (``max_cached_requests`` 0): the benchmark runs every prompt more than once, and a trie kept
across requests would hold the same prompt's earlier answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec_kit.bench.head_engine import add_draft_weights_argument, build_head_engine, effective_draft_weights

# total_tokens:depth:top_k: chains, deep trees and wide shallow ones (a draft level fewer costs less than its tokens)
DEFAULT_TREES = "3:2:1,4:3:1,6:3:2,8:3:2,8:4:2,8:3:3,12:4:3,6:2:3,7:2:4,8:2:4,6:1:5"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specdec-bench-chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="smollm2", help="a named target (its heads come with the kit)")
    p.add_argument(
        "--methods",
        default="griffin,eagle3",
        help="heads to compare with plain decoding, or hybrids of a head and a model-free draft (griffin+suffix)",
    )
    p.add_argument("--sets", default="humaneval,spec_bench,chat", help="prompt sets (held out of training)")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--prompts", type=int, default=8, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trees", default=DEFAULT_TREES, help="candidate dynamic trees, total_tokens:depth:top_k")
    p.add_argument(
        "--width-cut",
        choices=["on", "off"],
        default="off",
        help="on: cut each cycle's tree to the best nodes whose chances pay for their verification (the runtime's "
        "WidthCut); off: verify each tree whole",
    )
    p.add_argument(
        "--measure",
        choices=["chosen", "all"],
        default="chosen",
        help="chosen: each method with the tree its search chose; all: each method with every candidate tree, "
        "side by side in the benchmark itself (rows named by tree; no search)",
    )
    p.add_argument(
        "--calibration-prompts",
        type=int,
        default=6,
        help="held-out prompts the benchmark does not measure, one set after another",
    )
    p.add_argument("--calibration-tokens", type=int, default=64)
    p.add_argument(
        "--backend",
        default="onnxruntime",
        choices=["onnxruntime", "torch"],
        help="the engines' backend (torch: PyTorch eager, no graph export)",
    )
    add_draft_weights_argument(p)
    p.add_argument("--engines", type=Path, default=Path("engines"), help="where the engines are built (or reused)")
    p.add_argument("--out", type=Path, default=Path("bench/results/smollm2"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the tests")
    return p.parse_args(argv)


def build_engines(args, methods: list[str], trees: list) -> dict[str, Path]:
    """Each head's engine, built by the kit's builder (an identical rebuild is reused), carrying a one-call draft
    graph for every candidate tree where its kind drafts trees in one call: the search compares the trees as each
    would run if chosen, not the engine's own tree in one call against the others level by level. A hybrid method
    runs on its head's engine."""
    from specdec_kit.runtime.registry import hybrid_parts

    heads = {method: hybrid_parts(method)[0] for method in methods}
    built = {
        head: build_head_engine(args.target, head, args.backend, args.draft_weights, args.engines, trees)
        for head in dict.fromkeys(heads.values())
    }
    return {method: built[head] for method, head in heads.items()}


def open_methods(paths: dict[str, Path]) -> dict:
    """Each method's engine; methods on one head share its engine's sessions."""
    from specdec_kit.runtime.engine import open_engine

    opened = {path: open_engine(path) for path in dict.fromkeys(paths.values())}
    return {method: with_method_draft(method, opened[path]) for method, path in paths.items()}


def with_method_draft(method: str, engine):
    """The engine a method drafts with: the head's engine, with a hybrid's model-free kind merged into its trees
    (suffix trees over each request's own text: ``max_cached_requests`` 0)."""
    import dataclasses

    from specdec_kit.runtime.engine import merge_lookup
    from specdec_kit.runtime.registry import default_settings, hybrid_parts

    _, lookup = hybrid_parts(method)
    if lookup is None:
        return engine
    settings = default_settings(lookup)
    if hasattr(settings, "max_cached_requests"):
        settings = dataclasses.replace(settings, max_cached_requests=0)
    return merge_lookup(engine, lookup, settings)


def parse_trees(spec: str) -> list:
    """``total_tokens:depth:top_k,...`` -> dynamic trees (``--trees``)."""
    from specdec_kit.runtime.core.trees import DynamicTreeConfig

    return [DynamicTreeConfig(*map(int, tree.split(":"))) for tree in spec.split(",")]


def calibration_messages(sets: list[str], measured: int, count: int) -> list[list[dict]]:
    """``count`` held-out prompts of the benchmark's ``sets`` past the ``measured`` first of each, one set after
    another: prompts no head trains on, from the distribution the benchmark measures, never one it measures."""
    from specdec_kit.data.prompts import chat_messages

    per_set = -(-count // len(sets))
    queues = []
    for name in sets:
        try:
            queues.append(chat_messages(name, measured + per_set)[measured:])
        except ValueError as exc:
            raise ValueError(
                f"{exc}: the tree search calibrates on {per_set} held-out prompts of each set past the {measured} "
                "measured; lower --prompts or --calibration-prompts"
            ) from exc
    return [queue[i] for i in range(per_set) for queue in queues][:count]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def head_generator(engine, tree, width_cut: bool):
    """The engine's head drafting ``tree``, each cycle's tree cut to the width that pays with ``width_cut``."""
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.decoding.width_cut import WidthCut

    return SpeculativeGenerator(engine.target, engine.drafter_for(tree), width_cut=WidthCut() if width_cut else None)


def at_tree(method: str, tree) -> str:
    """A method at one tree, as rows that set trees side by side name it: ``griffin (7, 2, 4)``."""
    return f"{method} ({tree.total_tokens}, {tree.depth}, {tree.top_k})"


def search_trees(
    engines: dict, plain, calibration: list[list[int]], candidates: list, max_new: int, width_cut: bool
) -> dict:
    """Per method, every candidate tree's measured costs on the calibration prompts; the fastest is ``best``.

    Prompt by prompt, plain decoding and every candidate take turns (``measure``'s rotating order), and a candidate's
    speedup is the median over prompts of its tokens/s over plain decoding's on the same prompt: the shared machine's
    memory bandwidth moves between two states minutes apart, and candidates timed one after another met different ones
    (on SmolLM2 one such search had (6, 3, 2) at 1.12x and (7, 2, 4) at 1.30x; measured side by side in the benchmark,
    1.28-1.55x against 1.34-1.57x at T=0)."""
    import statistics

    from specdec_kit.bench.speedup import measure
    from specdec_kit.runtime.decoding.generate import RequestStats

    names = {(method, tree): at_tree(method, tree) for method in engines for tree in candidates}
    generators = {"plain": plain}
    for (method, tree), name in names.items():
        generators[name] = head_generator(engines[method], tree, width_cut)
    results = measure(generators, {"calibration": calibration}, [0.0], 1, max_new)

    def runs(name: str) -> list[RequestStats]:
        """The name's runs, calibration prompt by prompt."""
        found = results[("calibration", 0.0, name)]
        return [found[(i, 0)]["stats"] for i in range(len(calibration))]

    plain_runs = runs("plain")
    plain_stats = RequestStats.combined(plain_runs)
    t_plain = plain_stats.total_s / max(plain_stats.generated_tokens, 1)
    out = {"plain_tokens_per_s": statistics.median(r.tokens_per_s for r in plain_runs), "methods": {}}
    for method in engines:
        rows = []
        for tree in candidates:
            mine = runs(names[(method, tree)])
            ratios = [r.tokens_per_s / p.tokens_per_s for r, p in zip(mine, plain_runs)]
            stats = RequestStats.combined(mine)
            verify, draft = stats.verify_s / stats.cycles, stats.draft_s / stats.cycles
            rows.append(
                {
                    "tree": [tree.total_tokens, tree.depth, tree.top_k],
                    "tau": stats.acceptance_length,
                    "verify_ms": 1000 * verify,
                    "draft_ms": 1000 * draft,
                    "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
                    "speedup": statistics.median(ratios),
                    "speedups": ratios,  # per calibration prompt, over plain decoding's on that prompt
                    "bound": stats.acceptance_length * t_plain / (verify + draft),
                }
            )
            print(
                f"  {method} tree {rows[-1]['tree']}: tau {rows[-1]['tau']:.2f}, {rows[-1]['tokens_per_s']:.1f} tok/s "
                f"({rows[-1]['speedup']:.2f}x plain)",
                file=sys.stderr,
            )
        best = max(rows, key=lambda r: (r["speedup"], -r["tree"][0]))
        out["methods"][method] = {"candidates": rows, "best": best["tree"]}
    out["t_plain_ms"] = 1000 * t_plain
    return out


def tree_table(search: dict) -> list[str]:
    where = search.get("calibration")
    which = (
        f" ({where['prompts']} held-out prompts of {', '.join(where['sets'])}, past the {where['past_measured']} "
        "of each the benchmark measures)"
        if where
        else ""
    )
    lines = [
        f"Plain decoding on the calibration prompts{which}: {search['plain_tokens_per_s']:.1f} tokens/s "
        f"({search['t_plain_ms']:.1f} ms per token)"
        + (
            "; each cycle verifies the best nodes of its tree that pay for their verification (the width cut)"
            if search.get("width_cut") == "on"
            else ""
        ),
        "",
        "| method | tree (total, depth, top-k) | tau | verify ms/cycle | draft ms/cycle | tokens/s | speedup | bound |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, found in search["methods"].items():
        for r in found["candidates"]:
            mark = " **(chosen)**" if r["tree"] == found["best"] else ""
            lines.append(
                f"| {method} | {tuple(r['tree'])}{mark} | {r['tau']:.2f} | {r['verify_ms']:.1f} | "
                f"{r['draft_ms']:.1f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['bound']:.2f}x |"
            )
    return lines


def chosen_trees(args, engines: dict, plain, tokenizer, set_names: list[str], candidates: list, width_cut: bool):
    """The tree search on the calibration prompts (its tables written to ``args.out``): (method, engine, best tree)
    for each method."""
    calibration = [
        chat_ids(tokenizer, m) for m in calibration_messages(set_names, args.prompts, args.calibration_prompts)
    ]
    print(f"choosing the tree from measured costs ({len(candidates)} candidates)", file=sys.stderr)
    search = search_trees(engines, plain, calibration, candidates, args.calibration_tokens, width_cut)
    search["calibration"] = {"sets": set_names, "past_measured": args.prompts, "prompts": len(calibration)}
    search["width_cut"] = args.width_cut
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tree_search.json").write_text(json.dumps(search, indent=2))
    (args.out / "tree_search.md").write_text("\n".join(tree_table(search)) + "\n")
    print("\n".join(tree_table(search)), file=sys.stderr)
    return [(method, engine, search["methods"][method]["best"]) for method, engine in engines.items()]


def run(args) -> int:
    from specdec_kit.bench.report import write_all
    from specdec_kit.bench.speedup import machine, measure, summarize
    from specdec_kit.data.prompts import chat_messages
    from specdec_kit.runtime.core.trees import DynamicTreeConfig
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.loader import set_threads

    if args.smoke:
        args.prompts, args.max_new_tokens, args.repeats = 1, 8, 1
        args.calibration_prompts, args.calibration_tokens, args.trees = 1, 8, "4:3:1,8:3:2"
    set_threads()
    args.draft_weights = effective_draft_weights(args.backend, args.draft_weights)
    methods = [m for m in args.methods.split(",") if m]
    candidates = parse_trees(args.trees)
    engines = open_methods(build_engines(args, methods, candidates))
    first = engines[methods[0]]
    tokenizer = first.tokenizer
    plain = SpeculativeGenerator(first.target, NoDrafter())
    set_names = args.sets.split(",")
    width_cut = args.width_cut == "on"
    if args.measure == "all":
        chosen = {at_tree(method, tree): (engine, tree) for method, engine in engines.items() for tree in candidates}
    else:
        chosen = {
            method: (engine, DynamicTreeConfig(*best))
            for method, engine, best in chosen_trees(args, engines, plain, tokenizer, set_names, candidates, width_cut)
        }
    generators = {"plain": plain}
    for name, (engine, tree) in chosen.items():
        generators[name] = head_generator(engine, tree, width_cut)
    sets = {name: [chat_ids(tokenizer, m) for m in chat_messages(name, args.prompts)] for name in set_names}
    temps = [float(t) for t in args.temperatures.split(",")]
    results = measure(generators, sets, temps, args.repeats, args.max_new_tokens, sets_take_turns=True)
    rows = summarize(results, list(generators))
    meta = {
        "target": args.target,
        "backend": args.backend,
        "batch": 1,
        "draft_weights": args.draft_weights,
        "prompts_per_set": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "trees": {name: [tree.total_tokens, tree.depth, tree.top_k] for name, (_, tree) in chosen.items()},
        "width_cut": args.width_cut,
    }
    write_all(rows, args.out, machine(results), meta)
    print((args.out / "results.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
