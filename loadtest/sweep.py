"""``python -m specdec_kit.loadtest.sweep --host URL``: a short sweep over user counts, plotted.

Runs ``locust -f loadtest/chat.py --headless`` once per user count (closed loop, ``-t`` each), collects
each run's LLM summary, and writes ``sweep.csv``, ``sweep.json`` and ``sweep.png`` (throughput against
p50/p99 TTFT and inter-token latency, one point per user count). Extra arguments after ``--`` go to
Locust (e.g. ``-- --max-tokens 64 --endpoint completions``).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from specdec_kit.plots import pyplot, save_figure

CHAT = Path(__file__).resolve().parent / "chat.py"


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="specdec-loadtest-sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--users", default="1,2,4,8", help="comma-separated user counts")
    p.add_argument("--duration", default="30s", help="each run's -t")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"))
    p.add_argument("locust_args", nargs=argparse.REMAINDER, help="after --: passed to locust")
    return p.parse_args(argv)


def run_one(host: str, users: int, duration: str, out: Path, extra: list[str]) -> dict:
    prefix = out / f"u{users}"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(CHAT),
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        duration,
        "--host",
        host,
        "--csv",
        str(prefix),
        "--only-summary",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    summary_file = Path(f"{prefix}_llm_summary.json")
    if not summary_file.is_file():
        raise RuntimeError(
            f"locust run with {users} users wrote no summary:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    summary = json.loads(summary_file.read_text())
    summary["users"] = users
    summary["locust_exit_code"] = proc.returncode
    return summary


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    # levels where no request completed have no latencies to plot (their rows stay in the CSV and JSON)
    done = [r for r in rows if r["ttft_ms"].get("p50") is not None and r["itl_ms"].get("p50") is not None]
    tput = [r["throughput_tokens_per_s"] for r in done]
    for ax, metric, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "itl_ms", "inter-token latency")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(tput, [r[metric][q] for r in done], style, label=q)
        for r in done:
            ax.annotate(
                f"{r['users']}u",
                (r["throughput_tokens_per_s"], r[metric]["p50"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
        ax.set_ylim(bottom=0)
        ax.set_xlabel("throughput (output tokens/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    extra = [a for a in args.locust_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for users in (int(u) for u in args.users.split(",")):
        row = run_one(args.host, users, args.duration, args.out, extra)
        rows.append(row)
        print(
            f"{users:>4} users: {row['throughput_tokens_per_s']} tok/s, TTFT p50 {row['ttft_ms']['p50']} ms, "
            f"ITL p50 {row['itl_ms']['p50']} ms, {row['failed']} failed",
            flush=True,
        )
    (args.out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(args.out / "sweep.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            [
                "users",
                "requests",
                "failed",
                "tokens_per_s",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "itl_p50_ms",
                "itl_p99_ms",
                "goodput_fraction",
            ]
        )
        for r in rows:
            writer.writerow(
                [
                    r["users"],
                    r["requests"],
                    r["failed"],
                    r["throughput_tokens_per_s"],
                    r["ttft_ms"]["p50"],
                    r["ttft_ms"]["p99"],
                    r["itl_ms"]["p50"],
                    r["itl_ms"]["p99"],
                    r["goodput"]["fraction"],
                ]
            )
    try:
        plot(rows, args.out / "sweep.png")
    except ImportError:
        pass
    print(f"written: {args.out}/sweep.csv, sweep.json, sweep.png")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
