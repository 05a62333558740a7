"""Memory: each stage's breakdown stacked against the GPU's capacity, and where the run
recorded it, each recorded rank's memory over the step: one labelled line per class of
identical ranks (a run records one rank per stage, standing for its peers).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure

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


def _curves(timeline: Any) -> list[tuple[str, np.ndarray]]:
    """(label, points) per recorded rank: ``stage s (rank r)`` where the entry names its
    stage (each recorded rank stands for its class of identical ranks), else ``rank r``."""
    if isinstance(timeline, Mapping):
        items: Any = [{"rank": r, "points": p} for r, p in sorted(timeline.items())]
    else:
        items = [e if isinstance(e, Mapping) else {"rank": i, "points": e}
                 for i, e in enumerate(timeline)]
    out = []
    for e in items:
        points = np.asarray(e["points"], dtype=float).reshape(-1, 2)
        if len(points):
            name = f"rank {int(e['rank'])}"
            out.append((f"stage {int(e['stage'])} ({name})" if "stage" in e else name, points))
    return out


def _line_colours(n: int) -> list[Any]:
    """Distinct colours for ``n`` labelled lines (none red: capacity is red)."""
    if n <= len(_RANK_COLOURS):
        return list(_RANK_COLOURS[:n])
    tab20 = colormaps["tab20"]
    paired = [tab20(i) for i in range(20) if i not in (6, 7)]  # no reds: capacity is red
    if n <= len(paired):
        return paired[:n]
    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]


def _memory_curves(ax: Axes, timeline: Any, capacity: float) -> None:
    """Each recorded rank's allocated bytes over the step as a step curve: one labelled
    line per rank class (the legend names its stage and rank)."""
    curves = _curves(timeline)
    if not curves:
        return
    t_max = max(float(c[:, 0].max()) for _, c in curves)
    scale, unit = time_unit(t_max)
    colours = _line_colours(len(curves))
    handles: list[Any] = []
    y_max = 0.0
    for (name, c), colour in zip(curves, colours, strict=True):
        # a post-step curve: hold each value until the next point (or the end)
        xs = np.append(np.repeat(c[:, 0], 2)[1:], t_max) * scale
        ys = np.repeat(c[:, 1], 2) / GB
        handles += ax.plot(xs, ys, color=colour, linewidth=1.1, label=name)
        y_max = max(y_max, float(ys.max()))
    if capacity > 0:
        handles.append(ax.axhline(capacity / GB, color=CAPACITY_COLOUR, linewidth=1.6,
                                  linestyle="--", label="capacity"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7,
              frameon=False, ncol=-(-len(handles) // 20))
    ax.set_xlim(0, t_max * scale * 1.01 or 1.0)
    ax.set_ylim(0, max(y_max, capacity / GB) * 1.08 or 1.0)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("allocated GB")
    ax.set_title("allocated memory over the step, one line per class of identical ranks",
                 fontsize=9)


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
        _memory_curves(axes[1], timeline, capacity)
    name, _ = scenario_header(results)
    peak = float(results.get("memory_peak_bytes", 0.0)) / GB
    verdict = "fits" if results.get("fits_in_memory", True) else "DOES NOT FIT"
    title = f"peak {peak:.1f} GB" + (f" of {capacity / GB:.0f} GB" if capacity else "")
    axes[0].set_title(" · ".join(p for p in (name, title, verdict) if p), fontsize=11)
    return fig


def plot_memory(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Save :func:`memory_figure` as a PNG at ``path``."""
    return save(memory_figure(results), path)
