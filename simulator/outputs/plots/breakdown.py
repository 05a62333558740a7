"""The time breakdown: the accounting's categories
(:mod:`simulator.analysis.accounting`) stacked per stage, a partition of the step, so
each bar is exactly the step time; the pipeline bubble labelled on its bars.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from simulator.analysis.accounting.metrics import stage_breakdown
from simulator.analysis.accounting.vocabulary import CATEGORIES, label
from simulator.outputs.plots.common import (
    category_style,
    format_seconds,
    save,
    scenario_header,
    time_unit,
)


def breakdown_segments(results: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Seconds per pipeline stage of every accounting category that occurs, from
    ``time_breakdown_s`` (the mean over each stage's simulated ranks). Each stage's
    segments sum to the step time: they are a partition, nothing is clamped."""
    entries = results.get("time_breakdown_s")
    if not isinstance(entries, list) or not entries:
        raise ValueError("results.json has no time_breakdown_s: re-run the scenario with this "
                         "version of clustersim")
    stages = stage_breakdown(entries)
    segments = {c: np.array([st[c] for st in stages], dtype=float) for c in CATEGORIES}
    return {c: v for c, v in segments.items() if v.any()}


def _label_bubbles(ax: Axes, results: Mapping[str, Any], segments: Mapping[str, np.ndarray],
                   scale: float) -> None:
    """Write each stage's bubble fraction in the middle of its bubble segment."""
    fractions = results.get("bubble_fraction_per_stage")
    bubble = segments.get("pipeline_bubble")
    if not isinstance(fractions, list) or len(fractions) > 32 or bubble is None:
        return
    order = list(segments)
    below = sum(segments[k] for k in order[:order.index("pipeline_bubble")])
    middle = (below + bubble / 2) * scale
    prefix = "bubble\n" if len(fractions) <= 8 else ""  # wider labels collide beyond ~8 bars
    for i, fraction in enumerate(fractions[:len(bubble)]):
        if bubble[i] > 0:
            ax.text(i, middle[i], f"{prefix}{float(fraction):.1%}", ha="center", va="center",
                    fontsize=7, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})


def breakdown_figure(results: Mapping[str, Any]) -> Figure:
    """Per-stage stacked bars of :func:`breakdown_segments`, with the step time."""
    segments = breakdown_segments(results)
    n = len(next(iter(segments.values())))
    step = float(results.get("step_time_s", 0.0))
    total = np.sum(list(segments.values()), axis=0)
    scale, unit = time_unit(max(step, float(total.max(initial=0.0))))
    fig = Figure(figsize=(min(5 + 0.5 * n, 16), 5), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(n)
    bottom = np.zeros(n)
    for category, seconds in segments.items():
        style = category_style(category)
        ax.bar(x, seconds * scale, bottom=bottom, width=0.7, label=label(category),
               color=style["color"], alpha=style["alpha"], hatch=style["hatch"],
               edgecolor="#888888", linewidth=0.4)
        bottom += seconds * scale
    if step > 0:
        ax.axhline(step * scale, color="black", linestyle="--", linewidth=0.8,
                   label=f"step time {format_seconds(step)}")
    _label_bubbles(ax, results, segments, scale)
    ax.set_xticks(x, [str(i) for i in x], fontsize=8 if n <= 32 else 6)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(f"time per step ({unit})")
    ax.set_ylim(0, max(float(bottom.max(initial=0.0)), step * scale) * 1.1 or 1.0)
    name, parallel = scenario_header(results)
    ax.set_title(" · ".join(p for p in (name, str(parallel.get("schedule", "")),
                                        "where each stage's step goes") if p), fontsize=11)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize=8, frameon=False)
    return fig


def plot_breakdown(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Save :func:`breakdown_figure` as a PNG at ``path``."""
    return save(breakdown_figure(results), path)
