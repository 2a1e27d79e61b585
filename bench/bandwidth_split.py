"""A benchmark's speedups split by the memory-bandwidth state the machine was in at each prompt.

On a shared CPU the bandwidth a process gets sits in a few states for minutes at a time (on SmolLM2's 2 cores, copies
at 40-50 or 70-80 GB/s), and a plain decoding step, bound by it, is fast in one and slow in the other: one row's
median over prompts from both states says little. Each prompt's turns carry the copy GB/s measured before them
(``speedup.measure``); where a run saw two states, each row also gets its speedup in each.
"""

from __future__ import annotations

import math
import statistics


def copy_samples(results: dict) -> list[float]:
    """The copy GB/s of every run in a benchmark's ``results`` ({(set, T, method): {key: run}}): each prompt's once per
    method, as its runs carry it."""
    return [run["copy_gbs"] for runs in results.values() for run in runs.values() if "copy_gbs" in run]


def split_point(samples: list[float], least_gap: float = 1.3) -> float | None:
    """The copy GB/s between a run's two states: the geometric middle of the widest gap between consecutive samples
    (sorted), where that gap is a ratio of at least ``least_gap``; None where the run saw one state."""
    ordered = sorted(s for s in samples if s > 0)
    if len(ordered) < 2:
        return None
    low, high = max(zip(ordered, ordered[1:]), key=lambda pair: pair[1] / pair[0])
    return math.sqrt(low * high) if high / low >= least_gap else None


def by_state(runs: dict, plain: dict, split: float) -> list[dict]:
    """A row's speedup in each state: over its prompts (keys shared with ``plain``'s runs) below and above ``split``,
    how many, their median copy GB/s and their median speedup (None for a state none of them ran in)."""
    out = []
    for state, inside in (("below", lambda g: g < split), ("above", lambda g: g >= split)):
        keys = [k for k, r in runs.items() if k in plain and "copy_gbs" in r and inside(r["copy_gbs"])]
        out.append(
            {
                "state": state,
                "split_gbs": round(split, 1),
                "prompts": len(keys),
                "copy_gbs": round(statistics.median(runs[k]["copy_gbs"] for k in keys), 1) if keys else None,
                "speedup": statistics.median(runs[k]["tps"] / plain[k]["tps"] for k in keys) if keys else None,
            }
        )
    return out


def state_table(rows: list[dict]) -> list[str]:
    """Markdown lines: each row's speedup below and above the run's split (empty where no row has states)."""
    split_rows = [r for r in rows if r.get("by_bandwidth")]
    if not split_rows:
        return []
    split = split_rows[0]["by_bandwidth"][0]["split_gbs"]

    def cell(state: dict) -> str:
        if state["speedup"] is None:
            return "-"
        return f"{state['speedup']:.2f}x ({state['prompts']} at {state['copy_gbs']:.0f} GB/s)"

    lines = [
        "",
        f"By the machine's memory-bandwidth state (a copy's GB/s before each prompt's turns, split at {split:.0f}):",
        "",
        f"| prompts | T | method | speedup below {split:.0f} GB/s | speedup above {split:.0f} GB/s |",
        "|---|---|---|---|---|",
    ]
    for r in split_rows:
        below, above = r["by_bandwidth"]
        lines.append(f"| {r['prompt_set']} | {r['temperature']:g} | {r['method']} | {cell(below)} | {cell(above)} |")
    return lines
