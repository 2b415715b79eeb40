"""Percentages and PNG bar charts for the census and recovery reports (tables: `irminsul/table.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def bar_chart(
    path: str | Path,
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    title: str,
    ylabel: str,
    stacked: bool = False,
    hline: tuple[str, float] | None = None,
) -> Path:
    """Write a (stacked or grouped) bar chart of `series` (name -> one value per label) as a PNG,
    with an optional labelled horizontal reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(min(12.0, max(5.0, 0.8 * len(labels) + 2)), 4))
    bottom = np.zeros(len(labels))
    width = 0.7 if stacked else 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        values = np.asarray(values, dtype=float)
        if stacked:
            ax.bar(x, values, width, bottom=bottom, label=name)
            bottom += values
        else:
            ax.bar(x - 0.4 + width * (k + 0.5), values, width, label=name)
    if hline is not None:
        ax.axhline(hline[1], color="black", linestyle="--", linewidth=1, label=hline[0])
    ax.set_xticks(x, labels, rotation=20 if len(labels) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
