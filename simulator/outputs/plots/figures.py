"""Figures drawn from a run's files: timeline, time breakdown and memory.

The breakdown stacks the accounting's categories (:mod:`simulator.analysis.accounting`)
per stage: a partition of the step, so each bar is exactly the step time. The
timeline draws a collective's peer-wait (before ``comm_start``) apart from its
transfer, and the critical path as a line under the bars.

Plots read a span table (:mod:`simulator.outputs.span_table`'s columns) and a
``results.json`` dict, never simulation objects, so ``clustersim plot DIR``
re-draws a finished run. Every figure is a :class:`matplotlib.figure.Figure`
rendered by the Agg canvas; pyplot is never imported, so no figure outlives its
function and concurrent runs in one process share no state. ``*_figure``
functions return the figure (for notebooks and tests); ``plot_*`` save it
atomically and return the path.

Timeline: one row per pipeline stage, drawn from the stage's lowest rank (all
ranks of a stage run the same program unless a scenario makes them differ;
``all_ranks=True`` draws every rank). The compute stream is the main bar; the
other streams (pp, dp, host, ...) are thinner sub-rows below it, so white gaps
in the main bar are the pipeline bubble. Bars are one
:class:`~matplotlib.collections.PolyCollection` per kind, added without
autoscaling: 250,000 spans draw in about 1.5 s. Micro-batch numbers are written into
the compute bars when there are few enough (one label per contiguous run of a
micro-batch's forward, backward, ... including the TP collectives between its
layers) and the run is wide enough to hold its label.
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
from matplotlib.cm import ScalarMappable
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import Normalize, to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from simulator.analysis import accounting as acc
from simulator.outputs.run_files import read_results, read_spans
from simulator.outputs.span_table import normalize_spans, stage_representatives
from simulator.outputs.timeline_files import timeline_path, timeline_stage_ranks
from simulator.outputs.trace_export import atomic_output

#: Bar colour of each span kind (Tableau 10), in legend order.
KIND_COLOURS: Mapping[str, str] = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "weight_grad": "#E45756",
    "recompute": "#72B7B2",
    "tp": "#B279A2",
    "pp": "#54A24B",
    "dp": "#EECA3B",
    "zero": "#9D755D",
    "optimizer": "#BAB0AC",
    "offload": "#FF9DA6",
    "embedding_tie": "#8CD17D",
    "wait": "#D9D9D9",  # a collective's member waiting for its peers
}
_OTHER_COLOUR = "#79706E"
_BUBBLE_COLOUR = "#E6E6E6"
_CAPACITY_COLOUR = "#C00000"
_PATH_COLOUR = "#D62728"
_LABELLED_KINDS = ("forward", "backward", "weight_grad", "recompute")
_STREAM_ORDER = ("compute", "pp", "dp", "host")
_MAX_LABELS = 400  # more micro-batch labels than this are unreadable
_EDGED_SPANS = 1_000  # up to this many bars, a white edge separates neighbours; beyond,
# bars are a few pixels wide and the edge would swallow them
_MANY_SPANS = 200_000  # above this, bars are drawn without antialiasing (faster)
_TIMELINE_PX = 1500  # about the time axis' width in pixels (14 in at _DPI)
_GB = 1e9  # decimal gigabytes, as the CLI and README
_DPI = 120


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Render ``fig`` to PNG at ``path`` via a temporary file in the same directory."""
    FigureCanvasAgg(fig)
    engine = fig.get_layout_engine()
    if engine is not None:  # lay out once now; savefig would otherwise draw everything twice
        engine.execute(fig)
        fig.set_layout_engine("none")
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=_DPI)
    return Path(path)


def _time_unit(t_max: float) -> tuple[float, str]:
    """Scale factor from seconds and the axis unit for a time span of ``t_max`` s."""
    if t_max < 2e-3:
        return 1e6, "µs"
    if t_max < 2.0:
        return 1e3, "ms"
    return 1.0, "s"


def _format_seconds(t: float) -> str:
    """``t`` with three significant digits in s, ms or µs (never "1.08e+03 ms")."""
    if t >= 1.0:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


def _scenario_header(results: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any]]:
    """The scenario's name and its ``parallel`` section (empty when absent)."""
    scenario = (results or {}).get("scenario") or {}
    parallel = scenario.get("parallel") or {}
    return str(scenario.get("name", "")), parallel


# --- timeline ------------------------------------------------------------------------


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
            cast(Any, verts), facecolors=KIND_COLOURS.get(str(kind), _OTHER_COLOUR),
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


def _text_colour(face: str) -> str:
    r, g, b = to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


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
    axes_px = fig.get_figwidth() * _DPI * ax.get_position().width
    px_per_unit = axes_px / max(x_hi - x_lo, 1e-30)
    count = 0
    columns = (runs[c].tolist() for c in ("microbatch", "kind", "start", "end", "y0", "h"))
    for mb, kind, start, end, y0, h in zip(*columns, strict=True):
        text = str(mb)
        if (end - start) * scale * px_per_unit < 7 * len(text) + 4:
            continue
        ax.text((start + end) / 2 * scale, y0 + h / 2, text,
                ha="center", va="center", fontsize=7, zorder=3, clip_on=True,
                color=_text_colour(KIND_COLOURS.get(str(kind), _OTHER_COLOUR)))
        count += 1
    return count


def _timeline_title(spans: pd.DataFrame, results: Mapping[str, Any] | None) -> str:
    name, parallel = _scenario_header(results)
    results = results or {}
    shape = ", ".join(f"{k}={parallel[k]}" for k in ("tp", "pp", "dp") if k in parallel)
    m = int(spans["microbatch"].max()) + 1 if len(spans) else 0
    head = " · ".join(p for p in (name, str(parallel.get("schedule", "")), shape,
                                  f"m={m}" if m > 0 else "") if p)
    facts = []
    if "step_time_s" in results:
        facts.append(f"step {_format_seconds(float(results['step_time_s']))}")
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
    ax.plot(xs, ys, color=_PATH_COLOUR, linewidth=2.5, solid_capstyle="butt", zorder=5)
    return True


def timeline_figure(spans: pd.DataFrame, results: Mapping[str, Any] | None = None,
                    all_ranks: bool = False) -> Figure:
    """Per-stage Gantt chart of a span table (see the module notes)."""
    spans = normalize_spans(spans)
    rows = _timeline_rows(spans, all_ranks, _path_ranks(results or {}))
    bands = _stream_bands(sorted(set(spans["stream"])))
    bars = _split_waits(spans).merge(rows[["rank", "row"]], on="rank")
    # astype: an empty column maps to strings, not numbers
    bars["y0"] = bars["row"] + bars["stream"].map(lambda s: bands[s][0]).astype(float)
    bars["h"] = bars["stream"].map(lambda s: bands[s][1]).astype(float)
    t_first = float(spans["start"].min()) if len(spans) else 0.0
    t_end = float(spans["end"].max()) if len(spans) else 0.0
    t_start = 0.0 if 0.0 <= t_first <= 0.05 * t_end else t_first  # a later window: zoom in
    scale, unit = _time_unit(t_end - t_start)
    fig = Figure(figsize=(14, min(2.2 + 0.55 * max(len(rows), 1), 40)), layout="constrained")
    ax = fig.add_subplot()
    kinds = _draw_bars(ax, bars, scale, min_width=(t_end - t_start) / _TIMELINE_PX)
    _timeline_axes(ax, rows, bands, (t_start * scale, t_end * scale), unit)
    handles: list[Any] = [Patch(facecolor=KIND_COLOURS.get(k, _OTHER_COLOUR), label=k)
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
        handles.append(Line2D([], [], color=_PATH_COLOUR, linewidth=2.5, label="critical path"))
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
    return _save(timeline_figure(spans, results, all_ranks), path)


# --- breakdown -----------------------------------------------------------------------


def _category_style(category: str) -> dict[str, Any]:
    """Face colour and hatch of an accounting category: compute in its kind's colour,
    transfers solid and peer-waits hatched in their comm kind's, idle in greys."""
    if category in acc.COMM_CATEGORIES:
        kind, part = category.rsplit("_", 1)
        colour = KIND_COLOURS.get(kind, _OTHER_COLOUR)
        return {"color": colour, "hatch": ".." if part == "wait" else None,
                "alpha": 0.55 if part == "wait" else 1.0}
    styles = {"forward": (KIND_COLOURS["forward"], None),
              "backward_input": (KIND_COLOURS["backward"], None),
              "backward_weight": (KIND_COLOURS["weight_grad"], None),
              "recompute": (KIND_COLOURS["recompute"], None),
              "optimizer": (KIND_COLOURS["optimizer"], None),
              "pipeline_bubble": (_BUBBLE_COLOUR, "//"),
              "imbalance_idle": ("#C9C9C9", "xx"),
              "tail": ("#F7F7F7", "--")}
    colour, hatch = styles.get(category, (_OTHER_COLOUR, None))
    return {"color": colour, "hatch": hatch, "alpha": 1.0}


def breakdown_segments(results: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Seconds per pipeline stage of every accounting category that occurs, from
    ``time_breakdown_s`` (the mean over each stage's simulated ranks). Each stage's
    segments sum to the step time: they are a partition, nothing is clamped."""
    entries = results.get("time_breakdown_s")
    if not isinstance(entries, list) or not entries:
        raise ValueError("results.json has no time_breakdown_s: re-run the scenario with this "
                         "version of clustersim")
    stages = acc.stage_breakdown(entries)
    segments = {c: np.array([st[c] for st in stages], dtype=float) for c in acc.CATEGORIES}
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
    scale, unit = _time_unit(max(step, float(total.max(initial=0.0))))
    fig = Figure(figsize=(min(5 + 0.5 * n, 16), 5), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(n)
    bottom = np.zeros(n)
    for category, seconds in segments.items():
        style = _category_style(category)
        ax.bar(x, seconds * scale, bottom=bottom, width=0.7, label=acc.label(category),
               color=style["color"], alpha=style["alpha"], hatch=style["hatch"],
               edgecolor="#888888", linewidth=0.4)
        bottom += seconds * scale
    if step > 0:
        ax.axhline(step * scale, color="black", linestyle="--", linewidth=0.8,
                   label=f"step time {_format_seconds(step)}")
    _label_bubbles(ax, results, segments, scale)
    ax.set_xticks(x, [str(i) for i in x], fontsize=8 if n <= 32 else 6)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(f"time per step ({unit})")
    ax.set_ylim(0, max(float(bottom.max(initial=0.0)), step * scale) * 1.1 or 1.0)
    name, parallel = _scenario_header(results)
    ax.set_title(" · ".join(p for p in (name, str(parallel.get("schedule", "")),
                                        "where each stage's step goes") if p), fontsize=11)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize=8, frameon=False)
    return fig


def plot_breakdown(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Save :func:`breakdown_figure` as a PNG at ``path``."""
    return _save(breakdown_figure(results), path)


# --- memory --------------------------------------------------------------------------

MEMORY_PARTS: Mapping[str, str] = {
    "weights": "#4C78A8",
    "gradients": "#F58518",
    "optimizer": "#54A24B",
    "activations": "#E45756",
    "logits": "#B279A2",
    "comm_buffers": "#9D755D",
}


def _memory_bars(ax: Axes, memory: Sequence[Mapping[str, Any]]) -> None:
    """Stacked GB per stage against capacity (a red line; "OOM" over a bar above it)."""
    x = np.arange(len(memory))
    bottom = np.zeros(len(memory))
    for part, colour in MEMORY_PARTS.items():
        gb = np.array([float(m.get(part, 0.0)) for m in memory]) / _GB
        if gb.any():
            ax.bar(x, gb, bottom=bottom, width=0.7, color=colour, label=part.replace("_", " "),
                   edgecolor="white", linewidth=0.4)
            bottom += gb
    capacity = np.array([float(m.get("capacity", 0.0)) for m in memory]) / _GB
    if capacity.any() and np.ptp(capacity) == 0:
        ax.axhline(capacity[0], color=_CAPACITY_COLOUR, linewidth=1.6,
                   label=f"capacity ({capacity[0]:.0f} GB)")
    elif capacity.any():
        ax.hlines(capacity, x - 0.45, x + 0.45, color=_CAPACITY_COLOUR, linewidth=1.6,
                  label="capacity")
    totals = np.array([float(m.get("total", b * _GB)) for m, b in zip(memory, bottom,
                                                                        strict=True)]) / _GB
    for i, (total, cap) in enumerate(zip(totals, capacity, strict=True)):
        over = cap > 0 and total > cap
        if over or len(memory) <= 16:
            ax.text(i, max(bottom[i], cap if over else 0),
                    f"{total:.1f}\nOOM" if over else f"{total:.1f}", ha="center", va="bottom",
                    fontsize=7,
                    color=_CAPACITY_COLOUR if over else "black")
    labels = [str(m.get("stage", i)) for i, m in enumerate(memory)]
    ax.set_xticks(x, labels, fontsize=8 if len(memory) <= 32 else 6)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GB per GPU")
    ax.set_ylim(0, max(float(bottom.max(initial=0.0)), float(capacity.max(initial=0.0)))
                * 1.12 or 1.0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)


_RANK_COLOURS = ("C0", "C1", "C2", "C4", "C5", "C6", "C7", "C8", "C9")  # no red: capacity is red


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
    scale, unit = _time_unit(t_max)
    segments = []
    for _, c in curves:  # a post-step curve: hold each value until the next point (or the end)
        xs = np.append(np.repeat(c[:, 0], 2)[1:], t_max) * scale
        ys = np.repeat(c[:, 1], 2) / _GB
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
        handles.append(ax.axhline(capacity / _GB, color=_CAPACITY_COLOUR, linewidth=1.6,
                                  linestyle="--", label="capacity"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
                  frameon=False)
    y_max = max(float(s[:, 1].max()) for s in segments)
    ax.set_xlim(0, t_max * scale * 1.01 or 1.0)
    ax.set_ylim(0, max(y_max, capacity / _GB) * 1.08 or 1.0)
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
    name, _ = _scenario_header(results)
    peak = float(results.get("memory_peak_bytes", 0.0)) / _GB
    verdict = "fits" if results.get("fits_in_memory", True) else "DOES NOT FIT"
    title = f"peak {peak:.1f} GB" + (f" of {capacity / _GB:.0f} GB" if capacity else "")
    axes[0].set_title(" · ".join(p for p in (name, title, verdict) if p), fontsize=11)
    return fig


def plot_memory(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Save :func:`memory_figure` as a PNG at ``path``."""
    return _save(memory_figure(results), path)


# --- a run directory -----------------------------------------------------------------


def _path_ranks(results: Mapping[str, Any]) -> dict[int, float]:
    """The ranks the critical path visits, with its seconds on each."""
    path = results.get("critical_path")
    out: dict[int, float] = {}
    for seg in path if isinstance(path, list) else ():
        if isinstance(seg, Mapping) and "rank" in seg:
            r = int(seg["rank"])
            out[r] = out.get(r, 0.0) + float(seg.get("end", 0.0)) - float(seg.get("start", 0.0))
    return out


def _drawn_ranks(stage_ranks: list[int], results: Mapping[str, Any]) -> list[int]:
    """The ranks the timeline needs: one per stage, and those the critical path visits
    (it is drawn on their stage's row)."""
    return sorted(set(stage_ranks) | set(_path_ranks(results)))


def plot_all(out_dir: str | os.PathLike[str], results: Mapping[str, Any] | None = None,
             spans: pd.DataFrame | None = None) -> list[Path]:
    """Re-draw a run's PNGs from ``out_dir/results.json`` and its timeline
    (``timeline.parquet`` or ``timeline.csv``), or from ``results`` and ``spans`` when
    given (a run that has just computed them).

    Writes ``timeline.png`` (only when there is a timeline: an analytic run has
    no spans), ``breakdown.png`` and ``memory.png``; returns the paths written. Only
    the ranks the timeline draws are read (one per stage, and the critical path's),
    so a full-fidelity run's ten million spans are never all loaded.
    """
    out = Path(out_dir)
    if results is None:
        results_path = out / "results.json"
        if not results_path.is_file():
            raise FileNotFoundError(
                f"{results_path} not found: is {out} a clustersim run directory?")
        results = read_results(results_path)
    if spans is not None:
        spans = spans[spans["rank"].isin(_drawn_ranks(stage_representatives(spans), results))]
    elif (path := timeline_path(out)) is not None:
        spans = read_spans(path, _drawn_ranks(timeline_stage_ranks(path), results))
    written = []
    if spans is not None:
        written.append(plot_timeline(spans, results, out / "timeline.png"))
    written.append(plot_breakdown(results, out / "breakdown.png"))
    written.append(plot_memory(results, out / "memory.png"))
    return written
