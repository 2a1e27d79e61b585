"""The decoding phase's speedup over plain decoding: each request's prefill, the same for every method, left out.

The end-to-end ratio adds the prompt's reading to both sides, so long prompts and short answers pull it toward 1; the
decoding phase's is what a serving team reads as time per output token, where speculation acts.
"""

from __future__ import annotations

from statistics import median


def decode_speedup(runs: dict, plain: dict) -> float | None:
    """The median over prompts of plain decoding's seconds per generated token over the method's, the prompt's prefill
    left out of both; None where the runs carry no per-request stats (a reference run timed from outside)."""
    ratios = [
        plain[k]["stats"].decode_s_per_token / r["stats"].decode_s_per_token
        for k, r in runs.items()
        if k in plain and "stats" in r and "stats" in plain[k] and r["stats"].decode_s_per_token > 0
    ]
    return median(ratios) if ratios else None
