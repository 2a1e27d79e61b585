"""``specdec-profile-cycle``: where a batched decoding cycle's time goes, at batch 1, 4 and 16.

Runs the runtime's own generation loop (the loop the server's scheduler drives) over an engine, the rows in lockstep,
under ``cProfile``, and sorts every function's own time into the stages of a cycle: the ONNX Runtime (or PyTorch)
target and draft calls, the past keys/values gathered into graph inputs, attention masks, KV writes and
compaction, the draft tree's search, verification, the per-row bookkeeping in Python, and the rest. A torch or
ONNX Runtime builtin counts toward the stage of the runtime function that called it. The table gives
milliseconds per cycle and shares; it says where to work, the benchmarks say what it gained. ``--ops`` adds a pass
under ONNX Runtime's own profiler: each graph's time per call by operator type, with the nodes a call runs (the
profiler's own cost inflates the small ones, so read shares, not sums).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

# (module path suffix, function name or "*") -> stage; the first match wins. Builtins take their caller's stage.
STAGES: list[tuple[str, str, str]] = [
    ("runtime/ort/backend.py", "_run_over_cache", "KV cache: writes, masks"),
    ("runtime/ort/backend.py", "*", "graph calls (Python side)"),
    ("runtime/core/kv_cache.py", "commit", "KV cache: commit (compaction)"),
    ("runtime/core/kv_cache.py", "_move_listed", "KV cache: commit (compaction)"),
    ("runtime/core/kv_cache.py", "_move_gathered", "KV cache: commit (compaction)"),
    ("runtime/core/kv_cache.py", "advance", "KV cache: commit (compaction)"),
    ("runtime/core/kv_cache.py", "select_rows", "KV cache: rows joining/leaving"),
    ("runtime/core/kv_cache.py", "extend_rows", "KV cache: rows joining/leaving"),
    ("runtime/core/kv_cache.py", "*", "KV cache: writes, masks"),
    ("runtime/decoding/drafting.py", "*", "draft tree search"),
    ("runtime/core/trees.py", "*", "draft tree search"),
    ("runtime/core/verify.py", "*", "verification"),
    ("runtime/core/sampling.py", "*", "verification"),
    ("runtime/decoding/generate.py", "_account", "per-row bookkeeping"),
    ("runtime/decoding/generate.py", "_emit", "per-row bookkeeping"),
    ("runtime/decoding/generate.py", "_emit_guarded", "per-row bookkeeping"),
    ("runtime/decoding/generate.py", "_next_indices", "per-row bookkeeping"),
    ("runtime/decoding/generate.py", "retire", "per-row bookkeeping"),
    ("runtime/decoding/generate.py", "*", "cycle glue"),
    ("runtime/models/target.py", "*", "target forward (PyTorch)"),
    ("runtime/drafts/", "*", "draft forward (PyTorch)"),
]
SESSION_RUN = "run_with_iobinding"  # ONNX Runtime's call: its time is the graphs' own compute


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="specdec-profile-cycle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--engine",
        type=Path,
        help="engine directory (default: the demo zoo's GRIFFIN ONNX Runtime engine, built under --engines if missing)",
    )
    p.add_argument("--engines", type=Path, default=Path("engines"))
    p.add_argument("--batches", default="1,4,16", help="batch sizes")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--plain", action="store_true", help="profile plain decoding (no draft) through the same loop")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every row (0: greedy); sampled rows draw with seeds 0, 1, ...",
    )
    p.add_argument(
        "--ops", action="store_true", help="also profile each graph by operator type (ONNX Runtime's profiler)"
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/cycle_profile"))
    return p.parse_args(argv)


def stage_of(filename: str, func: str) -> str | None:
    if SESSION_RUN in func:
        return "ONNX Runtime graph compute"
    path = filename.replace("\\", "/")
    for suffix, name, stage in STAGES:
        if suffix in path and name in ("*", func):
            return stage
    return None


def attribute(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per stage. A runtime function's own time goes to its stage; the time of a builtin or a library
    function goes, caller by caller, to the stage its caller resolves to (a library function resolves to the stage of
    its heaviest caller, recursively). ONNX Runtime's session calls are the graphs' compute; the copy that makes the
    past keys/values one contiguous input is its own stage."""
    resolved: dict[tuple, str] = {}

    def resolve(key: tuple, seen: frozenset = frozenset()) -> str:
        if key in resolved:
            return resolved[key]
        own = stage_of(key[0], key[2])
        if own is None:
            callers = stats.stats.get(key, (0, 0, 0, 0, {}))[4]
            heaviest = max(callers.items(), key=lambda kv: kv[1][3], default=None)
            if heaviest is None or heaviest[0] in seen:
                own = "other (libraries, interpreter)"
            else:
                own = resolve(heaviest[0], seen | {key})
        resolved[key] = own
        return own

    out: dict[str, float] = {}
    for key, (_, _, tottime, _, callers) in stats.stats.items():
        own = stage_of(key[0], key[2])
        if own is not None or not callers:
            stage = own or "other (libraries, interpreter)"
            out[stage] = out.get(stage, 0.0) + tottime
            continue
        for caller, (_, _, share, _) in callers.items():
            stage = resolve(caller)
            if "contiguous" in key[2] and caller[2] == "run" and caller[0].endswith("ort/backend.py"):
                stage = "past K/V copied into graph inputs"
            out[stage] = out.get(stage, 0.0) + share
    return out


def engine_path(args) -> Path:
    if args.engine:
        return args.engine
    from specdec_kit.bench.engine_backends import engine_for

    return engine_for("griffin", "onnxruntime", args.engines)


def graphs_of(engine) -> dict[str, object]:
    """The engine's ONNX Runtime graphs by role (none for a PyTorch engine)."""
    from specdec_kit.runtime.ort.backend import OrtGraph

    found: dict[str, object] = {}

    def walk(obj, depth: int = 0) -> None:
        if depth > 3 or obj is None:
            return
        for value in vars(obj).values() if hasattr(obj, "__dict__") else []:
            if isinstance(value, dict):
                items = value.values()
            elif isinstance(value, (tuple, list)):  # e.g. a drafter's (draft_tree graph, its tree)
                items = value
            else:
                items = [value]
            for item in items:
                if isinstance(item, OrtGraph):
                    found[item.path.stem.removesuffix(".optimized")] = item
                elif hasattr(item, "__dict__") and type(item).__module__.startswith("specdec_kit"):
                    walk(item, depth + 1)

    walk(engine)
    return found


def split_graph_compute(by_stage: dict[str, float], graphs: dict, before: dict[str, float]) -> None:
    """Replace the graphs' total compute by each graph's, from the graphs' own timers."""
    total = by_stage.pop("ONNX Runtime graph compute", 0.0)
    for role, graph in graphs.items():
        spent = graph.seconds - before[role]
        by_stage[f"ONNX Runtime: {role}"] = spent
        total -= spent
    if total > 1e-6:
        by_stage["ONNX Runtime graph compute"] = total


def row_sampling(count: int, temperature: float) -> list:
    """Each row's sampling settings: greedy, or ``temperature`` with the row's index as its seed (reproducible)."""
    from specdec_kit.runtime.core.sampling import SamplingParams

    return [SamplingParams(temperature=temperature, seed=i if temperature > 0 else None) for i in range(count)]


def profile_batch(gen, graphs: dict, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0) -> dict:
    sampling = row_sampling(len(prompts), temperature)
    gen.generate(prompts, 8, sampling)  # warm-up: sessions, allocations
    before = {role: g.seconds for role, g in graphs.items()}
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    results = gen.generate(prompts, new_tokens, sampling)
    profiler.disable()
    wall = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    cycles = max(r.stats.cycles for r in results)
    tokens = sum(len(r.tokens) for r in results)
    by_stage = attribute(stats)
    split_graph_compute(by_stage, graphs, before)
    return {
        "batch": len(prompts),
        "cycles": cycles,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s_profiled": tokens / wall,
        "acceptance_length": sum(r.stats.acceptance_length for r in results) / len(results),
        "ms_per_cycle": {k: 1000 * v / cycles for k, v in sorted(by_stage.items(), key=lambda kv: -kv[1]) if v > 0},
        "total_ms_per_cycle": 1000 * sum(by_stage.values()) / cycles,
    }


def operator_times(trace: Path, skip_runs: int = 0) -> dict:
    """One graph's ONNX Runtime profile (Chrome trace events) as calls and, per operator type, the milliseconds and
    nodes per call, heaviest first; the first ``skip_runs`` calls left out (a new session's first run plans its
    memory)."""
    events = json.loads(trace.read_text())
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
    )
    calls = len(runs) - skip_runs
    after = runs[skip_runs - 1]["ts"] + runs[skip_runs - 1]["dur"] if 0 < skip_runs <= len(runs) else float("-inf")
    spent: dict[str, float] = {}
    nodes: dict[str, int] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e.get("ts", 0) >= after:
            op = e["args"]["op_name"]
            spent[op] = spent.get(op, 0.0) + e["dur"] / 1000
            nodes[op] = nodes.get(op, 0) + 1
    calls = max(calls, 1)
    ops = {
        op: {"ms": ms / calls, "nodes": nodes[op] // calls} for op, ms in sorted(spent.items(), key=lambda kv: -kv[1])
    }
    return {"calls": calls, "operators": ops}


def profile_operators(
    gen, graphs: dict, prompts: list[list[int]], new_tokens: int, where: Path, temperature: float = 0.0
) -> dict[str, dict]:
    """Each graph's operator times over one generation of ``prompts``."""
    for role, graph in graphs.items():
        graph.profile_nodes(str(where / role))
    gen.generate(prompts, new_tokens, row_sampling(len(prompts), temperature))
    return {role: operator_times(graph.end_node_profile()) for role, graph in graphs.items()}


def operator_table(by_graph: dict[str, dict], batch: int) -> list[str]:
    lines = []
    for role, found in by_graph.items():
        ops = found["operators"]
        total, count = sum(o["ms"] for o in ops.values()), sum(o["nodes"] for o in ops.values())
        lines += [
            f"{role} at batch {batch}: {found['calls']} calls, {count} nodes and {total:.2f} ms of node time a call",
            "",
            "| operator | ms per call (share) | nodes per call |",
            "|---|---:|---:|",
        ]
        lines += [f"| {op} | {o['ms']:.2f} ({o['ms'] / total:.0%}) | {o['nodes']} |" for op, o in ops.items()]
        lines.append("")
    return lines


def table(rows: list[dict]) -> list[str]:
    stages = []
    for r in rows:
        stages += [s for s in r["ms_per_cycle"] if s not in stages]
    head = "| stage | " + " | ".join(f"batch {r['batch']}: ms/cycle (share)" for r in rows) + " |"
    lines = [head, "|---|" + "---:|" * len(rows)]
    for s in stages:
        cells = []
        for r in rows:
            ms = r["ms_per_cycle"].get(s, 0.0)
            cells.append(f"{ms:.2f} ({ms / r['total_ms_per_cycle']:.0%})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines.append("| **total (profiled)** | " + " | ".join(f"**{r['total_ms_per_cycle']:.2f}**" for r in rows) + " |")
    lines.append(
        "| tau / tokens per s (profiled) | "
        + " | ".join(f"{r['acceptance_length']:.2f} / {r['tokens_per_s_profiled']:.0f}" for r in rows)
        + " |"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec_kit.data.prompts import humaneval
    from specdec_kit.runtime.decoding.drafting import NoDrafter
    from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
    from specdec_kit.runtime.engine import open_engine
    from specdec_kit.runtime.loader import set_threads

    set_threads()
    engine = open_engine(engine_path(args))
    gen = SpeculativeGenerator(engine.target, NoDrafter() if args.plain else engine.drafter)
    batches = [int(b) for b in args.batches.split(",")]
    texts = humaneval(max(batches))
    prompts = [engine.tokenizer(t)["input_ids"] for t in texts]
    rows = []
    for b in batches:
        print(f"profiling batch {b} ...", file=sys.stderr)
        rows.append(profile_batch(gen, graphs_of(engine), prompts[:b], args.new_tokens, args.temperature))
    lines = [
        f"Engine {engine.path.name}, {'plain' if args.plain else 'speculative'} decoding, {args.new_tokens} new "
        f"tokens per row, {f'T={args.temperature:g}' if args.temperature else 'greedy'}, rows in lockstep, cProfile "
        "(its overhead inflates Python-side stages)",
        "",
        *table(rows),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = ("plain" if args.plain else "speculative") + (f"_t{args.temperature:g}" if args.temperature else "")
    if args.ops:
        with tempfile.TemporaryDirectory() as traces:
            for row, b in zip(rows, batches):
                print(f"profiling batch {b}'s operators ...", file=sys.stderr)
                row["operators"] = profile_operators(
                    gen, graphs_of(engine), prompts[:b], args.new_tokens, Path(traces), args.temperature
                )
                lines += ["", *operator_table(row["operators"], b)]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
