"""``specdec-verify-cost``: what one verification step of a target costs as the tokens it checks grow (N = 1..64).

Speculation pays when the target checks N drafted tokens for little more than the cost of one: the curve t(N)/t(1)
is what the choice of tree size rests on (tau x t(1) / (t(N) + depth x t_draft)). The curve depends on the model's
shape, the device and the dtype, not on its weights, so this builds a Llama model of a real model's shape with random
weights (Llama-3-8B by default: no download), fills a KV cache of ``--context`` tokens, and times a forward of N new
tokens over it (causal among the new tokens; a tree mask costs the same), the cache cut back to the context after
each call. Medians over ``--repeats``; device synchronised around every call. Writes verify_cost.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# Shapes of real models (layers, width, heads, FFN, vocabulary); "tiny" is for tests.
SHAPES: dict[str, dict] = {
    "llama3-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "llama3-1b": dict(
        num_hidden_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "smollm2-135m": dict(
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
    ),
    "tiny": dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    ),
}


def parse_tokens(spec: str) -> list[int]:
    """``1-64`` or ``1,2,4,8`` (ranges and single values, comma-separated)."""
    values: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"--tokens {spec!r}: expected values or ranges like 1-64 or 1,2,4,8") from None
        if first < 1 or last < first:
            raise ValueError(f"--tokens {spec!r}: {part!r} is not a range of positive counts")
        values.update(range(first, last + 1))
    return sorted(values)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specdec-verify-cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="the model shape (random weights)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float16, bfloat16, float32"
    )
    p.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    p.add_argument("--tokens", default="1-64", help="new-token counts N to time, e.g. 1-64 or 1,4,16")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated (each row checks N tokens)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("bench/results/verify_cost"))
    return p.parse_args(argv)


def build_model(shape: str, device, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def time_curve(model, context: int, tokens: list[int], batch: int, repeats: int, progress) -> list[dict]:
    """Median milliseconds of one forward of N new tokens over a cache of ``context`` tokens, for each N."""
    import torch
    from transformers import DynamicCache

    from specdec_kit.runtime.core.device import synchronize

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    cache = DynamicCache()
    with torch.inference_mode():
        prefix = torch.randint(vocab, (batch, context), generator=gen).to(device)
        model(input_ids=prefix, past_key_values=cache, use_cache=True)
        for _ in range(3):  # allocator and kernel choice settle before anything is timed
            model(
                input_ids=prefix[:, -1:],
                position_ids=torch.full((batch, 1), context, device=device),
                past_key_values=cache,
                use_cache=True,
            )
            cache.crop(-1)
        rows = []
        for n in tokens:
            new = torch.randint(vocab, (batch, n), generator=gen).to(device)
            positions = torch.arange(context, context + n, device=device).expand(batch, n)
            samples = []
            for r in range(repeats + 1):  # the first call warms up this shape
                synchronize(device)
                start = time.perf_counter()
                model(input_ids=new, position_ids=positions, past_key_values=cache, use_cache=True)
                synchronize(device)
                if r:
                    samples.append((time.perf_counter() - start) * 1000)
                cache.crop(-n)  # back to the context
                if cache.get_seq_length() != context:
                    raise RuntimeError(
                        f"the KV cache holds {cache.get_seq_length()} tokens after a step, not {context}"
                    )
            rows.append(
                {
                    "batch": batch,
                    "tokens": n,
                    "ms": statistics.median(samples),
                    "ms_min": min(samples),
                    "ms_max": max(samples),
                }
            )
            progress.update(1)
    base = rows[0]["ms"]
    for row in rows:
        row["ratio_to_first"] = row["ms"] / base
    return rows


def write_results(result: dict, out: Path) -> None:
    from specdec_kit.plots import pyplot

    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps(result, indent=1))
    first = result["tokens"][0]
    lines = [
        f"# Verification cost: {result['shape']} (random weights), {result['device_name']}, {result['dtype']}, "
        f"context {result['context']}",
        "",
        f"| batch | N new tokens | ms (median) | t(N) / t({first}) |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['batch']} | {r['tokens']} | {r['ms']:.2f} | {r['ratio_to_first']:.2f} |" for r in result["points"]]
    (out / "verify_cost.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for batch in result["batches"]:
        pts = [r for r in result["points"] if r["batch"] == batch]
        ax.plot([r["tokens"] for r in pts], [r["ms"] for r in pts], marker=".", label=f"batch {batch}")
    ax.set_xlabel("new tokens checked in one step (N)")
    ax.set_ylabel("ms per step (median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"{result['shape']} on {result['device_name']}, {result['dtype']}, context {result['context']}")
    fig.tight_layout()
    fig.savefig(out / "verify_cost.png", dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from specdec_kit.runtime.core.device import resolve_device, resolve_dtype

    tokens = parse_tokens(args.tokens)
    batches = [int(b) for b in args.batch.split(",")]
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    print(f"{args.shape}: building with random weights on {device} ({dtype})", file=sys.stderr)
    model = build_model(args.shape, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    points = []
    with tqdm(total=len(tokens) * len(batches), desc="verify cost", unit="point", file=sys.stderr) as progress:
        for batch in batches:
            points += time_curve(model, args.context, tokens, batch, args.repeats, progress)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    result = {
        "shape": args.shape,
        "parameters": params,
        "device": str(device),
        "device_name": name,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "context": args.context,
        "repeats": args.repeats,
        "tokens": tokens,
        "batches": batches,
        "points": points,
    }
    write_results(result, args.out)
    print((args.out / "verify_cost.md").read_text())
    print(f"wrote {args.out}/verify_cost.json, .md, .png", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
