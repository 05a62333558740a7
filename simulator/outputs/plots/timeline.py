"""The timeline: one row per pipeline stage, drawn from the stage's lowest rank (all
ranks of a stage run the same program unless a scenario makes them differ;
``all_ranks=True`` draws every rank). The compute stream is the main bar; the
other streams (pp, dp, host, ...) are thinner sub-rows below it, so white gaps
in the main bar are the pipeline bubble. Every bar has the colour of its accounting
category, as the breakdown draws it (:func:`~simulator.outputs.plots.common.category_style`):
a fused backward in two parts, backward input then its ``weight_s`` of backward weight;
a collective's peer-wait (before ``comm_start``) hatched in its kind's colour, apart
from its transfer. The critical path is a line under the bars. When the step holds
many micro-batches a second panel zooms into the steady state (a few micro-batches'
cycles in the middle of the pipeline phase, framed on the whole-step panel), where
single forwards and backwards and their micro-batch numbers can be read. Bars are
one :class:`~matplotlib.collections.PolyCollection` per category, added without
autoscaling: 250,000 spans draw in about 1.5 s. Micro-batch
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

from simulator.analysis.accounting.vocabulary import categories, label
from simulator.outputs.plots.common import (
    COMPUTE_SPAN_CATEGORY,
    DPI,
    PATH_COLOUR,
    category_style,
    format_seconds,
    path_ranks,
    save,
    scenario_header,
    text_colour,
    time_unit,
)
from simulator.outputs.span_table import normalize_spans

_LABELLED_KINDS = ("forward", "backward", "weight_grad", "recompute")
_COMPUTE = frozenset(COMPUTE_SPAN_CATEGORY.values())


_STREAM_ORDER = ("compute", "pp", "dp", "host")


_MAX_LABELS = 400  # more micro-batch labels than this are unreadable


_EDGED_SPANS = 1_000  # up to this many bars, a white edge separates neighbours; beyond,


# bars are a few pixels wide and the edge would swallow them
_MANY_SPANS = 200_000  # above this, bars are drawn without antialiasing (faster)


_TIMELINE_PX = 1500  # about the time axis' width in pixels (14 in at DPI)
_ZOOM_MIN_MICROBATCHES = 8  # from this many micro-batches on, a steady-state zoom panel
_ZOOM_CYCLES = 4  # micro-batch cycles the zoom shows


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
    """One PolyCollection per (category, chunk parity); returns the categories drawn, in
    the vocabulary's order.

    Bars off the compute stream are at least ``min_width`` (seconds, about a
    pixel) wide, so that a 50 µs send in a one-second step still shows; compute
    bars keep their width, as their neighbours share the pixel (antialiasing then
    mixes the colours by time share). Compute categories are drawn last, on top.
    """
    many = len(bars) >= _MANY_SPANS
    edges = len(bars) <= _EDGED_SPANS
    for (category, odd), group in bars.groupby(["category", bars["chunk"] % 2], sort=False):
        start = group["start"].to_numpy()
        widen = np.where(group["stream"].to_numpy() == "compute", 0.0, min_width)
        end = np.maximum(group["end"].to_numpy(), start + widen)
        verts = _bar_polys(start * scale, end * scale, group["y0"].to_numpy(),
                           group["h"].to_numpy())
        style = category_style(str(category))
        # an (n, 4, 2) array (not a list) takes PolyCollection's fast path
        ax.add_collection(PolyCollection(
            cast(Any, verts), facecolors=style["color"], hatch=style["hatch"],
            alpha=style["alpha"] * (0.6 if odd else 1.0),  # odd virtual chunks are lighter
            edgecolors="white" if edges else "none", linewidths=0.3 if edges else 0,
            antialiased=not many, zorder=2.1 if category in _COMPUTE else 2.0,
        ), autolim=False)  # the caller sets the limits; extents of 1e5 paths cost seconds
    return _in_order({str(c) for c in bars["category"].unique()})


def _in_order(present: set[str]) -> list[str]:
    order = {c: i for i, c in enumerate(categories())}
    return sorted(present, key=lambda c: (order.get(c, len(order)), c))


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
                color=text_colour(category_style(COMPUTE_SPAN_CATEGORY.get(str(kind),
                                                                           str(kind)))["color"]))
        count += 1
    return count


def _timeline_title(spans: pd.DataFrame, results: Mapping[str, Any] | None) -> str:
    name, parallel = scenario_header(results)
    results = results or {}
    shape = ", ".join(f"{k}={parallel[k]}" for k in ("tp", "pp", "dp", "dp_shard")
                      if parallel.get(k) is not None)
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


def categorised(spans: pd.DataFrame) -> pd.DataFrame:
    """The bars of a span table, each with its accounting ``category``: a fused
    backward split into backward input and its ``weight_s`` of backward weight, a
    collective whose members arrived at different times into its peer-wait (up to
    ``comm_start``) and its transfer."""
    kind = spans["kind"].astype(str)
    compute = kind.map(COMPUTE_SPAN_CATEGORY)
    comm = spans["stream"].ne("host") & compute.isna() & kind.ne("")
    category = compute.fillna(kind.where(~comm, kind + "_transfer"))
    bars = spans.assign(category=category.to_numpy())
    weight = np.minimum(bars["weight_s"].to_numpy(), (bars["end"] - bars["start"]).to_numpy())
    split = (bars["category"] == "backward_input").to_numpy() & (weight > 0)
    waiting = (bars["comm_start"] > bars["start"]).to_numpy() & comm.to_numpy()
    if not split.any() and not waiting.any():
        return bars
    weights = bars[split].copy()
    weights["start"] = weights["end"] - weight[split]
    weights["category"] = "backward_weight"
    waits = bars[waiting].copy()
    waits["end"] = waits["comm_start"]
    waits["category"] = kind[waiting].to_numpy() + "_wait"
    moved = bars.copy()
    moved.loc[split, "end"] = weights["start"].to_numpy()
    moved.loc[waiting, "start"] = moved.loc[waiting, "comm_start"]
    return pd.concat([moved, weights, waits], ignore_index=True)


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


def steady_window(spans: pd.DataFrame, results: Mapping[str, Any] | None
                  ) -> tuple[float, float] | None:
    """The zoom panel's time window: :data:`_ZOOM_CYCLES` micro-batch cycles (the
    pipeline phase over m + p - 1 slots) around the middle of the pipeline phase, or
    None when the step holds fewer than :data:`_ZOOM_MIN_MICROBATCHES` micro-batches
    (the whole-step panel then shows them all)."""
    phase = (results or {}).get("pipeline_phase_s")
    m = int(spans["microbatch"].max()) + 1 if len(spans) else 0
    if m < _ZOOM_MIN_MICROBATCHES or not phase or len(phase) != 2:
        return None
    lo, hi = float(phase[0]), float(phase[1])
    stages = int(spans["stage"].max()) + 1
    width = min(hi - lo, _ZOOM_CYCLES * (hi - lo) / (m + stages - 1))
    middle = (lo + hi) / 2
    return middle - width / 2, middle + width / 2


def _legend(categories_drawn: list[str], spans: pd.DataFrame) -> list[Any]:
    handles: list[Any] = []
    for c in categories_drawn:
        style = category_style(c)
        handles.append(Patch(facecolor=style["color"], hatch=style["hatch"],
                             alpha=style["alpha"], edgecolor="#999999" if style["hatch"]
                             else "none", label=label(c)))
    if (spans["chunk"] % 2 == 1).any():
        handles.append(Patch(facecolor=category_style("forward")["color"], alpha=0.6,
                             label="lighter: odd virtual chunk"))
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle (bubble)"))
    return handles


def _panel(ax: Axes, spans: pd.DataFrame, bars: pd.DataFrame, rows: pd.DataFrame,
           bands: Mapping[str, tuple[float, float]], results: Mapping[str, Any] | None,
           window: tuple[float, float], unit_scale: tuple[float, str],
           all_ranks: bool) -> tuple[list[str], bool]:
    """One panel over ``window`` (seconds): bars, axes, phase lines and critical path;
    returns the categories drawn and whether the path was."""
    scale, unit = unit_scale
    t_lo, t_hi = window
    inside = bars[(bars["end"] >= t_lo) & (bars["start"] <= t_hi)]
    drawn = _draw_bars(ax, inside, scale, min_width=(t_hi - t_lo) / _TIMELINE_PX)
    _timeline_axes(ax, rows, bands, (t_lo * scale, t_hi * scale), unit)
    phase = (results or {}).get("pipeline_phase_s")
    if phase and len(phase) == 2:
        for t in phase:
            ax.axvline(float(t) * scale, color="#555555", linestyle="--", linewidth=0.8)
    path = _draw_critical_path(ax, spans, rows, bands, (results or {}).get("critical_path"),
                               scale, all_ranks)
    return drawn, path


def timeline_figure(spans: pd.DataFrame, results: Mapping[str, Any] | None = None,
                    all_ranks: bool = False) -> Figure:
    """Per-stage Gantt chart of a span table, with a steady-state zoom when the step
    holds many micro-batches (see the module notes)."""
    spans = normalize_spans(spans)
    rows = _timeline_rows(spans, all_ranks, path_ranks(results or {}))
    bands = _stream_bands(sorted(set(spans["stream"])))
    bars = categorised(spans).merge(rows[["rank", "row"]], on="rank")
    # astype: an empty column maps to strings, not numbers
    bars["y0"] = bars["row"] + bars["stream"].map(lambda s: bands[s][0]).astype(float)
    bars["h"] = bars["stream"].map(lambda s: bands[s][1]).astype(float)
    t_first = float(spans["start"].min()) if len(spans) else 0.0
    t_end = float(spans["end"].max()) if len(spans) else 0.0
    t_start = 0.0 if 0.0 <= t_first <= 0.05 * t_end else t_first  # a later window: zoom in
    zoom = steady_window(spans, results)
    height = min(2.2 + 0.55 * max(len(rows), 1), 40)
    fig = Figure(figsize=(14, height * (1.8 if zoom else 1.0)), layout="constrained")
    axes = fig.subplots(2 if zoom else 1, 1, squeeze=False)[:, 0]
    scale = time_unit(t_end - t_start)
    drawn, path = _panel(axes[0], spans, bars, rows, bands, results, (t_start, t_end), scale,
                         all_ranks)
    if zoom:
        axes[0].axvspan(zoom[0] * scale[0], zoom[1] * scale[0], facecolor="none",
                        edgecolor="black", linewidth=1.2, zorder=4)
        zscale = scale  # the whole step's unit: the zoom's ticks read as times in the step
        zdrawn, _ = _panel(axes[1], spans, bars, rows, bands, results, zoom, zscale, all_ranks)
        drawn = _in_order(set(drawn) | set(zdrawn))
        axes[1].set_title(f"steady state, zoomed: {format_seconds(zoom[1] - zoom[0])} in the "
                          "middle of the pipeline phase (framed above)", fontsize=10)
    handles = _legend(drawn, spans)
    if (results or {}).get("pipeline_phase_s"):
        handles.append(Line2D([], [], color="#555555", linestyle="--", label="pipeline phase"))
    if path:
        handles.append(Line2D([], [], color=PATH_COLOUR, linewidth=2.5, label="critical path"))
    if spans.empty:
        axes[0].text(0.5, 0.5, "no spans recorded", transform=axes[0].transAxes, ha="center")
    axes[0].set_title(_timeline_title(spans, results), fontsize=11)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8),
               fontsize=8, frameon=False)
    if zoom:
        shown = bars[(bars["end"] > zoom[0]) & (bars["start"] < zoom[1])]
        _label_microbatches(axes[1], fig, shown, zscale[0])
    else:
        _label_microbatches(axes[0], fig, bars, scale[0])
    return fig


def plot_timeline(spans: pd.DataFrame, results: Mapping[str, Any] | None,
                  path: str | os.PathLike[str], all_ranks: bool = False) -> Path:
    """Save :func:`timeline_figure` as a PNG at ``path``."""
    return save(timeline_figure(spans, results, all_ranks), path)
