"""``specdec-verify-cost``: what one verification step of a target costs as the tokens it checks grow (N = 1..64).

Speculation pays when the target checks N drafted tokens for little more than the cost of one: the curve t(N)/t(1)
is what the choice of tree size rests on (tau x t(1) / (t(N) + depth x t_draft)). The curve depends on the model's
shape, the device and the dtype, not on its weights, so this builds a Llama model of a real model's shape with random
weights (Llama-3-8B by default: no download), fills a KV cache of ``--context`` tokens, and times a forward of N new
tokens over it (causal among the new tokens; a tree mask costs the same), the cache cut back to the context after
each call. Medians over ``--repeats`` rounds, each timing every N in turn (a slow stretch of a shared machine then
falls on every N alike); device synchronised around every call. Writes verify_cost.json, .md and .png.

``--engine`` times a built engine's own target step instead (ONNX Runtime or PyTorch backend; its weights, dtype and
graph as it serves), the draft's tokens written into the cache's pending slots as verification writes them and never
committed: the curve a tree search over that engine rests on. ``--ops`` (ONNX Runtime engines) then runs each N a few
more times under ONNX Runtime's profiler and writes verify_cost_ops.md: each operator type's milliseconds a call at
every N, and what it adds from the first N to the last, which says where a wider tree's price goes (the products,
attention, the many small nodes). The profiler's own cost inflates the small operators: read the growth and the
shares, not the sums.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

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
    p.add_argument(
        "--engine",
        type=Path,
        default=None,
        help="a built engine's folder: time its own target step (--shape and --dtype do not apply)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float16, bfloat16, float32"
    )
    p.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    p.add_argument("--tokens", default="1-64", help="new-token counts N to time, e.g. 1-64 or 1,4,16")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated (each row checks N tokens)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--matmul",
        default=None,
        help="with --engine (ONNX Runtime, CPU): kernel sets, comma-separated, taking turns in every round: packed (the "
        "kit's PackedMatMul and TreeAttention), packed-matmul-only (the kit's MatMul, ONNX Runtime's Attention), "
        "onnxruntime (ONNX Runtime's own) (default: the engine as it opens)",
    )
    p.add_argument(
        "--ops",
        action="store_true",
        help="with an ONNX Runtime --engine: also profile each N by operator type (verify_cost_ops.md)",
    )
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


TIMED_PER_TURN = 3  # calls of one width timed one after another, after an untimed first


def interleaved_curve(
    steps: dict[tuple[str | None, int], Callable[[], None]],
    device,
    batch: int,
    repeats: int,
    progress,
    check: Callable[[], None],
) -> list[dict]:
    """Median milliseconds of each N's step (``steps``: (variant, N) -> one call of N new tokens over the context; a
    variant is a MatMul kernel, or None), the steps taking turns within each round (a slower stretch of a shared
    machine then lands on every N and variant alike); ``check`` after every call (the cache back at the context's
    length). A turn is one untimed call, then ``TIMED_PER_TURN`` timed ones, as a
    decoding loop at a fixed tree calls its target with one width cycle after cycle (on SmolLM2's ONNX Runtime engine,
    one call per turn measured an 8-token step at 1024 tokens of context at 1.74 one-token steps, three per turn at
    1.41-1.53). The first two rounds warm up each shape and are not timed."""
    from specdec_kit.runtime.core.device import synchronize

    samples: dict[tuple[str | None, int], list[float]] = {key: [] for key in steps}
    for r in range(repeats + 2):
        for key, step in steps.items():
            for call in range(1 + TIMED_PER_TURN):
                synchronize(device)
                start = time.perf_counter()
                step()
                synchronize(device)
                if r > 1 and call:
                    samples[key].append((time.perf_counter() - start) * 1000)
                check()
        progress.update(1)
    first: dict[str | None, float] = {}  # each variant's median at its smallest N
    for variant, n in sorted(steps, key=lambda key: key[1]):
        first.setdefault(variant, statistics.median(samples[(variant, n)]))
    return [
        {
            "batch": batch,
            "tokens": n,
            "matmul": variant,
            "ms": statistics.median(times),
            "ms_min": min(times),
            "ms_max": max(times),
            "ratio_to_first": statistics.median(times) / first[variant],
        }
        for (variant, n), times in samples.items()
    ]


def time_curve(model, context: int, tokens: list[int], batch: int, repeats: int, progress) -> list[dict]:
    """Median milliseconds of one forward of N new tokens over a cache of ``context`` tokens, for each N (a
    ``transformers`` model; the cache cut back to the context after each call)."""
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    cache = DynamicCache()

    def step(n: int) -> Callable[[], None]:
        new = torch.randint(vocab, (batch, n), generator=gen).to(device)
        positions = torch.arange(context, context + n, device=device).expand(batch, n)

        def call() -> None:
            model(input_ids=new, position_ids=positions, past_key_values=cache, use_cache=True)
            cache.crop(-n)  # back to the context

        return call

    def check() -> None:
        if cache.get_seq_length() != context:
            raise RuntimeError(f"the KV cache holds {cache.get_seq_length()} tokens after a step, not {context}")

    with torch.inference_mode():
        model(input_ids=torch.randint(vocab, (batch, context), generator=gen).to(device), past_key_values=cache)
        return interleaved_curve({(None, n): step(n) for n in tokens}, device, batch, repeats, progress, check)


PROFILED_CALLS = 10  # calls of each width under ONNX Runtime's profiler (``--ops``), after the timed rounds


def time_engine_curve(
    targets: dict[str | None, Any],
    context: int,
    tokens: list[int],
    batch: int,
    repeats: int,
    progress,
    operators: dict | None = None,
) -> list[dict]:
    """``time_curve`` for an engine's target step (``TargetStep``; ``targets``: variant -> the step, several where
    kernels take turns): a cache of ``context`` committed tokens, then each call's N tokens written into the slots
    past them (causal among themselves) and left uncommitted, so every call reads the same context. With
    ``operators`` (a dict to fill), each step then runs ``PROFILED_CALLS`` times under ONNX Runtime's profiler, its
    operator times kept under (variant, batch, N)."""
    import torch

    target = next(iter(targets.values()))
    device, vocab = target.device, target.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    cache = target.new_cache(batch, context + max(tokens))

    def causal(n: int) -> torch.Tensor:
        ar = torch.arange(n, device=device)
        return (ar[None, :] <= ar[:, None]).expand(batch, n, n)

    def step(variant: str | None, n: int) -> Callable[[], None]:
        new = torch.randint(vocab, (batch, n), generator=gen).to(device)
        positions = torch.arange(context, context + n, device=device).expand(batch, n)
        mask = causal(n)
        return lambda: targets[variant](new, positions, mask, cache)

    def check() -> None:
        if int(cache.lengths.max()) != context:
            raise RuntimeError(f"the KV cache holds {int(cache.lengths.max())} tokens after a step, not {context}")

    with torch.inference_mode():
        prefix = torch.randint(vocab, (batch, context), generator=gen).to(device)
        places = torch.arange(context, device=device).expand(batch, context)
        target(prefix, places, causal(context), cache, logits_at=torch.full((batch, 1), context - 1, device=device))
        cache.commit(places, torch.full((batch,), context, device=device))
        steps = {(variant, n): step(variant, n) for variant in targets for n in tokens}
        points = interleaved_curve(steps, device, batch, repeats, progress, check)
        if operators is not None:
            for (variant, n), call in steps.items():
                operators[(variant, batch, n)] = profiled_operators(targets[variant].graph, variant, call, check)
        return points


def kernels_switched(variant: str | None) -> contextlib.AbstractContextManager:
    """What the sessions of a kernel set (``--matmul``) open under; None: the engine as it opens."""
    from specdec_kit.runtime.ort.custom_ops import packed_matmul_switched

    if variant is None:
        return contextlib.nullcontext()
    return packed_matmul_switched(variant != "onnxruntime", tree_attention=variant == "packed")


def profiled_operators(graph, variant: str | None, call: Callable[[], None], check: Callable[[], None]) -> dict:
    """One step's operator times (``cycle_profile.operator_times``) over ``PROFILED_CALLS`` calls of it. The
    profiler needs a session of its own, opened (and the plain one reopened after) with the step's kernel set."""
    import tempfile

    from specdec_kit.bench.cycle_profile import operator_times

    with tempfile.TemporaryDirectory() as traces:
        with kernels_switched(variant):
            graph.profile_nodes(str(Path(traces) / "step"))  # its first call is left out
        for _ in range(1 + PROFILED_CALLS):
            call()
            check()
        with kernels_switched(variant):
            trace = graph.end_node_profile()
        return operator_times(trace, skip_runs=1)


MATMUL_KERNELS = ("packed", "packed-matmul-only", "onnxruntime")


def engine_targets(path: Path, device: str | None, matmul: str | None) -> tuple[str, dict[str | None, Any]]:
    """The engine's backend and its target step, opened once per kernel set of ``matmul`` (``packed``: the kit's
    ``PackedMatMul`` and ``TreeAttention``; ``packed-matmul-only``: the kit's MatMul beside ONNX Runtime's Attention;
    ``onnxruntime``: ONNX Runtime's own), or once as it opens (None)."""
    from specdec_kit.runtime.engine import open_engine

    if not matmul:
        engine = open_engine(path, device=device)
        return engine.backend, {None: engine.target}
    kernels = [k.strip() for k in matmul.split(",")]
    unknown = [k for k in kernels if k not in MATMUL_KERNELS]
    if unknown or len(set(kernels)) != len(kernels):
        raise ValueError(f"--matmul {matmul!r}: expected distinct kernels of {', '.join(MATMUL_KERNELS)}")
    targets = {}
    for kernel in kernels:
        with kernels_switched(kernel):
            target = open_engine(path, device=device).target
        graph = getattr(target, "graph", None)
        if graph is None:
            raise ValueError(f"--matmul: {path} is not an ONNX Runtime engine")
        if kernel != "onnxruntime" and graph.packed_matmul != "on":
            raise ValueError(f"--matmul {kernel}: {path}'s target step cannot run it ({graph.packed_matmul})")
        targets[kernel] = target
    return "onnxruntime", targets


def write_results(result: dict, out: Path) -> None:
    from specdec_kit.plots import pyplot

    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps(result, indent=1))
    first = result["tokens"][0]
    variants = sorted({r.get("matmul") for r in result["points"]}, key=str)
    kernel_column = variants != [None]
    lines = [
        f"# Verification cost: {result['model']}, {result['device_name']}, {result['dtype']}, context {result['context']}",
        "",
        f"| batch |{' kernels |' if kernel_column else ''} N new tokens | ms (median) | t(N) / t({first}) |",
        f"|---:|{'---|' if kernel_column else ''}---:|---:|---:|",
    ]
    for r in result["points"]:
        kernel = f" {r.get('matmul')} |" if kernel_column else ""
        lines.append(f"| {r['batch']} |{kernel} {r['tokens']} | {r['ms']:.2f} | {r['ratio_to_first']:.2f} |")
    (out / "verify_cost.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for batch in result["batches"]:
        for variant in variants:
            pts = [r for r in result["points"] if r["batch"] == batch and r.get("matmul") == variant]
            label = f"batch {batch}" + (f", {variant}" if kernel_column else "")
            ax.plot([r["tokens"] for r in pts], [r["ms"] for r in pts], marker=".", label=label)
    ax.set_xlabel("new tokens checked in one step (N)")
    ax.set_ylabel("ms per step (median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"{result['model']} on {result['device_name']}, {result['dtype']}, context {result['context']}")
    fig.tight_layout()
    fig.savefig(out / "verify_cost.png", dpi=120)
    plt.close(fig)


def operator_growth_table(result: dict) -> list[str]:
    """Per kernel set and batch, each operator type's milliseconds a call at every N (ONNX Runtime's profiler) and
    what it adds from the first N to the last, the largest growth first; a last row sums them."""
    lines = [
        f"# Verification cost by operator: {result['model']}, {result['device_name']}, context {result['context']}, "
        f"{PROFILED_CALLS} profiled calls of each N (the profiler inflates small operators: read the growth)",
    ]
    groups: dict[tuple, dict[int, dict]] = {}
    for found in result["operators"]:
        groups.setdefault((found["matmul"], found["batch"]), {})[found["tokens"]] = found["operators"]
    for (variant, batch), by_n in groups.items():
        ns = sorted(by_n)
        first, last = ns[0], ns[-1]
        names = sorted({op for ops in by_n.values() for op in ops})

        def ms(n: int, op: str) -> float:
            return by_n[n].get(op, {}).get("ms", 0.0)

        names.sort(key=lambda op: -(ms(last, op) - ms(first, op)))
        title = f"batch {batch}" + (f", kernels {variant}" if variant else "")
        lines += [
            "",
            f"## {title}",
            "",
            "| operator | nodes | " + " | ".join(f"N={n}: ms" for n in ns) + f" | N={last} - N={first} |",
            "|---|---:|" + "---:|" * (len(ns) + 1),
        ]
        for op in names:
            nodes = max(by_n[n].get(op, {}).get("nodes", 0) for n in ns)
            cells = " | ".join(f"{ms(n, op):.2f}" for n in ns)
            lines.append(f"| {op} | {nodes} | {cells} | {ms(last, op) - ms(first, op):+.2f} |")
        totals = [sum(ms(n, op) for op in names) for n in ns]
        cells = " | ".join(f"**{t:.2f}**" for t in totals)
        lines.append(f"| **all** | | {cells} | **{totals[-1] - totals[0]:+.2f}** |")
    return lines


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from specdec_kit.runtime.core.device import resolve_device, resolve_dtype

    tokens = parse_tokens(args.tokens)
    batches = [int(b) for b in args.batch.split(",")]
    operators: dict | None = {} if args.ops else None  # (kernel set, batch, N) -> operator times, filled by the curve
    if args.engine is not None:
        from specdec_kit.runtime.loader import set_threads

        set_threads()
        backend, targets = engine_targets(args.engine, args.device, args.matmul)
        if args.ops and backend != "onnxruntime":
            raise ValueError(f"--ops profiles ONNX Runtime's operators: {args.engine} is a {backend} engine")
        engine_target = next(iter(targets.values()))
        device, dtype, params = engine_target.device, engine_target.dtype, None
        model = f"engine {args.engine.name} ({backend} target step)"
        print(f"{model}: timing on {device} ({dtype})", file=sys.stderr)

        def curve(batch: int, progress) -> list[dict]:
            return time_engine_curve(targets, args.context, tokens, batch, args.repeats, progress, operators)
    else:
        if args.matmul or args.ops:
            raise ValueError(
                f"{'--matmul' if args.matmul else '--ops'} applies to an engine's target step: give --engine too"
            )
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        print(f"{args.shape}: building with random weights on {device} ({dtype})", file=sys.stderr)
        built = build_model(args.shape, device, dtype)
        params = sum(p.numel() for p in built.parameters())
        model = f"{args.shape} (random weights)"

        def curve(batch: int, progress) -> list[dict]:
            return time_curve(built, args.context, tokens, batch, args.repeats, progress)

    points = []
    rounds = (args.repeats + 2) * len(batches)
    with tqdm(total=rounds, desc="verify cost", unit="round", file=sys.stderr) as progress:
        for batch in batches:
            points += curve(batch, progress)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    result = {
        "shape": None if args.engine else args.shape,
        "engine": str(args.engine) if args.engine else None,
        "model": model,
        "parameters": params,
        "device": str(device),
        "device_name": name,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "context": args.context,
        "repeats": args.repeats,
        "tokens": tokens,
        "batches": batches,
        "matmul": args.matmul,
        "points": points,
    }
    if operators is not None:
        result["operators"] = [
            {"matmul": variant, "batch": batch, "tokens": n, **found}
            for (variant, batch, n), found in operators.items()
        ]
    write_results(result, args.out)
    print((args.out / "verify_cost.md").read_text())
    if operators is not None:
        table = "\n".join(operator_growth_table(result)) + "\n"
        (args.out / "verify_cost_ops.md").write_text(table)
        print(table)
    print(
        f"wrote {args.out}/verify_cost.json, .md, .png" + (", _ops.md" if operators is not None else ""),
        file=sys.stderr,
    )
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
