"""A benchmark row's speedup prompt by prompt: where a set's median sits and why.

A set's median hides its spread. Spec-Bench's held-out prompts are two populations: summaries and RAG questions of
600-800 tokens, whose prefill (the same for every method) is a fifth to a third of plain decoding's request and whose
cycles verify over a long cache, and short questions, whose ratios spread with the head's acceptance alone; the
set's median is whichever prompt ranks in the middle. The table gives each prompt's size, its prefill's share of
plain decoding's time, both ratios and tau.
"""

from __future__ import annotations

from statistics import median

from specdec_kit.bench.decoding_phase import decode_speedup


def median_or_none(values) -> float | None:
    """The median, or None where nothing was measured."""
    values = list(values)
    return median(values) if values else None


def by_prompt(runs: dict, plain: dict) -> list[dict]:
    """Per prompt of a method's runs ({(prompt, repeat): run}, as ``speedup.measure`` keeps them), the medians over
    its repeats: tokens, the prefill's share of plain decoding's request, the end-to-end and decoding-phase ratios to
    plain decoding, and tau (pooled). Empty where the runs carry no per-request stats (a reference timed from
    outside)."""
    from specdec_kit.runtime.decoding.generate import RequestStats

    out = []
    for prompt in sorted({i for i, _ in runs}):
        keys = [k for k in runs if k[0] == prompt and k in plain and "stats" in runs[k] and "stats" in plain[k]]
        if not keys:
            continue
        mine, theirs = [runs[k]["stats"] for k in keys], [plain[k]["stats"] for k in keys]
        out.append(
            {
                "prompt": prompt,
                "prompt_tokens": mine[0].prompt_tokens,
                "generated_tokens": median(s.generated_tokens for s in mine),
                "prefill_share": median_or_none(p.prefill_s / p.total_s for p in theirs if p.total_s > 0),
                "speedup": median(runs[k]["tps"] / plain[k]["tps"] for k in keys),
                "decode_speedup": decode_speedup({k: runs[k] for k in keys}, plain),
                "acceptance_length": RequestStats.combined(mine).acceptance_length or None,
            }
        )
    return out


def per_prompt_table(rows: list[dict]) -> str:
    """Every row's prompts as one markdown table (empty where no row has them)."""
    lines = [
        "| prompts | T | method | prompt | prompt tokens | generated | prefill share of plain | speedup "
        "| decoding alone | tau |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for p in r.get("by_prompt") or []:
            tau = f"{p['acceptance_length']:.2f}" if p["acceptance_length"] else "-"
            share = "-" if p["prefill_share"] is None else f"{p['prefill_share']:.0%}"
            decoding = "-" if p["decode_speedup"] is None else f"{p['decode_speedup']:.2f}x"
            lines.append(
                f"| {r['prompt_set']} | {r['temperature']:g} | {r['method']} | {p['prompt']} | {p['prompt_tokens']} "
                f"| {p['generated_tokens']:g} | {share} | {p['speedup']:.2f}x | {decoding} | {tau} |"
            )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""
