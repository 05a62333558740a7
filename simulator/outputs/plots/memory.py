"""Memory: each stage's breakdown stacked against the GPU's capacity, and where the run
recorded it, each rank's memory over the step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.collections import LineCollection
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from simulator.outputs.plots.common import CAPACITY_COLOUR, GB, save, scenario_header, time_unit

#: Colour of each part of a stage's memory, bottom to top.
MEMORY_PARTS: Mapping[str, str] = {
    "weights": "#4C78A8",
    "gradients": "#F58518",
    "optimizer": "#54A24B",
    "activations": "#E45756",
    "logits": "#B279A2",
    "comm_buffers": "#9D755D",
    "device": "#BAB0AC",  # context, workspaces, NCCL, allocator rounding
}

_RANK_COLOURS = ("C0", "C1", "C2", "C4", "C5", "C6", "C7", "C8", "C9")  # no red: capacity is red

def _memory_bars(ax: Axes, memory: Sequence[Mapping[str, Any]]) -> None:
    """Stacked GB per stage against capacity (a red line; "OOM" over a bar above it)."""
    x = np.arange(len(memory))
    bottom = np.zeros(len(memory))
    for part, colour in MEMORY_PARTS.items():
        gb = np.array([float(m.get(part, 0.0)) for m in memory]) / GB
        if gb.any():
            ax.bar(x, gb, bottom=bottom, width=0.7, color=colour, label=part.replace("_", " "),
                   edgecolor="white", linewidth=0.4)
            bottom += gb
    capacity = np.array([float(m.get("capacity", 0.0)) for m in memory]) / GB
    if capacity.any() and np.ptp(capacity) == 0:
        ax.axhline(capacity[0], color=CAPACITY_COLOUR, linewidth=1.6,
                   label=f"capacity ({capacity[0]:.0f} GB)")
    elif capacity.any():
        ax.hlines(capacity, x - 0.45, x + 0.45, color=CAPACITY_COLOUR, linewidth=1.6,
                  label="capacity")
    totals = np.array([float(m.get("total", b * GB)) for m, b in zip(memory, bottom,
                                                                        strict=True)]) / GB
    for i, (total, cap) in enumerate(zip(totals, capacity, strict=True)):
        over = cap > 0 and total > cap
        if over or len(memory) <= 16:
            ax.text(i, max(bottom[i], cap if over else 0),
                    f"{total:.1f}\nOOM" if over else f"{total:.1f}", ha="center", va="bottom",
                    fontsize=7,
                    color=CAPACITY_COLOUR if over else "black")
    labels = [str(m.get("stage", i)) for i, m in enumerate(memory)]
    ax.set_xticks(x, labels, fontsize=8 if len(memory) <= 32 else 6)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GB per GPU")
    ax.set_ylim(0, max(float(bottom.max(initial=0.0)), float(capacity.max(initial=0.0)))
                * 1.12 or 1.0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)


def _memory_curves(ax: Axes, fig: Figure, timeline: Any, capacity: float) -> None:
    """Each rank's allocated bytes over the step as a step curve (one colour per rank)."""
    if isinstance(timeline, Mapping):
        items: Any = sorted(timeline.items())
    else:
        items = [(e["rank"], e["points"]) if isinstance(e, Mapping) else (i, e)
                 for i, e in enumerate(timeline)]
    curves = [(int(rank), np.asarray(points, dtype=float).reshape(-1, 2))
              for rank, points in items if len(points)]
    if not curves:
        return
    t_max = max(float(c[:, 0].max()) for _, c in curves)
    scale, unit = time_unit(t_max)
    segments = []
    for _, c in curves:  # a post-step curve: hold each value until the next point (or the end)
        xs = np.append(np.repeat(c[:, 0], 2)[1:], t_max) * scale
        ys = np.repeat(c[:, 1], 2) / GB
        segments.append(np.column_stack([xs, ys]))
    ranks = [r for r, _ in curves]
    handles: list[Any] = []
    if len(ranks) <= len(_RANK_COLOURS):  # few ranks: one named colour each
        colours = list(_RANK_COLOURS[: len(ranks)])
        ax.add_collection(LineCollection(segments, colors=colours, linewidths=1.2))
        handles = [Line2D([], [], color=c, label=f"rank {r}") for c, r in zip(colours, ranks,
                                                                            strict=True)]
    else:  # many ranks: a colour scale
        norm = Normalize(min(ranks), max(ranks))
        ax.add_collection(LineCollection(segments, array=np.asarray(ranks, dtype=float),
                                         cmap="viridis", norm=norm, linewidths=0.8))
        bar = fig.colorbar(ScalarMappable(norm=norm, cmap="viridis"), ax=ax, pad=0.01)
        bar.set_label("rank")
        bar.locator = MaxNLocator(integer=True)
        bar.update_ticks()
    if capacity > 0:
        handles.append(ax.axhline(capacity / GB, color=CAPACITY_COLOUR, linewidth=1.6,
                                  linestyle="--", label="capacity"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
                  frameon=False)
    y_max = max(float(s[:, 1].max()) for s in segments)
    ax.set_xlim(0, t_max * scale * 1.01 or 1.0)
    ax.set_ylim(0, max(y_max, capacity / GB) * 1.08 or 1.0)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("allocated GB")
    ax.set_title("allocated memory over the step", fontsize=9)


def memory_figure(results: Mapping[str, Any]) -> Figure:
    """Per-stage memory stack against capacity, and the per-rank curves when recorded."""
    memory = results.get("memory") or []
    timeline = results.get("memory_timeline")
    fig = Figure(figsize=(min(6 + 0.45 * len(memory), 16), 8.5 if timeline else 5),
                 layout="constrained")
    axes = fig.subplots(2 if timeline else 1, 1, squeeze=False)[:, 0]
    _memory_bars(axes[0], memory)
    capacity = max((float(m.get("capacity", 0.0)) for m in memory), default=0.0)
    if timeline:
        _memory_curves(axes[1], fig, timeline, capacity)
    name, _ = scenario_header(results)
    peak = float(results.get("memory_peak_bytes", 0.0)) / GB
    verdict = "fits" if results.get("fits_in_memory", True) else "DOES NOT FIT"
    title = f"peak {peak:.1f} GB" + (f" of {capacity / GB:.0f} GB" if capacity else "")
    axes[0].set_title(" · ".join(p for p in (name, title, verdict) if p), fontsize=11)
    return fig


def plot_memory(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Save :func:`memory_figure` as a PNG at ``path``."""
    return save(memory_figure(results), path)
