"""``train.png``: useful work over wall-clock time of one simulated training run.

Drawn from ``train.json`` and ``train_timeline.csv`` (the median run's events:
``time_s``, ``steps``, ``tokens``, ``event``), never from a live simulation, on
the Agg canvas (no pyplot). Top: tokens trained over days for the whole run,
each unexpected failure a marker coloured by component at the top of its drop,
planned interruptions grey, the failure-free line (no checkpoints, no failures)
dashed for reference, and where the wall time went. Bottom: a zoom on the first
failure — a few checkpoint intervals before and after — where the checkpoints
(ticks), the work lost back to the last checkpoint (bracketed), and the restart
(shaded) are visible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from simulator.errors import Problem, UserError
from simulator.job.reliability import COMPONENTS
from simulator.outputs.trace_export import atomic_output

COLOURS = {"gpu": "#d62728", "host": "#9467bd", "nic": "#ff7f0e", "switch": "#8c564b",
           "software": "#1f77b4", "planned": "#7f7f7f"}
DAY = 86400.0


def _down_spans(t: pd.DataFrame) -> list[tuple[float, float]]:
    """(start, end) of every period down: from a rollback to the next restart."""
    spans, start = [], None
    for time, event in zip(t["time_s"], t["event"], strict=True):
        if event == "rollback" and start is None:
            start = time
        elif event == "restart" and start is not None:
            spans.append((start, time))
            start = None
    return spans


def _mark_interruptions(ax: Axes, t: pd.DataFrame, scale: float, size: float) -> None:
    for cause in (*COMPONENTS, "planned"):
        hit = t[t["event"] == cause]
        if len(hit):
            ax.scatter(hit["time_s"] / scale, hit["tokens"] / 1e12, s=size, marker="v",
                       color=COLOURS[cause], zorder=3, label=f"{cause} ({len(hit)})")


def _overview(ax: Axes, t: pd.DataFrame, res: dict[str, Any]) -> None:
    ax.plot(t["time_s"] / DAY, t["tokens"] / 1e12, color="#2ca02c", lw=1.2,
            label="tokens trained")
    rate = res["tokens_per_step"] / res["step_time_s"]
    end = res["tokens"] / rate
    ax.plot([0, end / DAY], [0, res["tokens"] / 1e12], color="k", ls="--", lw=0.8,
            label=f"no failures, no checkpoints ({end / DAY:.1f} d)")
    _mark_interruptions(ax, t, DAY, 18)
    ax.set_xlabel("wall-clock days")
    ax.set_ylabel("tokens trained (T)")
    ax.set_xlim(0, t["time_s"].max() / DAY * 1.01)
    ax.set_ylim(0, res["tokens"] / 1e12 * 1.04)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncol=2, frameon=False)
    parts = res["breakdown_days"]
    text = "\n".join([f"where the time goes (mean of {res['seeds']} runs)",
                      *(f"{k.replace('_', ' '):<11} {v:7.2f} d" for k, v in parts.items())])
    ax.text(0.99, 0.03, text, transform=ax.transAxes, ha="right", va="bottom",
            multialignment="left", family="monospace", fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "0.8", "boxstyle": "round"})


def _zoom(ax: Axes, t: pd.DataFrame, res: dict[str, Any]) -> None:
    fails = t[t["event"].isin(COMPONENTS)]
    interval = res["checkpoint"]["interval_s"]
    centre = float(fails["time_s"].iloc[0]) if len(fails) else float(t["time_s"].iloc[-1]) / 2
    down = next(((a, b) for a, b in _down_spans(t) if a >= centre), (centre, centre))
    lo, hi = centre - 3.5 * interval, down[1] + 2.5 * interval
    w = t[(t["time_s"] >= lo) & (t["time_s"] <= hi)]
    before, after = t[t["time_s"] < lo].tail(1), t[t["time_s"] > hi].head(1)
    w = pd.concat([before, w, after])
    hours = 3600.0
    ax.plot(w["time_s"] / hours, w["tokens"] / 1e12, color="#2ca02c", lw=1.5)
    ck = w[w["event"] == "checkpoint"]
    ax.scatter(ck["time_s"] / hours, ck["tokens"] / 1e12, marker="|", s=120, color="k",
               zorder=3, label=f"checkpoint (every {interval:,.0f} s)")
    for a, b in _down_spans(w):
        ax.axvspan(a / hours, b / hours, color="#ffbf00", alpha=0.35, lw=0,
                   label=f"restart + reload ({b - a:,.0f} s)")
    _mark_interruptions(ax, w, hours, 60)
    _annotate_loss(ax, w, centre)
    ax.set_xlim(lo / hours, hi / hours)
    ax.set_xlabel("wall-clock hours")
    ax.set_ylabel("tokens trained (T)")
    ax.set_title("zoom on the first failure: the work since the last checkpoint is lost",
                 fontsize=9, loc="left")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper left", fontsize=8, frameon=False)


def _annotate_loss(ax: Axes, w: pd.DataFrame, centre: float) -> None:
    """Bracket the work the first failure loses: from the checkpoint it rolls back to."""
    at = w[(w["time_s"] == centre) & (w["event"] == "rollback")]
    ck = w[(w["event"] == "checkpoint") & (w["time_s"] < centre)]
    if not len(at) or not len(ck):
        return
    back = float(at["tokens"].iloc[0])
    start = ck[ck["tokens"] <= back + 1e-6]
    t0 = float(start["time_s"].iloc[-1]) if len(start) else float(ck["time_s"].iloc[-1])
    ax.annotate("", xy=(t0 / 3600, back / 1e12), xytext=(centre / 3600, back / 1e12),
                arrowprops={"arrowstyle": "<->", "color": "#d62728", "lw": 1})
    ax.annotate(f"lost: {centre - t0:,.0f} s", xy=((t0 + centre) / 2 / 3600, back / 1e12),
                xytext=(0, -5), textcoords="offset points", ha="center", va="top",
                fontsize=8, color="#d62728")


def training_figure(res: dict[str, Any], timeline: pd.DataFrame) -> Figure:
    fig = Figure(figsize=(10, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, height_ratios=[3, 2])
    _overview(top, timeline, res)
    days, good = res["time_to_train_days"], res["goodput"]
    top.set_title(f"{res['scenario']}: {res['tokens'] / 1e12:.3g}T tokens on {res['gpus']:,} "
                  f"GPUs, median of {res['seeds']} runs: {days['p50']:.1f} days "
                  f"(p5 {days['p5']:.1f}, p95 {days['p95']:.1f}), goodput {good['p50']:.1%}",
                  fontsize=10, loc="left")
    _zoom(bottom, timeline, res)
    return fig


def plot_training(run_dir: Path) -> Path:
    """Draw ``run_dir/train.png`` from its train.json and train_timeline.csv."""
    from simulator.loading import read_json
    from simulator.outputs.run_files import read_table

    res = read_json(run_dir / "train.json", "run_dir")
    timeline = read_table(run_dir / "train_timeline.csv", "run `clustersim train ... --out "
                          "DIR` again")
    try:
        return _save(run_dir, training_figure(res, timeline))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise UserError([Problem("run_dir", str(run_dir), f"train.json or train_timeline.csv "
                                 f"is not a clustersim train output ({type(exc).__name__}: "
                                 f"{str(exc)[:60]}); run `clustersim train ... --out DIR` "
                                 "again")]) from None


def _save(run_dir: Path, fig: Figure) -> Path:
    path = run_dir / "train.png"
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path
