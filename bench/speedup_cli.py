"""``python -m specdec_kit.bench.speedup``: acceptance length and speedup of every method on the zoo.

Over HumanEval, Spec-Bench and held-out corpus prompts, at each temperature, every method and plain
decoding run on the same target in the same process, interleaved (the method order rotates per
prompt) and repeated; speedups are medians of per-(prompt, repeat) ratios to plain decoding. Beside
each measured speedup stands the analytical bound tau * t / (t_verify + t_draft) from the measured
latencies (methods.md section 1, with the tree's verify latency in the denominator). Peers on the same
target: ``transformers`` ``generate``, its assisted generation with the zoo's independent draft LM,
and its prompt-lookup decoding.

(The command line, parsed before torch loads; ``bench/speedup.py`` does the work.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec_kit.bench.methods import SPEEDUP_METHODS
from specdec_kit.data import prompts as prompt_sets

# method name -> (draft kind, zoo folder); trees: dynamic (--total-tokens/--depth/--top-k), Medusa --medusa-tree
METHODS = SPEEDUP_METHODS
PEERS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.bench.speedup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--zoo", type=Path, default=None, help="the demo zoo (default: $SPECDEC_ZOO, else ./zoo)")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--prompt-sets", default="humaneval,spec_bench,heldout")
    p.add_argument("--spec-bench", type=Path, default=prompt_sets.DEFAULT_SPEC_BENCH)
    p.add_argument("--prompts", type=int, default=8, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--methods", default="", help=f"comma-separated, from {list(METHODS)} (default: those the zoo has)")
    p.add_argument("--peers", default=",".join(PEERS), help="comma list, or 'none'")
    p.add_argument("--total-tokens", type=int, default=12)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument(
        "--medusa-tree",
        default="static:mc_sim_7b_63:24",
        help="Medusa's static tree (default: the first 24 choices of mc_sim_7b_63, sized for a CPU)",
    )
    p.add_argument("--smoke", action="store_true", help="2 prompts, 12 tokens, 1 repeat: checks that it runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec_kit.bench.speedup import run

    return run(args)
