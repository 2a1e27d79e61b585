"""The work of the speedup benchmark; what it measures, how, and its
options are in ``speedup_cli.py`` (the command line, parsed before torch loads)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdec_kit.bench.bandwidth_split import by_state, copy_samples, split_point
from specdec_kit.bench.decoding_phase import decode_speedup
from specdec_kit.bench.methods import SPEEDUP_METHODS as METHODS
from specdec_kit.bench.per_prompt import by_prompt
from specdec_kit.bench.report import write_all
from specdec_kit.data import prompts as prompt_sets
from specdec_kit.paths import default_zoo
from specdec_kit.runtime.core.cpu import cpu_description
from specdec_kit.runtime.core.memory_bandwidth import copy_bandwidth_gbs
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.drafting import NoDrafter
from specdec_kit.runtime.decoding.generate import RequestStats, SpeculativeGenerator
from specdec_kit.runtime.heap import CollectionClock, freeze_heap
from specdec_kit.runtime.loader import default_tree, load_tokenizer, make_drafter, set_threads
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.train.corpus import heldout_prompts


def median(values):
    return statistics.median(values) if values else 0.0


class HFPeers:
    """The ``transformers`` decoders on the same target, timed the same way."""

    def __init__(self, target: TargetModel, zoo: Path):
        from transformers import AutoModelForCausalLM

        self.hf = target.hf_model
        self.assistant = None
        if (zoo / "draft_lm" / "config.json").is_file():
            self.assistant = AutoModelForCausalLM.from_pretrained(zoo / "draft_lm", dtype=target.dtype).eval()

    def run(self, name: str, ids: list[int], max_new: int, params: SamplingParams) -> tuple[int, float]:
        import time

        x = torch.tensor([ids], device=self.hf.device)
        kwargs = dict(
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=not params.greedy,
            pad_token_id=self.hf.generation_config.pad_token_id or 0,
        )
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
            torch.manual_seed(params.seed or 0)
        if name == "hf_assisted":
            if self.assistant is None:
                raise ValueError("the zoo has no draft_lm for assisted generation")
            kwargs["assistant_model"] = self.assistant
        elif name == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        t0 = time.perf_counter()
        out = self.hf.generate(x, **kwargs)
        return int(out.shape[1] - x.shape[1]), time.perf_counter() - t0


def run(args) -> int:
    args.zoo = args.zoo or default_zoo()
    if args.smoke:
        args.prompts, args.max_new_tokens, args.repeats = 2, 12, 1
    set_threads()
    target = TargetModel.from_pretrained(args.zoo / "target")
    tokenizer = load_tokenizer(args.zoo / "target")
    generators = {"plain": SpeculativeGenerator(target, NoDrafter())}
    dynamic = DynamicTreeConfig(total_tokens=args.total_tokens, depth=args.depth, top_k=args.top_k)
    names = [m for m in args.methods.split(",") if m] or [m for m, (_, f) in METHODS.items() if (args.zoo / f).is_dir()]
    for name in names:
        if name not in METHODS:
            raise SystemExit(f"unknown method {name!r}; expected one of {list(METHODS)}")
        kind, folder = METHODS[name]
        tree = default_tree(kind, dynamic, args.medusa_tree)
        generators[name] = SpeculativeGenerator(target, make_drafter(target, kind, args.zoo / folder, tree))
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    hf = HFPeers(target, args.zoo) if peers else None
    sets = {}
    for name in args.prompt_sets.split(","):
        texts = {
            "humaneval": lambda: prompt_sets.humaneval(args.prompts),
            "spec_bench": lambda: prompt_sets.spec_bench(args.spec_bench, args.prompts),
            "heldout": lambda: heldout_prompts(args.prompts),
        }[name]()
        sets[name] = [tokenizer(t)["input_ids"][-512:] for t in texts]
    temps = [float(t) for t in args.temperatures.split(",")]
    names = list(generators) + peers
    results = measure(generators, sets, temps, args.repeats, args.max_new_tokens, hf, peers)
    rows = summarize(results, names)
    meta = {
        "prompts_per_set": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "tree": {"total_tokens": args.total_tokens, "depth": args.depth, "top_k": args.top_k},
    }
    write_all(rows, args.out, machine(results), meta)
    print((args.out / "results.md").read_text())
    return 0


def matmul_kernel() -> str:
    """Which products an ONNX Runtime engine's float MatMuls, 8-bit draft products and attention run here: the kit's
    ``PackedMatMul``, ``Int8MatMul`` and ``TreeAttention`` or ONNX Runtime's own (and why), since they move a step's,
    a draft's and a tree's cost."""
    from specdec_kit.runtime.ort.custom_ops import (
        ATTENTION_SWITCH_ENV,
        custom_op_library,
        int8_matmul_vectorized,
        tree_attention_enabled,
    )

    ops = custom_op_library()
    if not ops.library:
        return f"float MatMuls by ONNX Runtime ({ops.reason})"
    attention = "its TreeAttention" if tree_attention_enabled() else f"ONNX Runtime ({ATTENTION_SWITCH_ENV}=0)"
    int8 = "its Int8MatMul" if int8_matmul_vectorized() else "ONNX Runtime (no AVX-512 VNNI)"
    return f"float MatMuls by the kit's PackedMatMul, 8-bit draft products by {int8}, attention by {attention}"


def machine(results: dict | None = None) -> str:
    """The machine, and (given a run's ``results``) the memory bandwidth a copy got during it: on a shared CPU plain
    decoding's speed, and so every speedup, moves with it."""
    described = (
        f"{cpu_description()}, {torch.get_num_threads()} threads, "
        f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'}, torch {torch.__version__}"
    )
    if not torch.cuda.is_available():
        described += f", {matmul_kernel()}"
    samples = copy_samples(results or {})
    if samples:
        described += (
            f"; memory copy {min(samples):.0f}-{max(samples):.0f} GB/s over the run "
            f"(median {statistics.median(samples):.0f})"
        )
    runs = [r for runs in (results or {}).values() for r in runs.values() if "gc_s" in r]
    if runs:
        described += (
            f"; garbage collection {1000 * sum(r['gc_s'] for r in runs):.0f} ms inside the {len(runs)} timed requests "
            f"({sum(r['full_gcs'] for r in runs)} full collections)"
        )
    return described


def measure(
    generators: dict[str, SpeculativeGenerator],
    sets: dict[str, list[list[int]]],
    temps: list[float],
    repeats: int,
    max_new_tokens: int,
    hf: HFPeers | None = None,
    peers: list[str] = (),
    sets_take_turns: bool = False,
) -> dict:
    """Every prompt of every set, one at a time (batch 1), by every method, at every temperature, ``repeats``
    times; methods interleaved per prompt in a rotating order, each warmed once first so none pays first-call costs.
    ``sets_take_turns``: the sets' prompts and the temperatures take turns too (a set's i-th prompt at each
    temperature, then the next set's), so that every row meets the shared machine's memory-bandwidth states alike; set
    after set, one set's rows can run in one state and the next's in another (SmolLM2's chat rows at 76-78 GB/s,
    HumanEval's at 46 in one run). Returns {(set, T, method): {(prompt index, repeat): measurements}}; a prompt's seed
    is the same for every method."""
    names = list(generators) + list(peers)
    results: dict = {}
    total = sum(len(v) for v in sets.values()) * len(temps) * repeats * len(names)
    bar = tqdm(total=total, desc="benchmark", file=sys.stderr)
    warm = sets[next(iter(sets))][0]
    for method in names:
        if method in generators:
            generators[method].generate([warm], 4)
        else:
            hf.run(method, warm, 4, SamplingParams())
    freeze_heap()  # start-up's objects out of the collector's walks, as a server's are (``runtime/heap.py``)
    with CollectionClock() as clock:
        for set_name, temp, rep, i in turns(sets, temps, repeats, sets_take_turns):
            ids = sets[set_name][i]
            params = SamplingParams(temperature=temp, seed=1000 * rep + i)
            order = names[i % len(names) :] + names[: i % len(names)]  # rotate: interleaved
            gbs = copy_bandwidth_gbs()  # the machine's state for this prompt's turns (``memory_bandwidth``)
            for method in order:
                collected, full, started = clock.seconds, clock.full, time.perf_counter()
                if method in generators:
                    result = generators[method].generate([ids], max_new_tokens, params)[0]
                    st = result.stats
                    run = {"tps": st.tokens_per_s, "tokens": st.generated_tokens, "total_s": st.total_s, "stats": st}
                    run["output"] = list(result.tokens)  # the answer itself (``copy_ceiling`` counts what it copies)
                else:
                    n, secs = hf.run(method, ids, max_new_tokens, params)
                    run = {"tps": n / secs, "tokens": n, "total_s": secs}
                run.update(
                    copy_gbs=gbs,
                    gc_s=clock.seconds - collected,
                    full_gcs=clock.full - full,
                    span=(started, time.perf_counter()),  # when it ran: what a drafter logged in it falls inside
                )
                results.setdefault((set_name, temp, method), {})[(i, rep)] = run
                bar.update(1)
    bar.close()
    return results


def turns(
    sets: dict[str, list[list[int]]], temps: list[float], repeats: int, sets_take_turns: bool
) -> list[tuple[str, float, int, int]]:
    """The order ``measure`` runs (set, temperature, repeat, prompt index) in: set after set, each temperature and
    repeat in turn over its prompts; or, taking turns, repeat after repeat, prompt index after index, every set at
    every temperature."""
    if not sets_take_turns:
        return [
            (name, temp, rep, i)
            for name, prompts in sets.items()
            for temp in temps
            for rep in range(repeats)
            for i in range(len(prompts))
        ]
    longest = max((len(prompts) for prompts in sets.values()), default=0)
    return [
        (name, temp, rep, i)
        for rep in range(repeats)
        for i in range(longest)
        for name, prompts in sets.items()
        if i < len(prompts)
        for temp in temps
    ]


def summarize(results: dict, names: list[str]) -> list[dict]:
    rows = []
    split = split_point(copy_samples(results))
    for (set_name, temp, method), runs in sorted(
        results.items(), key=lambda kv: (kv[0][0], kv[0][1], names.index(kv[0][2]))
    ):
        plain = results[(set_name, temp, "plain")]
        ratios = [r["tps"] / plain[k]["tps"] for k, r in runs.items() if k in plain]
        row = {
            "prompt_set": set_name,
            "temperature": temp,
            "method": method,
            "requests": len(runs),
            "tokens_per_s": median([r["tps"] for r in runs.values()]),
            "speedup": median(ratios),
            # the same ratio over the decoding phase alone (each prompt's prefill, the same for every method, left out):
            # what a serving team reads as time per output token, where speculation acts; the end-to-end speedup adds
            # the prefill to both sides, so long prompts and short answers pull it toward 1
            "decode_speedup": decode_speedup(runs, plain),
            "copy_gbs": round(median([r["copy_gbs"] for r in runs.values() if "copy_gbs" in r]), 1),
            "acceptance_length": None,
            "bound": None,
            "draft_ms": None,  # the draft's time per speculative cycle
            "verify_ms": None,  # the target's verification time per cycle
            "acceptance_per_depth": [],
        }
        if split is not None and method != "plain":
            row["by_bandwidth"] = by_state(runs, plain, split)
        if method != "plain":
            row["by_prompt"] = by_prompt(runs, plain)
        if "stats" in next(iter(runs.values())) and method != "plain":
            pooled = RequestStats.combined([r["stats"] for r in runs.values()])
            tau = pooled.acceptance_length
            depth = [a / pooled.cycles for a in pooled.accepted_per_depth] if pooled.cycles else []
            t_plain = median([r["total_s"] / r["tokens"] for r in plain.values()])
            t_cycle = (pooled.draft_s + pooled.verify_s) / pooled.cycles if pooled.cycles else 0.0
            row.update(
                acceptance_length=tau,
                acceptance_per_depth=depth,
                bound=tau * t_plain / t_cycle if t_cycle else None,
                draft_ms=1000 * pooled.draft_s / pooled.cycles if pooled.cycles else None,
                verify_ms=1000 * pooled.verify_s / pooled.cycles if pooled.cycles else None,
            )
        rows.append(row)
    return rows


if __name__ == "__main__":  # the command line lives in the light module, which runs this one
    from specdec_kit.bench.speedup_cli import main

    sys.exit(main())
