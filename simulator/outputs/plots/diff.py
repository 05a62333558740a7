"""The waterfall of ``clustersim diff``: from run A's step time to run B's.

One horizontal bar per row, top to bottom: A's whole step, then each category
whose time changed (red when B spends more, green when less) starting where the
previous one ended, then B's whole step; a dotted line carries the running
level from one bar to the next. When the changes are small beside the step
(their range under a fifth of it), the time axis starts near them and says so
in its label, so that a 1% change is still a visible bar. The bars are
:func:`simulator.outputs.diff.waterfall`'s, which add up to B's step time. Drawn with the
Agg canvas, like
:mod:`simulator.outputs.plots.figures`; the figure reads the diff dict only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure

from simulator.outputs.plots.common import format_seconds, save, time_unit

if TYPE_CHECKING:
    from simulator.outputs.diff import Bar

_TOTAL = "#4C78A8"
_MORE = "#E45756"  # B spends more time here
_LESS = "#54A24B"  # B spends less


def waterfall_figure(diff: Mapping[str, Any], bars: Sequence[Bar]) -> Figure:
    """The waterfall of ``bars`` (``waterfall(diff)``), titled with both runs."""
    runs = diff["runs"]
    names = {k.upper(): f"{k.upper()}: {runs[k]['scenario']} ({Path(runs[k]['dir']).name})"
             for k in ("a", "b")}
    top = max(max(bar.start, bar.end) for bar in bars)
    scale, unit = time_unit(top)
    levels = [x for bar in bars for x in (bar.start, bar.end) if not bar.total] \
        or [bars[0].end, bars[-1].end]
    low, high = min(levels), max(levels)
    left = max(0.0, low - max(high - low, 0.02 * top)) if high - low < 0.2 * top else 0.0
    fig = Figure(figsize=(9, 1.2 + 0.32 * len(bars)), layout="constrained")
    ax = fig.add_subplot()
    for y, bar in enumerate(bars):
        lo, hi = sorted((bar.start, bar.end))
        colour = _TOTAL if bar.total else (_MORE if bar.end > bar.start else _LESS)
        ax.barh(y, (hi - lo) * scale, left=lo * scale, height=0.6, color=colour)
        delta = bar.end - bar.start
        text = format_seconds(bar.end) if bar.total else \
            ("+" if delta > 0 else "−") + format_seconds(abs(delta))
        ax.text(hi * scale + (top - left) * scale * 0.01, y, text, va="center", fontsize=8)
        if y + 1 < len(bars):
            ax.plot([bar.end * scale] * 2, [y + 0.3, y + 0.7], color="#888888",
                    linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(bars)), [names.get(b.label, b.label) for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left * scale, (top + (top - left) * 0.15) * scale or 1.0)
    ax.set_xlabel(f"time per step ({unit})" + (f"; the axis starts at "
                                                f"{format_seconds(left)}" if left else ""))
    step = diff["step_time_s"]
    rel = f" ({step['delta'] / step['a']:+.1%})" if step["a"] > 0 else ""
    ax.set_title(f"step time from A to B: {format_seconds(step['a'])} → "
                 f"{format_seconds(step['b'])}{rel}", fontsize=11)
    return fig


def plot_waterfall(diff: Mapping[str, Any], bars: Sequence[Bar],
                   path: str | os.PathLike[str]) -> Path:
    """Save :func:`waterfall_figure` as a PNG at ``path`` (atomically)."""
    return save(waterfall_figure(diff, bars), path)
