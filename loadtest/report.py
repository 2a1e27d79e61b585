"""Collecting per-request records during a Locust run and writing the end-of-run report."""

from __future__ import annotations

import csv
import json
import math
import random
import threading
import time
from pathlib import Path

from specdec_kit.loadtest.metrics import StreamRecord, record_to_row, summarize


def draw_max_tokens(rng: random.Random, distribution: str, mean: int, low: int, high: int) -> int:
    """max_tokens for one request: constant, uniform on [low, 2*mean - low], normal (sd mean/4), exponential."""
    if distribution == "constant":
        value = mean
    elif distribution == "uniform":
        value = rng.uniform(low, 2 * mean - low)
    elif distribution == "normal":
        value = rng.gauss(mean, mean / 4)
    elif distribution == "exponential":
        value = rng.expovariate(1.0 / mean)
    else:
        raise ValueError(f"unknown max-tokens distribution {distribution!r}")
    return int(min(max(round(value), low), high))


class RunCollector:
    """Thread-safe (gevent-safe) list of records; on workers it drains to the master each report."""

    def __init__(self):
        self.lock = threading.Lock()
        self.records: list[StreamRecord] = []
        self.rows: list[dict] = []
        self.model = ""
        self.started: float | None = None
        self.ended: float | None = None

    def mark_start(self, now: float) -> None:
        if self.started is None:
            self.started = now

    def add(self, record: StreamRecord) -> None:
        with self.lock:
            self.records.append(record)
            self.ended = time.time()

    def drain_rows(self) -> list[dict]:
        """Worker side: what to send to the master (records as plain dicts, including ITL samples)."""
        with self.lock:
            out = [dict(record_to_row(r), itl=list(r.itl), started=self.started) for r in self.records]
            self.records.clear()
        return out

    def extend_rows(self, rows: list[dict]) -> None:
        """Master side: records received from workers."""
        with self.lock:
            for row in rows:
                rec = StreamRecord(**{k: row[k] for k in StreamRecord.__dataclass_fields__ if k in row})
                self.records.append(rec)
                if row.get("started") and (self.started is None or row["started"] < self.started):
                    self.started = row["started"]
                self.ended = time.time()

    def report(
        self,
        prefix: str | None,
        csv_prefix: str | None,
        ttft_slo_ms: float | None,
        tpot_slo_ms: float | None,
        show_replies: int = 0,
    ) -> dict:
        with self.lock:
            records = list(self.records)
        if not records:  # quit before any request (the web UI closed without a test, say): nothing to report
            print("LLM load report: no requests were made; nothing written", flush=True)
            return {"requests": 0}
        wall = max(0.0, (self.ended or time.time()) - (self.started or time.time()))
        summary = summarize(records, wall, ttft_slo_ms, tpot_slo_ms)
        summary["model"] = self.model
        base = Path(prefix or (f"{csv_prefix}_llm" if csv_prefix else "locust_llm"))
        base.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{base}_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        with open(f"{base}_requests.csv", "w", newline="") as fh:
            rows = [record_to_row(r) for r in records]
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["ok"])
            writer.writeheader()
            writer.writerows(rows)
        with open(f"{base}_summary.csv", "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["metric", "p50", "p90", "p99", "mean"])
            for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "output_tokens", "tokens_per_s"):
                stats = summary[name]
                writer.writerow([name, stats["p50"], stats["p90"], stats["p99"], stats["mean"]])
        print(format_summary(summary, base), flush=True)
        if show_replies > 0:
            print(format_replies(records, show_replies), flush=True)
        return summary


def format_summary(s: dict, base: Path) -> str:
    def fmt(x):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"

    lines = [
        f"LLM load report ({s['model'] or 'model ?'}): {s['requests']} requests, {s['failed']} failed, "
        f"{s['throughput_tokens_per_s']} output tokens/s, {s['requests_per_s']} requests/s over {s['wall_s']} s",
        f"{'':>14} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}",
    ]
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "output_tokens", "tokens_per_s"):
        st = s[name]
        lines.append(f"{name:>14} {fmt(st['p50']):>9} {fmt(st['p90']):>9} {fmt(st['p99']):>9} {fmt(st['mean']):>9}")
    g = s["goodput"]
    if g["ttft_slo_ms"] is not None or g["tpot_slo_ms"] is not None:
        lines.append(
            f"goodput (TTFT <= {g['ttft_slo_ms']} ms, TPOT <= {g['tpot_slo_ms']} ms): {g['good_requests']} requests "
            f"({g['fraction']}), {g['requests_per_s']} requests/s"
        )
    if s["acceptance_length_mean"] is not None:
        lines.append(f"acceptance length (server-reported, mean over requests): {s['acceptance_length_mean']}")
    lines.append(f"token counts from: {', '.join(s['token_count_sources']) or '-'}")
    lines.append(f"written: {base}_summary.json, {base}_summary.csv, {base}_requests.csv")
    return "\n".join(lines)


def format_replies(records: list[StreamRecord], count: int, width: int = 300) -> str:
    """The first ``count`` successful requests' prompts and replies, shortened: a glance at what the server said."""

    def short(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= width else text[: width - 3] + "..."

    shown = [r for r in records if r.ok][:count]
    lines = [f"replies ({len(shown)} of {len(records)}; all in _requests.csv):"]
    for r in shown:
        lines += [f"  > {short(r.prompt)}", f"  < {short(r.text)} [{r.output_tokens} tokens, {r.finish_reason}]"]
    return "\n".join(lines)
