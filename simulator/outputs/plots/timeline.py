"""The timeline: one row per pipeline stage, drawn from the stage's lowest rank (all
ranks of a stage run the same program unless a scenario makes them differ;
``all_ranks=True`` draws every rank). The compute stream is the main bar; the
other streams (pp, dp, host, ...) are thinner sub-rows below it, so white gaps
in the main bar are the pipeline bubble. A collective's peer-wait (before
``comm_start``) is drawn apart from its transfer, and the critical path as a line
under the bars. Bars are one :class:`~matplotlib.collections.PolyCollection` per
kind, added without autoscaling: 250,000 spans draw in about 1.5 s. Micro-batch
numbers are written into the compute bars when there are few enough (one label per
contiguous run of a micro-batch's forward, backward, ... including the TP
collectives between its layers) and the run is wide enough to hold its label.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from simulator.outputs.plots.common import (
    DPI,
    KIND_COLOURS,
    OTHER_COLOUR,
    PATH_COLOUR,
    format_seconds,
    path_ranks,
    save,
    scenario_header,
    text_colour,
    time_unit,
)
from simulator.outputs.span_table import normalize_spans

_LABELLED_KINDS = ("forward", "backward", "weight_grad", "recompute")


_STREAM_ORDER = ("compute", "pp", "dp", "host")


_MAX_LABELS = 400  # more micro-batch labels than this are unreadable


_EDGED_SPANS = 1_000  # up to this many bars, a white edge separates neighbours; beyond,


# bars are a few pixels wide and the edge would swallow them
_MANY_SPANS = 200_000  # above this, bars are drawn without antialiasing (faster)


_TIMELINE_PX = 1500  # about the time axis' width in pixels (14 in at DPI)


def _timeline_rows(spans: pd.DataFrame, all_ranks: bool,
                   prefer: Mapping[int, float] | None = None) -> pd.DataFrame:
    """Rows of the Gantt chart: ``rank``, ``row`` (0 at the top) and tick ``label``. One
    row per stage shows the rank with most of ``prefer`` (seconds of the critical path)
    on that stage, else its lowest rank; a row that is not the lowest says which rank
    it is."""
    ranks = spans.drop_duplicates("rank")
    ranks = ranks.assign(_path=-ranks["rank"].map(prefer or {}).fillna(0.0).astype(float))
    ranks = ranks.sort_values(["stage", "_path", "dp", "tp", "rank"])
    lowest = spans.groupby("stage", observed=True)["rank"].min()
    if not all_ranks:
        ranks = ranks.drop_duplicates("stage")
    ranks = ranks.reset_index(drop=True)
    if all_ranks:
        labels = [f"rank {r} (stage {s})" for r, s in zip(ranks["rank"], ranks["stage"],
                                                             strict=True)]
    else:
        labels = [f"stage {s}" if r == lowest[s] else f"stage {s} (rank {r})"
                  for r, s in zip(ranks["rank"], ranks["stage"], strict=True)]
    return pd.DataFrame({"rank": ranks["rank"], "row": ranks.index, "label": labels})


def _stream_bands(streams: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Offset and height of each stream's band inside a row of height 1."""
    known = [s for s in _STREAM_ORDER if s in streams and s != "compute"]
    comm = known + sorted(set(streams) - set(_STREAM_ORDER))
    if not comm:
        return {"compute": (0.1, 0.8)}
    bands = {"compute": (0.06, 0.5)}
    height = 0.34 / len(comm)
    for i, stream in enumerate(comm):
        bands[stream] = (0.6 + i * height, height * 0.85)
    return bands


def _bar_polys(x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Rectangles as an (n, 4, 2) vertex array."""
    verts = np.empty((len(x0), 4, 2))
    verts[:, 0, 0] = verts[:, 1, 0] = x0
    verts[:, 2, 0] = verts[:, 3, 0] = x1
    verts[:, 0, 1] = verts[:, 3, 1] = y0
    verts[:, 1, 1] = verts[:, 2, 1] = y0 + h
    return verts


def _draw_bars(ax: Axes, bars: pd.DataFrame, scale: float, min_width: float) -> list[str]:
    """One PolyCollection per (kind, chunk parity); returns the kinds drawn, legend order.

    Bars off the compute stream are at least ``min_width`` (seconds, about a
    pixel) wide, so that a 50 µs send in a one-second step still shows; compute
    bars keep their width, as their neighbours share the pixel (antialiasing then
    mixes the colours by time share). Compute kinds are drawn last, on top.
    """
    many = len(bars) >= _MANY_SPANS
    edges = len(bars) <= _EDGED_SPANS
    present = {str(k) for k in bars["kind"].unique()}
    kinds = [k for k in KIND_COLOURS if k in present] + sorted(present - set(KIND_COLOURS))
    for (kind, odd), group in bars.groupby(["kind", bars["chunk"] % 2], sort=False):
        start = group["start"].to_numpy()
        widen = np.where(group["stream"].to_numpy() == "compute", 0.0, min_width)
        end = np.maximum(group["end"].to_numpy(), start + widen)
        verts = _bar_polys(start * scale, end * scale, group["y0"].to_numpy(),
                           group["h"].to_numpy())
        # an (n, 4, 2) array (not a list) takes PolyCollection's fast path
        ax.add_collection(PolyCollection(
            cast(Any, verts), facecolors=KIND_COLOURS.get(str(kind), OTHER_COLOUR),
            alpha=0.6 if odd else 1.0,  # odd virtual chunks are lighter
            edgecolors="white" if edges else "none", linewidths=0.3 if edges else 0,
            antialiased=not many, zorder=2.1 if kind in _LABELLED_KINDS else 2.0,
        ), autolim=False)  # the caller sets the limits; extents of 1e5 paths cost seconds
    return kinds


def _microbatch_runs(bars: pd.DataFrame) -> pd.DataFrame:
    """Contiguous compute-stream runs of one (micro-batch, kind, chunk) per row.

    Other kinds (the TP collectives between a micro-batch's layers) do not break
    a run; compute of another micro-batch, kind or chunk does.
    """
    compute = bars[(bars["stream"] == "compute") & (bars["microbatch"] >= 0)
                   & bars["kind"].isin(_LABELLED_KINDS)]
    labelled = compute.sort_values(["row", "start"])
    if labelled.empty:
        return labelled.assign(run=[])
    key = labelled[["row", "microbatch", "kind", "chunk"]]
    labelled["run"] = (key != key.shift()).any(axis=1).cumsum()
    return labelled.groupby("run").agg(
        row=("row", "first"), microbatch=("microbatch", "first"), kind=("kind", "first"),
        chunk=("chunk", "first"), start=("start", "min"), end=("end", "max"),
        y0=("y0", "first"), h=("h", "first"),
    )


def _label_microbatches(ax: Axes, fig: Figure, bars: pd.DataFrame, scale: float) -> int:
    """Write micro-batch numbers into runs wide enough for them; return the count."""
    runs = _microbatch_runs(bars)
    if runs.empty or len(runs) > _MAX_LABELS:
        return 0
    engine = fig.get_layout_engine()
    if engine is not None:  # place the axes now (no rendering) to measure it in pixels
        FigureCanvasAgg(fig)
        engine.execute(fig)
    x_lo, x_hi = ax.get_xlim()
    axes_px = fig.get_figwidth() * DPI * ax.get_position().width
    px_per_unit = axes_px / max(x_hi - x_lo, 1e-30)
    count = 0
    columns = (runs[c].tolist() for c in ("microbatch", "kind", "start", "end", "y0", "h"))
    for mb, kind, start, end, y0, h in zip(*columns, strict=True):
        text = str(mb)
        if (end - start) * scale * px_per_unit < 7 * len(text) + 4:
            continue
        ax.text((start + end) / 2 * scale, y0 + h / 2, text,
                ha="center", va="center", fontsize=7, zorder=3, clip_on=True,
                color=text_colour(KIND_COLOURS.get(str(kind), OTHER_COLOUR)))
        count += 1
    return count


def _timeline_title(spans: pd.DataFrame, results: Mapping[str, Any] | None) -> str:
    name, parallel = scenario_header(results)
    results = results or {}
    shape = ", ".join(f"{k}={parallel[k]}" for k in ("tp", "pp", "dp") if k in parallel)
    m = int(spans["microbatch"].max()) + 1 if len(spans) else 0
    head = " · ".join(p for p in (name, str(parallel.get("schedule", "")), shape,
                                  f"m={m}" if m > 0 else "") if p)
    facts = []
    if "step_time_s" in results:
        facts.append(f"step {format_seconds(float(results['step_time_s']))}")
    if "bubble_fraction" in results:
        facts.append(f"bubble {float(results['bubble_fraction']):.1%}")
    return "\n".join(p for p in (head, ", ".join(facts)) if p) or "timeline"


def _timeline_axes(ax: Axes, rows: pd.DataFrame, bands: Mapping[str, tuple[float, float]],
                   t_range: tuple[float, float], unit: str) -> None:
    """Limits, row ticks (with small stream labels) and row separators."""
    n = len(rows)
    t_lo, t_hi = t_range
    ax.set_xlim(t_lo, t_hi + 0.005 * (t_hi - t_lo) if t_hi > t_lo else t_lo + 1.0)
    ax.set_ylim(max(n, 1), 0)
    every = max(-(-n // 48), 1)  # at most ~48 row labels stay legible
    shown = rows.iloc[::every]
    ax.set_yticks(shown["row"] + bands["compute"][0] + bands["compute"][1] / 2, shown["label"])
    if len(bands) > 1 and n <= 24:
        minor = [(r + off + h / 2, s) for r in rows["row"] for s, (off, h) in bands.items()
                 if s != "compute"]
        ax.set_yticks([y for y, _ in minor], [s for _, s in minor], minor=True)
        ax.tick_params(axis="y", which="minor", labelsize=6, length=0, labelcolor="#555555")
    for r in range(1, n):
        ax.axhline(r, color="#CCCCCC", linewidth=0.5, zorder=1)
    ax.tick_params(axis="y", which="major", length=0)
    ax.set_xlabel(f"time ({unit})")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _split_waits(spans: pd.DataFrame) -> pd.DataFrame:
    """A collective whose members arrived at different times is drawn in two parts: the
    peer-wait (kind ``wait``) up to ``comm_start``, then the transfer in its own kind."""
    waiting = spans["comm_start"] > spans["start"]
    if not waiting.any():
        return spans
    waits = spans[waiting].copy()
    waits["end"] = waits["comm_start"]
    waits["kind"] = "wait"
    moved = spans.copy()
    moved.loc[waiting, "start"] = moved.loc[waiting, "comm_start"]
    return pd.concat([moved, waits], ignore_index=True)


def _draw_critical_path(ax: Axes, spans: pd.DataFrame, rows: pd.DataFrame,
                        bands: Mapping[str, tuple[float, float]], path: Any, scale: float,
                        all_ranks: bool) -> bool:
    """The critical path as a thick line under the compute bars of the rows it runs
    through, joined by vertical steps where it moves to another row."""
    if not isinstance(path, list) or not path or spans.empty:
        return False
    stage_of = dict(zip(spans["rank"], spans["stage"], strict=False))
    if all_ranks:
        row_of = dict(zip(rows["rank"], rows["row"], strict=True))
    else:
        by_stage = dict(zip(rows["rank"].map(stage_of), rows["row"], strict=True))
        row_of = {r: by_stage[st] for r, st in stage_of.items() if st in by_stage}
    y_off = bands["compute"][0] + bands["compute"][1] + 0.02
    xs: list[float] = []
    ys: list[float] = []
    for seg in path:
        row = row_of.get(int(seg["rank"]))
        if row is None:
            continue
        y = row + y_off
        xs += [float(seg["start"]) * scale, float(seg["end"]) * scale]
        ys += [y, y]
    if not xs:
        return False
    ax.plot(xs, ys, color=PATH_COLOUR, linewidth=2.5, solid_capstyle="butt", zorder=5)
    return True


def timeline_figure(spans: pd.DataFrame, results: Mapping[str, Any] | None = None,
                    all_ranks: bool = False) -> Figure:
    """Per-stage Gantt chart of a span table (see the module notes)."""
    spans = normalize_spans(spans)
    rows = _timeline_rows(spans, all_ranks, path_ranks(results or {}))
    bands = _stream_bands(sorted(set(spans["stream"])))
    bars = _split_waits(spans).merge(rows[["rank", "row"]], on="rank")
    # astype: an empty column maps to strings, not numbers
    bars["y0"] = bars["row"] + bars["stream"].map(lambda s: bands[s][0]).astype(float)
    bars["h"] = bars["stream"].map(lambda s: bands[s][1]).astype(float)
    t_first = float(spans["start"].min()) if len(spans) else 0.0
    t_end = float(spans["end"].max()) if len(spans) else 0.0
    t_start = 0.0 if 0.0 <= t_first <= 0.05 * t_end else t_first  # a later window: zoom in
    scale, unit = time_unit(t_end - t_start)
    fig = Figure(figsize=(14, min(2.2 + 0.55 * max(len(rows), 1), 40)), layout="constrained")
    ax = fig.add_subplot()
    kinds = _draw_bars(ax, bars, scale, min_width=(t_end - t_start) / _TIMELINE_PX)
    _timeline_axes(ax, rows, bands, (t_start * scale, t_end * scale), unit)
    handles: list[Any] = [Patch(facecolor=KIND_COLOURS.get(k, OTHER_COLOUR), label=k)
                          for k in kinds]
    if (spans["chunk"] % 2 == 1).any():
        handles.append(Patch(facecolor=KIND_COLOURS["forward"], alpha=0.6,
                             label="lighter: odd virtual chunk"))
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle (bubble)"))
    phase = (results or {}).get("pipeline_phase_s")
    if phase and len(phase) == 2:
        for t in phase:
            ax.axvline(float(t) * scale, color="#555555", linestyle="--", linewidth=0.8)
        handles.append(Line2D([], [], color="#555555", linestyle="--", label="pipeline phase"))
    if _draw_critical_path(ax, spans, rows, bands, (results or {}).get("critical_path"), scale,
                           all_ranks):
        handles.append(Line2D([], [], color=PATH_COLOUR, linewidth=2.5, label="critical path"))
    if spans.empty:
        ax.text(0.5, 0.5, "no spans recorded", transform=ax.transAxes, ha="center")
    ax.set_title(_timeline_title(spans, results), fontsize=11)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 12),
               fontsize=8, frameon=False)
    _label_microbatches(ax, fig, bars, scale)
    return fig


def plot_timeline(spans: pd.DataFrame, results: Mapping[str, Any] | None,
                  path: str | os.PathLike[str], all_ranks: bool = False) -> Path:
    """Save :func:`timeline_figure` as a PNG at ``path``."""
    return save(timeline_figure(spans, results, all_ranks), path)
