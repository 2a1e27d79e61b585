"""Plot helpers every report uses (benchmarks and the load-test sweep): headless matplotlib, figures saved with
legends outside the data, concurrency axes that read as plain numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def pyplot():
    """matplotlib's pyplot on the headless Agg backend (ImportError when matplotlib is not installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def legend_below(fig, ax, columns: int = 4) -> None:
    """One legend for the figure, under the panels, so it never covers bars or points."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(columns, max(1, len(labels))), fontsize=8, frameon=False)
    rows = 1 + (len(labels) - 1) // columns
    fig.tight_layout(rect=(0, (0.15 + 0.22 * rows) / fig.get_figheight(), 1, 1))  # room for the legend, in inches


def concurrency_axis(ax, values: Sequence[int]) -> None:
    """A log2 x axis whose ticks are the measured concurrencies written as plain numbers."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(values), [str(v) for v in values])
    ax.minorticks_off()
    ax.set_xlabel("concurrent streams")


def save_figure(fig, path: Path, tight: bool = True) -> None:
    plt = pyplot()
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
