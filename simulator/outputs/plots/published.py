"""Published runs against their simulation: one point per compared row, measured on x
and simulated on y (log axes, each unit of the table on its own panel), the diagonal
and its ±10% band; colours by GPU, so a regime that reads fast or slow shows as a
cloud above or below the band.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from simulator.outputs.plots.common import save

_PLAIN = FuncFormatter(lambda v, _: f"{v:.4g}")
_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D")


def published_figure(table: pd.DataFrame, title: str = "") -> Figure:
    """The scatter of ``table`` (:func:`simulator.published.compare.compare_rows`)."""
    done = table[table["error"].notna()]
    units = list(dict.fromkeys(done["unit"])) or ["(no row compared)"]
    fig = Figure(figsize=(6.2 * len(units), 5.6), layout="constrained")
    for i, unit in enumerate(units):
        ax = fig.add_subplot(1, len(units), i + 1)
        rows = done[done["unit"] == unit]
        gpus = sorted({str(g).split(" (")[0] for g in rows["gpu"]})
        for colour, gpu in zip(_COLOURS * 4, gpus, strict=False):
            sel = rows[rows["gpu"].map(lambda g, gpu=gpu: str(g).split(" (")[0] == gpu)]
            ax.scatter(sel["measured"], sel["simulated"], s=18, color=colour, alpha=0.8,
                       label=f"{gpu} ({len(sel)})")
        if len(rows):
            lo = float(min(rows["measured"].min(), rows["simulated"].min())) / 1.3
            hi = float(max(rows["measured"].max(), rows["simulated"].max())) * 1.3
            ax.plot([lo, hi], [lo, hi], color="black", lw=1)
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1],
                            color="grey", alpha=0.15, lw=0, label="±10%")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_formatter(_PLAIN)
            mean = rows["error"].mean()
            ax.set_title(f"{unit}: {len(rows)} rows, mean error {mean:+.1%}, "
                         f"mean |error| {rows['error'].abs().mean():.1%}", fontsize=10)
            ax.legend(fontsize=8, loc="upper left")
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"simulated ({unit})")
        ax.grid(True, which="both", alpha=0.25)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def plot_published(table: pd.DataFrame, path: str | os.PathLike[str], title: str = "") -> Path:
    return save(published_figure(table, title), path)
