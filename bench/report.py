"""Benchmark reporting: markdown table, CSV, JSON and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from specdec_kit.bench.bandwidth_split import state_table
from specdec_kit.bench.per_prompt import per_prompt_table

COLUMNS = [
    "prompt_set",
    "temperature",
    "method",
    "requests",
    "acceptance_length",
    "tokens_per_s",
    "speedup",
    "decode_speedup",
    "copy_gbs",
    "bound",
    "draft_ms",
    "verify_ms",
    "acceptance_per_depth",
]


def markdown(rows: list[dict], machine: str) -> str:
    """The rows as a table; where they carry it, the memory bandwidth a copy got beside each row's prompts (its
    median): on a shared CPU a row measured while it was high shows less speedup than one measured while it was low."""
    copies = any(r.get("copy_gbs") for r in rows)
    lines = [
        f"Machine: {machine}",
        "",
        "| prompts | T | method | tau | tokens/s | speedup | decoding alone | "
        + ("copy GB/s | " if copies else "")
        + "bound | draft ms/cycle | acceptance per depth |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if copies else ""),
    ]
    for r in rows:
        depth = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"]) or "-"
        tau = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        bound = f"{r['bound']:.2f}x" if r.get("bound") else "-"
        draft = f"{r['draft_ms']:.1f}" if r.get("draft_ms") is not None else "-"
        copy = f"{r['copy_gbs']:.0f} | " if copies else ""
        decoding = f"{r['decode_speedup']:.2f}x" if r.get("decode_speedup") else "-"
        lines.append(
            f"| {r['prompt_set']} | {r['temperature']:g} | {r['method']} | {tau} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {decoding} | {copy}{bound} | {draft} | {depth} |"
        )
    lines += state_table(rows)
    return "\n".join(lines) + "\n"


def write_all(rows: list[dict], out: Path, machine: str, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(markdown(rows, machine))
    prompts = per_prompt_table(rows)
    if prompts:
        (out / "per_prompt.md").write_text(prompts)
    (out / "results.json").write_text(json.dumps({"machine": machine, "meta": meta, "rows": rows}, indent=2))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(
                {k: (" ".join(f"{a:.4f}" for a in r[k]) if k == "acceptance_per_depth" else r.get(k)) for k in COLUMNS}
            )
    plot(rows, out)


def _grid(rows: list[dict]):
    """One panel per (prompt set, temperature): prompt sets down, temperatures across."""
    from specdec_kit.plots import pyplot

    plt = pyplot()
    sets = sorted({r["prompt_set"] for r in rows})
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(len(sets), len(temps), figsize=(5.2 * len(temps), 3.4 * len(sets)), squeeze=False)
    panels = [(axes[i][j], ps, t) for i, ps in enumerate(sets) for j, t in enumerate(temps)]
    return plt, fig, panels


def plot(rows: list[dict], out: Path) -> None:
    plt, fig, panels = _grid(rows)
    for ax, ps, t in panels:
        for r in rows:
            if (r["prompt_set"], r["temperature"]) == (ps, t) and r["acceptance_per_depth"]:
                depth = r["acceptance_per_depth"]
                ax.plot(
                    range(1, len(depth) + 1),
                    depth,
                    marker="o",
                    label=f"{r['method']} (tau {r['acceptance_length']:.2f})",
                )
        ax.set_title(f"{ps}, T={t:g}")
        ax.set_xlabel("tree depth")
        ax.set_ylabel("cycles accepting this depth")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_depth.png", dpi=100)
    plt.close(fig)

    plt, fig, panels = _grid(rows)
    for ax, ps, t in panels:
        sel = [r for r in rows if (r["prompt_set"], r["temperature"]) == (ps, t)]
        names = [r["method"] for r in sel]
        ax.bar(names, [r["speedup"] for r in sel], color="tab:blue", label="measured (median)")
        with_bound = [(r["method"], r["bound"]) for r in sel if r.get("bound")]
        if with_bound:
            ax.scatter(
                [m for m, _ in with_bound],
                [b for _, b in with_bound],
                color="tab:red",
                marker="_",
                s=400,
                linewidths=2,
                label="analytical bound",
                zorder=3,
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{ps}, T={t:g}")
        ax.set_ylabel("speedup over plain decoding")
        ax.tick_params(axis="x", rotation=40, labelsize=7)
        ax.set_ylim(bottom=0)
    from specdec_kit.plots import legend_below

    legend_below(fig, panels[0][0])
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)


def write_text_and_plot(out: Path, stem: str, lines: list[str], draw) -> None:
    """``stem.md`` from ``lines`` and ``stem.png`` from ``draw(path)`` (skipped without matplotlib); prints the text."""
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    try:
        draw(out / f"{stem}.png")
    except ImportError:
        pass
    print("\n".join(lines))
