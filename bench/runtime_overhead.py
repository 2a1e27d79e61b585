"""Plain decoding through the runtime against ``transformers`` ``generate`` on the same target.

Reports tokens/s of both (medians over interleaved repeats, so drift hits both alike), their ratio,
and the share of the runtime's decoding time spent outside the target's forwards (tree building,
masks, verification, KV compaction, emission, Python). Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="specdec-bench-runtime", description=__doc__)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.runtime.synthetic import tiny_hf_model

    if args.smoke:
        args.hidden, args.layers, args.intermediate, args.vocab = 64, 2, 128, 200
        args.new_tokens, args.prompts, args.repeats = 16, 2, 2
    set_threads()
    hf = tiny_hf_model(
        hidden_size=args.hidden,
        layers=args.layers,
        heads=max(1, args.hidden // 64),
        kv_heads=max(1, args.hidden // 128),
        intermediate=args.intermediate,
        vocab=args.vocab,
        logit_scale=10.0,
        seed=0,
        max_positions=4096,
    )
    params = sum(p.numel() for p in hf.parameters())
    target = TargetModel(hf)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    runtime = SpeculativeGenerator(target, None, eos_token_ids=[])

    def run_hf() -> tuple[float, list[list[int]]]:
        outs, t0 = [], time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
        return time.perf_counter() - t0, outs

    def run_runtime() -> tuple[float, list[list[int]], float]:
        outs, t0 = [], time.perf_counter()
        runtime.target_forward_s = 0.0
        for p in prompts:
            outs.append(runtime.generate([p], args.new_tokens)[0].tokens)
        total = time.perf_counter() - t0
        return total, outs, runtime.target_forward_s / total

    run_hf(), run_runtime()  # warm-up
    hf_times, rt_times, inside = [], [], []
    same = True
    for rep in tqdm(range(args.repeats), desc="interleaved repeats", file=sys.stderr):
        order = (run_hf, run_runtime) if rep % 2 == 0 else (run_runtime, run_hf)  # ABBA: drift hits both
        for fn in order:
            if fn is run_hf:
                t_hf, out_hf = run_hf()
            else:
                t_rt, out_rt, share = run_runtime()
        hf_times.append(t_hf)
        rt_times.append(t_rt)
        inside.append(share)
        same &= out_hf == out_rt
    tokens = args.prompts * args.new_tokens
    hf_tps, rt_tps = tokens / statistics.median(hf_times), tokens / statistics.median(rt_times)
    pair_ratio = statistics.median(h / r for h, r in zip(hf_times, rt_times))
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    result = {
        "target_parameters": params,
        "shape": {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate, "vocab": args.vocab},
        "tokens_per_run": tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "device": str(target.device),
        "transformers_generate_tok_s": round(hf_tps, 2),
        "runtime_plain_tok_s": round(rt_tps, 2),
        "runtime_over_transformers": round(rt_tps / hf_tps, 3),
        "runtime_over_transformers_median_of_pairs": round(pair_ratio, 3),
        "runtime_weight_bandwidth_gb_s": round(weight_bytes * rt_tps / 1e9, 2),
        "share_outside_forwards": round(1.0 - statistics.median(inside), 4),
        "greedy_outputs_identical": same,
    }
    print(
        f"target: {params / 1e6:.1f}M parameters ({args.layers} layers x {args.hidden}, vocab {args.vocab}), "
        f"{tokens} tokens per run, {args.repeats} interleaved repeats, {result['threads']} threads, {result['device']}"
    )
    print("| decoder | tokens/s (median) |\n|---|---|")
    print(f"| transformers generate (greedy) | {hf_tps:.1f} |")
    print(f"| specdec runtime, plain decoding | {rt_tps:.1f} |")
    print(
        f"runtime / transformers: {result['runtime_over_transformers']:.3f}x (median of per-repeat ratios "
        f"{pair_ratio:.3f}x); weights streamed per token at {result['runtime_weight_bandwidth_gb_s']} GB/s "
        "(batch-1 decoding is bound by memory bandwidth)"
    )
    print(
        f""
        f"share of runtime step time outside model forwards: {100 * result['share_outside_forwards']:.1f}%; "
        f"outputs identical: {same}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
