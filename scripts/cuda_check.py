"""Greedy identity and speed of every demo-zoo head on one device (CUDA when present): for each method, the
runtime's speculative output must equal ``transformers`` greedy decoding of the target token for token.

    python scripts/cuda_check.py [--device cuda] [--dtype float32] [--max-new-tokens 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec_kit.paths import default_zoo
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.loader import default_tree, load_tokenizer, make_drafter
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import draft_kinds, zoo_heads

PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "    def __repr__(self):\n        return",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree", default="16,5,4", help="dynamic tree total,depth,top_k")
    p.add_argument("--json", type=Path, help="also write the rows and the device to this file")
    args = p.parse_args()
    zoo = default_zoo()
    target = TargetModel.from_pretrained(zoo / "target", args.dtype, args.device)
    tok = load_tokenizer(zoo / "target")
    ids = [tok(t)["input_ids"] for t in PROMPTS]
    ref = []
    for prompt in ids:
        x = torch.tensor([prompt], device=target.device)
        out = target.hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        ref.append(out[0, len(prompt) :].tolist())
    total, depth, top_k = (int(v) for v in args.tree.split(","))
    rows, ok = [], True
    heads = zoo_heads()  # model-free kinds (prompt lookup, suffix trees) have no head to load
    for kind in ["none", *draft_kinds()]:
        tree = (
            default_tree(kind, DynamicTreeConfig(total, depth, top_k), "static:mc_sim_7b_63:24")
            if kind != "none"
            else None
        )
        drafter = make_drafter(target, kind, zoo / heads[kind][1] if kind in heads else None, tree)
        gen = SpeculativeGenerator(target, drafter, eos_token_ids=[])
        gen.generate(ids[:1], 8)  # warm-up
        start = time.perf_counter()
        got = [gen.generate([prompt], args.max_new_tokens)[0] for prompt in ids]  # batch 1
        seconds = time.perf_counter() - start
        same = all(g.tokens == r for g, r in zip(got, ref))
        ok &= same
        tau = sum(g.stats.accepted_tokens + g.stats.cycles for g in got) / sum(g.stats.cycles for g in got)
        rows.append(
            {
                "method": kind if kind != "none" else "plain",
                "identical_to_transformers": same,
                "tau": round(tau, 2),
                "tokens_per_s": round(len(ids) * args.max_new_tokens / seconds, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if target.device.type == "cuda" else "cpu"
    print(
        f"device {target.device} ({name}), {args.dtype}, torch {torch.__version__}: "
        f"{'all identical' if ok else 'MISMATCH'}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": str(target.device),
                    "device_name": name,
                    "dtype": args.dtype,
                    "torch": torch.__version__,
                    "tree": args.tree,
                    "max_new_tokens": args.max_new_tokens,
                    "all_identical": ok,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
