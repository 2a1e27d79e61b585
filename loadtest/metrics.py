"""What one streamed completion measured, and the run's summary (pure functions; Locust-free).

Token counting works with any OpenAI-compatible server and is exact when the server helps:

* with vLLM-style ``continuous_usage_stats`` (the kit's server, vLLM) each chunk says how many tokens
  have been generated so far, so a chunk carrying k tokens counts as k;
* otherwise, if the final ``usage`` chunk arrives (``include_usage``: SGLang, trtllm-serve, OpenAI),
  the total is exact and each chunk's share is estimated from its share of the text;
* otherwise every content chunk counts as one token.

Inter-token latency is per token: a chunk that brings k tokens after a gap g records k gaps of g/k
(tokens that arrive with the first token record none).
TPOT is (E2E - TTFT) / (tokens - 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Iterable


@dataclass
class StreamRecord:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds
    e2e: float | None = None
    output_tokens: int = 0
    requested_tokens: int = 0
    finish_reason: str | None = None
    itl: list[float] = field(default_factory=list)  # seconds, one per token after the first
    acceptance_length: float | None = None  # the server's, when it reports one (kit's usage.spec_decoding)
    token_count_source: str = "chunks"
    prompt: str = ""  # what was asked (a chat message's content, or the completion prompt)
    text: str = ""  # the completion's text as received

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.e2e if self.e2e else None


def chunk_text(chunk: dict) -> str:
    out = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        out.append((delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or ""))
    return "".join(out)


def chunk_finish(chunk: dict) -> str | None:
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason"):
            return choice["finish_reason"]
    return None


class StreamMeter:
    """Feed it SSE lines as they arrive (with their arrival times); ``finish`` gives the record."""

    def __init__(self, start: float, requested_tokens: int):
        self.start, self.record = start, StreamRecord(requested_tokens=requested_tokens)
        self.done = False
        self.events: list[tuple[float, int | None, int]] = []  # (time, cumulative tokens if known, text length)
        self.final_usage: dict | None = None
        self.text_parts: list[str] = []  # the completion's text as it arrived

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def feed(self, line: str, now: float) -> None:
        line = line.strip()
        if not line or line.startswith(":") or not line.startswith("data:"):
            return
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            self.record.error = f"unparsable stream frame: {payload[:120]}"
            return
        if "error" in chunk:  # in-band error (vLLM, SGLang, the kit): a failure even inside HTTP 200
            err = chunk["error"]
            self.record.error = f"in-band error: {err.get('message', err) if isinstance(err, dict) else err}"
            return
        usage = chunk.get("usage")
        text = chunk_text(chunk)
        finish = chunk_finish(chunk)
        if finish:
            self.record.finish_reason = finish
        if isinstance(usage, dict):
            self.final_usage = usage
            spec = usage.get("spec_decoding")
            if isinstance(spec, dict) and spec.get("acceptance_length"):
                self.record.acceptance_length = spec["acceptance_length"]
        cumulative = usage.get("completion_tokens") if isinstance(usage, dict) and chunk.get("choices") else None
        if text:
            self.text_parts.append(text)
        if text or cumulative:
            self.events.append((now, cumulative, len(text)))

    def _token_counts(self) -> list[int]:
        """Tokens carried by each content event."""
        if self.events and all(c is not None for _, c, _ in self.events):
            counts, prev = [], 0
            for _, c, _ in self.events:
                counts.append(max(c - prev, 0))
                prev = max(prev, c)
            self.record.token_count_source = "continuous_usage"
            return counts
        total = (self.final_usage or {}).get("completion_tokens")
        text_events = [n for _, _, n in self.events]
        if total and sum(text_events):
            # distribute the exact total over chunks by text share (largest remainders keep the sum exact)
            shares = [total * n / sum(text_events) for n in text_events]
            counts = [int(s) for s in shares]
            for i in sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])[: total - sum(counts)]:
                counts[i] += 1
            self.record.token_count_source = "final_usage"
            return counts
        return [1 if n else 0 for n in text_events]

    def finish(self, end: float) -> StreamRecord:
        rec = self.record
        rec.e2e = end - self.start
        counts = self._token_counts()
        last = None
        for (t, _, _), k in zip(self.events, counts):
            if k <= 0:
                continue
            if rec.ttft is None:
                rec.ttft = t - self.start  # tokens that come with the first one have no gap of their own
            elif last is not None:
                rec.itl.extend([(t - last) / k] * k)
            last = t
        rec.output_tokens = sum(counts)
        rec.text = self.text
        if rec.error is None and not self.done:
            rec.error = "stream ended without data: [DONE]"
        if rec.error is None and rec.output_tokens < rec.requested_tokens and rec.finish_reason != "stop":
            rec.error = (
                f"{rec.output_tokens} tokens of the {rec.requested_tokens} asked for, finish_reason "
                f"{rec.finish_reason!r} does not explain it"
            )
        rec.ok = rec.error is None
        return rec


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(
    records: Iterable[StreamRecord], wall_s: float, ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None
) -> dict:
    """Percentiles (ms), throughput, goodput under the TTFT/TPOT targets."""
    records = list(records)
    ok = [r for r in records if r.ok]
    out: dict = {
        "requests": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "wall_s": round(wall_s, 3),
    }
    series = {
        "ttft_ms": [1000 * r.ttft for r in ok if r.ttft is not None],
        "itl_ms": [1000 * g for r in ok for g in r.itl],
        "tpot_ms": [1000 * r.tpot for r in ok if r.tpot is not None],
        "e2e_ms": [1000 * r.e2e for r in ok if r.e2e is not None],
        "output_tokens": [float(r.output_tokens) for r in ok],
        "tokens_per_s": [r.tokens_per_s for r in ok if r.tokens_per_s],
    }
    for name, values in series.items():
        out[name] = {f"p{int(q * 100)}": _round(percentile(values, q)) for q in (0.5, 0.9, 0.99)}
        out[name]["mean"] = _round(sum(values) / len(values)) if values else None
    total_tokens = sum(r.output_tokens for r in ok)
    out["output_tokens_total"] = total_tokens
    out["throughput_tokens_per_s"] = _round(total_tokens / wall_s) if wall_s else None
    out["requests_per_s"] = _round(len(ok) / wall_s) if wall_s else None
    taus = [r.acceptance_length for r in ok if r.acceptance_length]
    out["acceptance_length_mean"] = _round(sum(taus) / len(taus)) if taus else None
    good = [
        r
        for r in ok
        if (ttft_slo_ms is None or (r.ttft is not None and 1000 * r.ttft <= ttft_slo_ms))
        and (tpot_slo_ms is None or r.tpot is None or 1000 * r.tpot <= tpot_slo_ms)
    ]
    out["goodput"] = {
        "ttft_slo_ms": ttft_slo_ms,
        "tpot_slo_ms": tpot_slo_ms,
        "good_requests": len(good),
        "fraction": _round(len(good) / len(records)) if records else None,
        "requests_per_s": _round(len(good) / wall_s) if wall_s else None,
    }
    out["token_count_sources"] = sorted({r.token_count_source for r in ok})
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def record_to_row(rec: StreamRecord) -> dict:
    row = asdict(rec)
    row["itl_ms_mean"] = _round(1000 * sum(rec.itl) / len(rec.itl)) if rec.itl else None
    row.pop("itl")
    row["tpot_ms"] = _round(1000 * rec.tpot) if rec.tpot is not None else None
    return row
