"""Figures of a search: the planner's Pareto plot and a sweep's heatmap.

Both read the files a search wrote (``plan.csv`` + ``plan.json``, ``sweep.csv`` +
``sweep.json``), never live objects, so ``clustersim plot DIR`` re-draws them.
Figures are rendered by the Agg canvas as in :mod:`simulator.outputs.plots.figures` (no pyplot).

Pareto: every candidate that fits, step time (the analytic estimate, log
scale) against peak memory per GPU; the frontier (no other candidate is both
smaller and faster) joined as a step line; the engine's step time of each
re-simulated candidate beside its estimate; the chosen layout labelled; the
GPU's capacity as a vertical line.

Heatmap: step time over two swept axes (the first two with more than one
value, or the two named). Where other axes vary too, a cell shows the fastest
point that fits among them; a cell with no such point says why (invalid or
out of memory).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from simulator.errors import Problem, UserError
from simulator.outputs.plots.common import save
from simulator.search.plan import degrees_label

_CLOUD = "#9FB4CC"
_FRONTIER = "#1F4E79"
_ENGINE = "#E45756"
_CAPACITY = "#C00000"
_PLAIN = FuncFormatter(lambda v, _: f"{v:.4g}")  # 20, not 2 x 10^1, on log axes


_PLAN_FIX = "plan again (`clustersim plan ... --out DIR`)"
_SWEEP_FIX = "sweep again (`clustersim sweep ... --out DIR`)"


# ---------------------------------------------------------------- Pareto


def _pareto_title(meta: dict[str, Any]) -> str:
    req, counts = meta.get("request", {}), meta.get("counts", {})
    if not req:
        return "plan: step time against peak memory"
    refused = counts.get("not_yet_simulated", 0)
    return (f"{req['model']} on {req['gpus']:,} GPUs ({req['system']}), global batch "
            f"{req['global_batch']}: {counts.get('candidates', 0):,} candidates"
            f"{f' ({refused:,} not yet simulated)' if refused else ''}, "
            f"{counts.get('fit', 0):,} fit, {counts.get('simulated', 0)} simulated")


def _chosen_label(row: pd.Series) -> str:
    sched = row["schedule"] + (f" v{row['virtual_stages']}" if row["virtual_stages"] > 1 else "")
    extras = [f"ZeRO-{row['zero']}", f"recompute {row['recompute']}"]
    if bool(row["sequence_parallel"]):
        extras.append("SP")
    return (f"chosen: {degrees_label(row)}, {sched}, b "
            f"{row['micro_batch']}\n{', '.join(extras)}\n{row['engine_step_time_s']:.2f} s "
            f"(engine), {row['peak_memory_GB']:.1f} GB")


def pareto_figure(table: pd.DataFrame, meta: dict[str, Any] | None = None) -> Figure:
    """Step time against peak memory of every candidate that fits (module note)."""
    meta = meta or {}
    fits = table[table["fits"].astype(bool)]
    fig = Figure(figsize=(10, 6.2), layout="constrained")
    ax = fig.add_subplot()
    ax.scatter(fits["peak_memory_GB"], fits["analytic_step_time_s"], s=9, c=_CLOUD,
               alpha=0.6, linewidths=0, label=f"candidate that fits ({len(fits):,}), analytic")
    front = fits[fits["pareto"].astype(bool)].sort_values("peak_memory_GB")
    ax.step(front["peak_memory_GB"], front["analytic_step_time_s"], where="post",
            color=_FRONTIER, lw=1.4)
    ax.scatter(front["peak_memory_GB"], front["analytic_step_time_s"], s=28, c=_FRONTIER,
               zorder=3, label=f"Pareto frontier ({len(front)})")
    sim = fits[fits["engine_step_time_s"].notna()]
    for _, row in sim.iterrows():
        ax.plot([row["peak_memory_GB"]] * 2,
                [row["analytic_step_time_s"], row["engine_step_time_s"]], color=_ENGINE, lw=0.8)
    ax.scatter(sim["peak_memory_GB"], sim["engine_step_time_s"], marker="D", s=30,
               facecolors="none", edgecolors=_ENGINE, zorder=4,
               label=f"re-simulated by the engine ({len(sim)})")
    chosen = fits[fits["chosen"].astype(bool)]
    if len(chosen):
        row = chosen.iloc[0]
        x, y = row["peak_memory_GB"], row["engine_step_time_s"]
        ax.scatter([x], [y], marker="*", s=260, c=_ENGINE, edgecolors="black", zorder=5,
                   label="chosen: the engine's fastest")
        right = x > float(fits["peak_memory_GB"].median())
        ax.annotate(_chosen_label(row), (x, y), xytext=(-40 if right else 40, 70),
                    textcoords="offset points", ha="right" if right else "left",
                    va="bottom", fontsize=9,
                    bbox={"boxstyle": "round", "fc": "white", "ec": "0.6"},
                    arrowprops={"arrowstyle": "->", "color": "0.3"})
    capacity = meta.get("gpu_memory_GB")
    if capacity:
        ax.axvline(capacity, color=_CAPACITY, ls="--", lw=1)
        ax.text(capacity, 0.02, f" {capacity:g} GB", color=_CAPACITY, va="bottom",
                ha="right", rotation=90, transform=ax.get_xaxis_transform())
    usable = meta.get("usable_GB")  # capacity less the planner's headroom
    if capacity and usable and usable < capacity:
        ax.axvline(usable, color=_CAPACITY, ls=":", lw=1)
        ax.text(usable, 0.02, f" {usable:.1f} GB less headroom", color=_CAPACITY,
                va="bottom", ha="right", rotation=90, transform=ax.get_xaxis_transform())
    if len(fits):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_PLAIN)
        ax.yaxis.set_minor_formatter(_PLAIN)
    ax.set_xlabel("peak memory per GPU (GB)")
    ax.set_ylabel("step time (s, log scale)")
    ax.set_title(_pareto_title(meta), fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_pareto(plan_dir: str | os.PathLike[str]) -> Path:
    """``pareto.png`` from ``plan_dir/plan.csv`` and ``plan.json``."""
    from simulator.outputs.run_files import PlanMeta, read_meta, read_table

    out = Path(plan_dir)
    table = read_table(out / "plan.csv", _PLAN_FIX)
    meta = read_meta(out / "plan.json", PlanMeta, _PLAN_FIX)
    return save(pareto_figure(table, meta), out / "pareto.png")


# ---------------------------------------------------------------- heatmap


def heatmap_axes(table: pd.DataFrame, axes: Sequence[str]) -> tuple[str, str]:
    """The two axes to draw: the first two with more than one value."""
    varied = [a for a in axes if a in table and table[a].nunique() > 1]
    if len(varied) < 2:
        raise UserError([Problem("sweep", ", ".join(axes) or "(no axes)", "a heatmap needs two "
                                 "swept axes with more than one value each; sweep at least "
                                 "two --grid keys")])
    return varied[0], varied[1]


def _order(values: pd.Series) -> list[str]:
    """Axis values in numeric order when they are numbers, else first-seen order."""
    seen = list(dict.fromkeys(values.astype(str)))
    try:
        return sorted(seen, key=float)
    except ValueError:
        return seen


def heatmap_grid(table: pd.DataFrame, x: str, y: str) -> tuple[list[str], list[str],
                                                                 np.ndarray, list[list[str]]]:
    """(x values, y values, fastest step time that fits per cell, note per cell)."""
    xs, ys = _order(table[x]), _order(table[y])
    grid = np.full((len(ys), len(xs)), math.nan)
    notes = [["" for _ in xs] for _ in ys]
    valid = table["error"].astype("string").fillna("") == ""
    fits = valid & table.get("fits_in_memory", pd.Series(False, index=table.index)) \
        .fillna(False).astype(bool)
    for (j, yv), (i, xv) in ((jy, ix) for jy in enumerate(ys) for ix in enumerate(xs)):
        cell = (table[x].astype(str) == xv) & (table[y].astype(str) == yv)
        ok = table.loc[cell & fits, "step_time_s"]
        if len(ok):
            grid[j, i] = float(ok.min())
        elif (cell & valid).any():
            notes[j][i] = "out of\nmemory"
        elif cell.any():
            notes[j][i] = "invalid"
    return xs, ys, grid, notes


def heatmap_figure(table: pd.DataFrame, x: str, y: str, title: str = "") -> Figure:
    """Step time over axes ``x`` and ``y`` (module note)."""
    xs, ys, grid, notes = heatmap_grid(table, x, y)
    fig = Figure(figsize=(max(5.5, 1.1 * len(xs) + 2.5), max(3.5, 0.6 * len(ys) + 2)),
                 layout="constrained")
    ax = fig.add_subplot()
    ax.set_facecolor("#EEEEEE")
    finite = grid[np.isfinite(grid)]
    norm = LogNorm(finite.min(), max(finite.max(), finite.min() * 1.0001)) if len(finite) \
        else None
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis_r", norm=norm, aspect="auto",
                      origin="lower")
    best = np.nanargmin(grid) if len(finite) else None
    for j in range(len(ys)):
        for i in range(len(xs)):
            value = grid[j, i]
            text = notes[j][i] if math.isnan(value) else f"{value:.4g} s"
            dark = not math.isnan(value) and norm is not None and norm(value) > 0.55
            weight = "bold" if best is not None and j * len(xs) + i == best else "normal"
            ax.text(i, j, text, ha="center", va="center", fontsize=8, weight=weight,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(xs)), xs)
    ax.set_yticks(range(len(ys)), ys)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    others = len(table) // max(len(xs) * len(ys), 1)
    suffix = f": each cell the fastest of its {others} points that fits" if others > 1 else ""
    ax.set_title((title + "\n" if title else "") + f"step time{suffix}", fontsize=10)
    if norm is not None:
        bar = fig.colorbar(image, ax=ax, label="step time (s)")
        bar.ax.yaxis.set_major_formatter(_PLAIN)
        bar.ax.yaxis.set_minor_formatter(_PLAIN)
    return fig


def plot_heatmap(sweep_dir: str | os.PathLike[str], axes: Sequence[str] | None = None) -> Path:
    """``heatmap.png`` from ``sweep_dir/sweep.csv`` (axes from ``sweep.json`` by default)."""
    from simulator.outputs.run_files import SweepMeta, read_meta, read_table

    out = Path(sweep_dir)
    table = read_table(out / "sweep.csv", _SWEEP_FIX)
    meta = read_meta(out / "sweep.json", SweepMeta, _SWEEP_FIX)
    x, y = heatmap_axes(table, list(axes or meta.get("axes", [])))
    title = f"sweep of {meta['scenario']} ({meta.get('method', '')})" if "scenario" in meta else ""
    return save(heatmap_figure(table, x, y, title), out / "heatmap.png")
