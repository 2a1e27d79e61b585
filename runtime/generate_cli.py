"""The work behind ``specdec-generate`` (``runtime/cli.py`` parses the options): load, generate, report."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from specdec_kit.paths import default_zoo
from specdec_kit.runtime.cli import DEMO_PROMPTS, DEMO_TREE, MEDUSA_DEMO_TREE, ZOO_DEFAULT, ZOO_PROMPTS
from specdec_kit.runtime.drafts.loading import DraftLoadError
from specdec_kit.runtime.engine import open_engine
from specdec_kit.runtime.generate import GenerationResult, RequestStats, SpeculativeGenerator
from specdec_kit.runtime.loader import default_tree, load_tokenizer, make_drafter, resolve_tree, set_threads
from specdec_kit.runtime.manifest import EngineError
from specdec_kit.runtime.sampling import SamplingParams
from specdec_kit.runtime.target import TargetLoadError, TargetModel
from specdec_kit.runtime.trees import DynamicTreeConfig


def describe(name: str, results: list[GenerationResult]) -> dict:
    pooled = RequestStats.combined([r.stats for r in results])
    seconds = max(r.stats.total_s for r in results)  # one batch: requests ran side by side
    return {
        "method": name,
        "tokens": pooled.generated_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(pooled.generated_tokens / seconds, 2) if seconds else 0.0,
        "acceptance_length": round(pooled.acceptance_length, 3),
        "accepted_per_depth": pooled.accepted_per_depth,
        "cycles": pooled.cycles,
    }


def tree_label(tree) -> str:
    if isinstance(tree, DynamicTreeConfig):
        return f"dynamic tree (total_tokens={tree.total_tokens}, depth={tree.depth}, top_k={tree.top_k})"
    return f"static tree ({tree.buffers.num_nodes} nodes, depth {tree.buffers.max_depth})"


def print_run(summary: dict, results: list[GenerationResult], prompts: list[str], show_text: bool) -> None:
    print(f"\n== {summary['method']}: {summary['tokens']} tokens in {summary['seconds']:.3f}s "
          f"({summary['tokens_per_s']:.1f} tok/s), acceptance length tau={summary['acceptance_length']:.2f}, "
          f"accepted per depth {summary['accepted_per_depth']}")
    if show_text:
        for prompt, res in zip(prompts, results):
            print(f"  [{res.finish_reason}] {prompt!r} -> {res.text!r}")


def run(target, tokenizer, kind: str, drafter, tree, args, prompts: list[str], compare_plain: bool) -> list[dict]:
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    gen = SpeculativeGenerator(target, drafter, decode=decode)
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_k=args.sample_top_k, top_p=args.top_p, seed=args.seed)
    gen.generate(ids[:1], 4, params)  # warm-up
    results = gen.generate(ids, args.max_new_tokens, params)
    summaries = [describe(f"{kind}, {tree_label(tree)}", results)]
    print_run(summaries[0], results, prompts, show_text=True)
    if compare_plain:
        plain = SpeculativeGenerator(target, None, decode=decode)
        plain.generate(ids[:1], 4, params)
        base = plain.generate(ids, args.max_new_tokens, params)
        summaries.append(describe("plain decoding", base))
        print_run(summaries[-1], base, prompts, show_text=False)
        speedup = summaries[0]["tokens_per_s"] / summaries[1]["tokens_per_s"]
        summaries[0]["speedup_vs_plain"] = round(speedup, 3)
        if params.greedy:
            same = all(a.tokens == b.tokens for a, b in zip(results, base))
            summaries[0]["identical_to_plain"] = same
            print(f"  greedy output identical to plain decoding: {same}; speedup {speedup:.2f}x")
            if not same:
                raise SystemExit("LOSSLESSNESS VIOLATED: speculative output differs from plain greedy decoding")
        else:
            print(f"  speedup {speedup:.2f}x (sampled: outputs differ by design, distributions do not)")
    return summaries


def print_summary(summaries: list[dict]) -> None:
    """One table at the end: each method's acceptance length, tokens/s and speedup over plain decoding."""
    plain = next((s["tokens_per_s"] for s in summaries if s["method"] == "plain decoding"), None)
    print(f"\n{'method':<72} {'tau':>6} {'tokens/s':>9} {'vs plain':>9}")
    for s in summaries:
        ratio = f"{s['tokens_per_s'] / plain:.2f}x" if plain else "-"
        tau = "-" if s["method"] == "plain decoding" else f"{s['acceptance_length']:.2f}"
        print(f"{s['method'][:72]:<72} {tau:>6} {s['tokens_per_s']:>9.1f} {ratio:>9}")


def execute(args) -> int:
    set_threads()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    try:
        if args.demo or args.zoo:
            if args.zoo:
                root = default_zoo() if args.zoo is ZOO_DEFAULT else args.zoo
                if not (root / "target" / "config.json").is_file():
                    raise ValueError(f"{root}: no demo zoo here (build it with: python -m specdec_kit.train.zoo --out {root})")
                from specdec_kit.export.inputs import ZOO_HEADS

                paths = {"target": root / "target", "moa_tli0": root / "moa_tli0",
                         **{kind: root / folder for kind, folder in ZOO_HEADS.items()}}
                print(f"demo zoo: {root} (a 9M-parameter Llama target trained by the kit on Python's standard library, "
                      "one head per method; its text is code-like but not meaningful: the zoo shows the machinery "
                      "and its numbers, not a useful model)")
                prompts = args.prompt or ZOO_PROMPTS
            else:
                from specdec_kit.runtime.demo import write_demo

                root = args.demo_dir or Path(tempfile.mkdtemp(prefix="specdec-demo-"))
                paths = write_demo(root)
                print(f"synthetic checkpoints (random target, constructed drafts) written to {root}")
                prompts = args.prompt or DEMO_PROMPTS
            dynamic = DynamicTreeConfig(total_tokens=args.total_tokens or DEMO_TREE["total_tokens"],
                                        depth=DEMO_TREE["depth"] if args.depth is None else args.depth,
                                        top_k=args.top_k or DEMO_TREE["top_k"])
            target = TargetModel.from_pretrained(paths["target"], args.dtype, args.device)
            tokenizer = load_tokenizer(paths["target"])
            summaries = []
            for label in ("griffin", "eagle3", "hass", "eagle2", "eagle", "medusa", "moa", "moa_tli0"):
                if label not in paths or not paths[label].is_dir():
                    continue
                kind = "moa" if label.startswith("moa") else label  # two Mixture-of-Attentions heads: TLI 1 and 0
                tree = (resolve_tree(kind, args.tree, args.total_tokens, args.depth, args.top_k) if args.tree
                        else default_tree(kind, dynamic, MEDUSA_DEMO_TREE))
                summaries += run(target, tokenizer, label, make_drafter(target, kind, paths[label], tree), tree, args,
                                 prompts, compare_plain=(kind == "griffin"))
        elif args.engine:
            engine = open_engine(args.engine, device=args.device)
            target, tokenizer, tree = engine.target, engine.tokenizer, engine.tree
            print(f"engine: {args.engine} ({engine.backend} backend, {engine.draft_kind} draft, {engine.manifest['dtype']})")
            summaries = run(target, tokenizer, engine.draft_kind, engine.drafter, tree, args,
                            args.prompt or ZOO_PROMPTS[:1], args.compare_plain)
        else:
            if args.target is None:
                print("error: give --engine DIR, --target DIR (and --draft-path DIR), --zoo or --demo", file=sys.stderr)
                return 2
            target = TargetModel.from_pretrained(args.target, args.dtype, args.device)
            tokenizer = load_tokenizer(args.target)
            tree = resolve_tree(args.draft, args.tree, args.total_tokens, args.depth, args.top_k)
            drafter = make_drafter(target, args.draft, args.draft_path, tree)
            summaries = run(target, tokenizer, args.draft, drafter, tree, args,
                            args.prompt or DEMO_PROMPTS[:1], args.compare_plain)
    except (DraftLoadError, TargetLoadError, EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summaries)
    print(f"\ndevice {target.device}, dtype {str(target.dtype).removeprefix('torch.')}, threads {torch.get_num_threads()}")
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    return 0
