"""The work behind ``specdec-generate`` (``runtime/cli.py`` parses the options): load, generate, report."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specdec_kit.paths import default_zoo
from specdec_kit.runtime.core.manifest import EngineError
from specdec_kit.runtime.core.memory_bandwidth import copy_bandwidth_gbs
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.generate import GenerationResult, RequestStats, SpeculativeGenerator
from specdec_kit.runtime.drafts.loading import DraftLoadError
from specdec_kit.runtime.engine import open_engine
from specdec_kit.runtime.engine_flags import joined_vocab
from specdec_kit.runtime.heap import freeze_heap
from specdec_kit.runtime.loader import (
    default_tree,
    head_kind,
    load_tokenizer,
    make_drafter,
    resolve_tree,
    set_threads,
)
from specdec_kit.runtime.models.pretrained import NAMED_TARGETS, is_named, named_head, resolve_target
from specdec_kit.runtime.models.target import TargetLoadError, TargetModel
from specdec_kit.runtime.presets import (
    CHAT_PROMPTS,
    DEMO_PROMPTS,
    DEMO_TREE,
    MEDUSA_DEMO_TREE,
    ZOO_DEFAULT,
    ZOO_PROMPTS,
)


def describe(name: str, results: list[GenerationResult], one_by_one: bool = False) -> dict:
    pooled = RequestStats.combined([r.stats for r in results])
    times = [r.stats.total_s for r in results]  # one batch: requests ran side by side; one by one: in turn
    seconds = sum(times) if one_by_one else max(times)
    return {
        "method": name,
        "tokens": pooled.generated_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(pooled.generated_tokens / seconds, 2) if seconds else 0.0,
        "acceptance_length": round(pooled.acceptance_length, 3),
        "accepted_per_depth": pooled.accepted_per_depth,
        "cycles": pooled.cycles,
    }


@dataclass
class PairedRounds:
    """A method and plain decoding run in turns over the same prompts, round after round, the one that goes first
    alternating: each round's speedup sets the two side by side within seconds of each other, so a slow few seconds
    of a shared machine moves one round's ratio, not the median reported (single runs of each, one after the other,
    gave SmolLM2's GRIFFIN 1.16x to 1.53x against plain decoding on the demo's prompts on 2 cores)."""

    method: list[list[GenerationResult]] = field(default_factory=list)  # each round's results
    plain: list[list[GenerationResult]] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # each round's tokens/s of the method over plain decoding's
    copy_gbs: list[float] = field(default_factory=list)  # the memory bandwidth before each round (plain decoding's
    # speed on a CPU follows it, a speculative cycle's verification much less: ``memory_bandwidth``)

    @classmethod
    def measure(
        cls,
        run_method: Callable[[], list[GenerationResult]],
        run_plain: Callable[[], list[GenerationResult]],
        rounds: int,
        one_by_one: bool,
    ) -> "PairedRounds":
        out = cls()
        for r in range(rounds):
            out.copy_gbs.append(copy_bandwidth_gbs())
            if r % 2 == 0:
                out.method.append(run_method())
                out.plain.append(run_plain())
            else:
                out.plain.append(run_plain())
                out.method.append(run_method())
            rates = [describe("", runs[-1], one_by_one)["tokens_per_s"] for runs in (out.method, out.plain)]
            out.ratios.append(rates[0] / rates[1] if rates[1] else 0.0)
        return out

    @staticmethod
    def summary(runs: list[list[GenerationResult]], one_by_one: bool) -> dict:
        """The median round of one side (tokens/s and seconds), and how many rounds."""
        rounds = [describe("", results, one_by_one) for results in runs]
        return {
            "rounds": len(rounds),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rounds), 2),
            "seconds": round(statistics.median(r["seconds"] for r in rounds), 4),
        }

    def speedup(self) -> float:
        return statistics.median(self.ratios)

    def spread(self) -> str:
        return (
            f" (median of {len(self.ratios)} rounds taking turns; {min(self.ratios):.2f}-{max(self.ratios):.2f}x; "
            f"memory copy {statistics.median(self.copy_gbs):.0f} GB/s)"
        )


def tree_label(tree) -> str:
    if isinstance(tree, DynamicTreeConfig):
        return f"dynamic tree (total_tokens={tree.total_tokens}, depth={tree.depth}, top_k={tree.top_k})"
    return f"static tree ({tree.buffers.num_nodes} nodes, depth {tree.buffers.max_depth})"


def print_run(summary: dict, results: list[GenerationResult], prompts: list[str], show_text: bool) -> None:
    print(
        f"\n== {summary['method']}: {summary['tokens']} tokens in {summary['seconds']:.3f}s "
        f"({summary['tokens_per_s']:.1f} tok/s), acceptance length tau={summary['acceptance_length']:.2f}, "
        f"accepted per depth {summary['accepted_per_depth']}"
    )
    if show_text:
        for prompt, res in zip(prompts, results):
            print(f"  [{res.finish_reason}] {prompt!r} -> {res.text!r}")


def prompt_ids(tokenizer, prompt: str, chat: str) -> list[int]:
    """The prompt's token ids: as a user message through the tokenizer's chat template (``chat`` on, or auto when
    the tokenizer has one), else the text itself."""
    if chat == "on" or (chat == "auto" and getattr(tokenizer, "chat_template", None)):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat on: this tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


Plain = tuple[dict, list[GenerationResult]]  # plain decoding's summary and results, to compare other runs with


def generate_all(
    gen: SpeculativeGenerator, ids: list[list[int]], args, params: SamplingParams
) -> list[GenerationResult]:
    """The prompts as one batch, or (``--one-by-one``) each alone, in turn."""
    if args.one_by_one:
        return [gen.generate([one], args.max_new_tokens, params)[0] for one in ids]
    return gen.generate(ids, args.max_new_tokens, params)


def run(
    target,
    tokenizer,
    kind: str,
    drafter,
    tree,
    args,
    prompts: list[str],
    compare_plain: bool,
    plain: Plain | None = None,
) -> tuple[list[dict], Plain | None]:
    """Generate with ``drafter``; with ``compare_plain`` also plain decoding through the same loop (or compare with
    ``plain``, measured already), checking greedy identity and reporting the speedup. With ``--rounds N`` the two take
    turns N times and the speedup is the median of the rounds' (``PairedRounds``): each method compared with its own
    rounds of plain decoding. Returns the summaries and the plain decoding compared with."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    gen = SpeculativeGenerator(target, drafter, decode=decode)
    ids = [prompt_ids(tokenizer, p, args.chat) for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_k=args.sample_top_k, top_p=args.top_p, seed=args.seed)
    gen.generate(ids[:1], 4, params)  # warm-up
    decoder = None
    if compare_plain and (plain is None or args.rounds > 1):
        decoder = SpeculativeGenerator(target, None, decode=decode)
        decoder.generate(ids[:1], 4, params)
    freeze_heap()  # the process's start-up objects out of the collector's walks (``runtime/heap.py``)
    paired = None
    if decoder is not None and args.rounds > 1:
        paired = PairedRounds.measure(
            lambda: generate_all(gen, ids, args, params),
            lambda: generate_all(decoder, ids, args, params),
            args.rounds,
            args.one_by_one,
        )
        results = paired.method[-1]
    else:
        results = generate_all(gen, ids, args, params)
    summaries = [describe(f"{kind}, {tree_label(tree)}", results, args.one_by_one)]
    if paired is not None:
        summaries[0].update(paired.summary(paired.method, args.one_by_one))
    print_run(summaries[0], results, prompts, show_text=True)
    if decoder is not None:
        first = plain is None
        base = paired.plain[-1] if paired is not None else generate_all(decoder, ids, args, params)
        plain = (describe("plain decoding", base, args.one_by_one), base)
        if paired is not None:
            plain[0].update(paired.summary(paired.plain, args.one_by_one))
        if first:
            summaries.append(plain[0])
            print_run(plain[0], base, prompts, show_text=False)
    if plain is not None:
        summary, base = plain
        speedup = paired.speedup() if paired is not None else summaries[0]["tokens_per_s"] / summary["tokens_per_s"]
        summaries[0]["speedup_vs_plain"] = round(speedup, 3)
        spread = paired.spread() if paired is not None else ""
        if paired is not None:
            summaries[0]["speedup_rounds"] = [round(r, 3) for r in paired.ratios]
            summaries[0]["copy_gbs_rounds"] = [round(g, 1) for g in paired.copy_gbs]
        if params.greedy:
            pairs = zip(paired.method, paired.plain) if paired is not None else [(results, base)]
            same = all(a.tokens == b.tokens for ours, theirs in pairs for a, b in zip(ours, theirs))
            summaries[0]["identical_to_plain"] = same
            print(f"  greedy output identical to plain decoding: {same}; speedup {speedup:.2f}x{spread}")
            if not same:
                raise SystemExit("LOSSLESSNESS VIOLATED: speculative output differs from plain greedy decoding")
        else:
            print(f"  speedup {speedup:.2f}x{spread} (sampled: outputs differ by design, distributions do not)")
    return summaries, plain


def print_summary(summaries: list[dict]) -> None:
    """One table at the end: each method's acceptance length, tokens/s and speedup over plain decoding."""
    plain = next((s["tokens_per_s"] for s in summaries if s["method"] == "plain decoding"), None)
    print(f"\n{'method':<72} {'tau':>6} {'tokens/s':>9} {'vs plain':>9}")
    for s in summaries:
        paired = s.get("speedup_vs_plain") if "rounds" in s else None  # against its own rounds of plain decoding
        ratio = f"{paired:.2f}x" if paired else f"{s['tokens_per_s'] / plain:.2f}x" if plain else "-"
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
                    raise ValueError(
                        f"{root}: no demo zoo here (build it with: python -m specdec_kit.train.zoo --out {root})"
                    )
                from specdec_kit.runtime.registry import zoo_heads

                paths = {
                    "target": root / "target",
                    **{name: root / folder for name, (_, folder) in zoo_heads().items()},
                }
                print(
                    f"demo zoo: {root} (a 9M-parameter Llama target trained by the kit on Python's standard library, "
                    "one head per method; its text is code-like but not meaningful: the zoo shows the machinery "
                    "and its numbers, not a useful model)"
                )
                prompts = args.prompt or ZOO_PROMPTS
            else:
                from specdec_kit.runtime.demo import write_demo

                root = args.demo_dir or Path(tempfile.mkdtemp(prefix="specdec-demo-"))
                paths = write_demo(root)
                print(f"synthetic checkpoints (random target, constructed drafts) written to {root}")
                prompts = args.prompt or DEMO_PROMPTS
            dynamic = DynamicTreeConfig(
                total_tokens=args.total_tokens or DEMO_TREE["total_tokens"],
                depth=DEMO_TREE["depth"] if args.depth is None else args.depth,
                top_k=args.top_k or DEMO_TREE["top_k"],
            )
            target = TargetModel.from_pretrained(paths["target"], args.dtype, args.device)
            tokenizer = load_tokenizer(paths["target"])
            summaries, plain = [], None
            for label in ("griffin", "eagle3", "peagle", "hass", "eagle2", "eagle", "medusa", "moa", "moa_tli0"):
                if label not in paths or not paths[label].is_dir():
                    continue
                kind = "moa" if label.startswith("moa") else label  # two Mixture-of-Attentions heads: TLI 1 and 0
                tree = (
                    resolve_tree(kind, args.tree, args.total_tokens, args.depth, args.top_k)
                    if args.tree
                    else default_tree(kind, dynamic, MEDUSA_DEMO_TREE)
                )
                # plain decoding is measured once, with the first method; every method is compared with it
                rows, plain = run(
                    target,
                    tokenizer,
                    label,
                    make_drafter(target, kind, paths[label], tree, joined_vocab=joined_vocab(args)),
                    tree,
                    args,
                    prompts,
                    compare_plain=True,
                    plain=plain,
                )
                summaries += rows
        elif args.engine:
            summaries, plain = [], None
            for path in args.engine:  # several engines of one target: plain decoding is measured once, with the first
                engine = open_engine(path, device=args.device, joined_vocab=joined_vocab(args))
                target, tokenizer = engine.target, engine.tokenizer
                print(
                    f"engine: {path} ({engine.backend} backend, {engine.draft_kind} draft, {engine.manifest['dtype']})"
                )
                default = CHAT_PROMPTS[:1] if getattr(tokenizer, "chat_template", None) else ZOO_PROMPTS[:1]
                rows, plain = run(
                    target,
                    tokenizer,
                    engine.draft_kind,
                    engine.drafter,
                    engine.tree,
                    args,
                    args.prompt or default,
                    args.compare_plain,
                    plain,
                )
                summaries += rows
        else:
            if args.target is None:
                print("error: give --engine DIR, --target DIR (and --draft-path DIR), --zoo or --demo", file=sys.stderr)
                return 2
            draft_path, cpu_tree = args.draft_path, None
            if is_named(args.target):  # a named target: obtained on first use, with the kit's head of this kind
                head = head_kind(args.draft)
                draft_path = draft_path or (named_head(str(args.target), head) if head else None)
                cpu_tree = None if args.tree else NAMED_TARGETS[str(args.target)].cpu_tree(head or args.draft)
                args.target = resolve_target(args.target)
            target = TargetModel.from_pretrained(args.target, args.dtype, args.device)
            tokenizer = load_tokenizer(args.target)
            tree = resolve_tree(args.draft, args.tree, args.total_tokens, args.depth, args.top_k, cpu_tree)
            drafter = make_drafter(target, args.draft, draft_path, tree, joined_vocab=joined_vocab(args))
            default = CHAT_PROMPTS[:1] if getattr(tokenizer, "chat_template", None) else DEMO_PROMPTS[:1]
            summaries = run(
                target, tokenizer, args.draft, drafter, tree, args, args.prompt or default, args.compare_plain
            )[0]
    except (DraftLoadError, TargetLoadError, EngineError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summaries)
    print(
        f"\ndevice {target.device}, dtype {str(target.dtype).removeprefix('torch.')}, threads {torch.get_num_threads()}"
    )
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    return 0
