"""What ``clustersim compare-trace`` writes and prints: ``classes.csv`` (measured beside
simulated, by class), ``ranks.csv`` (by rank), ``compare-trace.md`` (both tables and the
ranks that differ most), ``comparison.json`` (the same numbers and what was compared)
and ``classes.png`` (measured and simulated bars per class, the measured ranks' spread
as a whisker), each written atomically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from simulator.outputs.plots.common import save
from simulator.outputs.trace_export import atomic_output
from simulator.traces.classes import CLASSES

PLOTTED = (*CLASSES, "exposed_comm", "idle")
ALWAYS = ("exposed_comm", "idle", "compute", "comm", "step")
_MEASURED, _SIMULATED = "#4C78A8", "#F58518"


def _ms(v: float) -> str:
    return f"{v * 1e3:.3f}"


def _err(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:+.1%}"


def _value(row: Mapping[str, Any], key: str) -> str:
    v = float(row[key])
    return f"{v / 1e6:.3f} MB" if row["unit"] == "bytes" else f"{_ms(v)} ms"


def _class_rows(classes: pd.DataFrame) -> list[tuple[str, ...]]:
    """Header, then each class with something on either side, in milliseconds or MB."""
    rows: list[tuple[str, ...]] = [("figure", "measured", "(min-max)", "simulated", "error")]
    for _, r in classes[_nonzero(classes)].iterrows():
        lo, hi = _value(r, "measured_min"), _value(r, "measured_max")
        rows.append((str(r["figure"]), _value(r, "measured"), f"{lo.split()[0]}-{hi}",
                     _value(r, "simulated"), _err(float(r["error"]))))
    return rows


def class_lines(classes: pd.DataFrame) -> list[str]:
    """The class table as aligned text (per step, mean over ranks)."""
    rows = _class_rows(classes)
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def _nonzero(classes: pd.DataFrame) -> pd.Series:
    """Rows with something on either side (and the summary, always)."""
    return (classes["measured_max"] > 0) | (classes["simulated"] > 0) | \
        classes["figure"].isin(ALWAYS)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(r) + " |" for r in rows[1:])]


def _rank_rows(ranks: pd.DataFrame) -> list[tuple[str, ...]]:
    """Each rank, its times in milliseconds and its distances."""
    cols = [c for c in ranks.columns if c not in ("rank", "sim_rank", "steps")]
    rows = [("rank", "sim rank", "steps", *(c.replace("_", " ") + (" (ms)" if not
                                                                   c.startswith("off") else "")
                                            for c in cols))]
    for _, r in ranks.iterrows():
        rows.append((str(int(r["rank"])), str(int(r["sim_rank"])), str(int(r["steps"])),
                     *(f"{r[c]:.2f}" if c.startswith("off") else _ms(float(r[c]))
                       for c in cols)))
    return rows


def differing_lines(comparison: Mapping[str, Any]) -> list[str]:
    """The ranks farthest from the simulation and from their peers, one line each."""
    def top(key: str) -> str:
        return ", ".join(f"{int(r['rank'])} ({r[key]:.2f})"
                         for _, r in comparison["differing"][key].iterrows())

    return [f"ranks farthest from the simulation (off_sim): {top('off_sim')}",
            f"ranks farthest from the median measured rank (off_peers): {top('off_peers')}"]


def markdown(comparison: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    step = comparison["classes"].set_index("figure").loc["step"]
    lines = [f"# compare-trace: {meta['traces']} beside {meta['scenario']}", "",
             f"{len(comparison['ranks'])} measured rank(s); per step, measured "
             f"{_ms(float(step['measured']))} ms, simulated "
             f"{_ms(float(step['simulated']))} ms ({_err(float(step['error']))}). "
             "Per step, mean over the measured ranks (the CSV files have seconds and "
             "bytes); the classes are defined in docs/compare-trace.md.", "",
             "## By class", "", *_table(_class_rows(comparison["classes"])), "",
             "## The ranks that differ most", "",
             "off_sim: the sum over the classes, exposed communication and idle of "
             "|measured - simulated|, as a fraction of the measured step; off_peers: the "
             "same against the median measured rank.", "",
             *(f"- {line}" for line in differing_lines(comparison)), "",
             "## By rank", "", *_table(_rank_rows(comparison["ranks"])), ""]
    return "\n".join(lines)


def class_figure(classes: pd.DataFrame, title: str) -> Figure:
    """Measured and simulated milliseconds per step by class, side by side."""
    shown = classes[_nonzero(classes) & classes["figure"].isin(PLOTTED)]
    rows = shown.set_index("figure").loc[[f for f in PLOTTED if f in set(shown["figure"])]]
    x = range(len(rows))
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    m = rows["measured"] * 1e3
    # a mean of equal values may round an ulp past them: whiskers are never negative
    spread = [(m - rows["measured_min"] * 1e3).clip(lower=0).astype(float),
              (rows["measured_max"] * 1e3 - m).clip(lower=0).astype(float)]
    ax.bar([i - 0.2 for i in x], m, 0.4, color=_MEASURED, label="measured (mean; whisker: "
           "min-max over ranks)", yerr=spread, capsize=3, error_kw={"lw": 1})
    ax.bar([i + 0.2 for i in x], rows["simulated"] * 1e3, 0.4, color=_SIMULATED,
           label="simulated")
    ax.set_xticks(list(x), [f.replace("_", " ") for f in rows.index], rotation=30,
                  ha="right")
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    return fig


def write_report(out: Path, comparison: Mapping[str, Any], meta: Mapping[str, Any],
                 plot: bool = True) -> list[Path]:
    """Every file of the comparison under ``out`` (see the module notes)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("classes", "ranks"):
        path = out / f"{name}.csv"
        with atomic_output(path) as tmp:
            comparison[name].to_csv(tmp, index=False)
        written.append(path)
    path = out / "compare-trace.md"
    with atomic_output(path) as tmp:
        tmp.write_text(markdown(comparison, meta))
    written.append(path)
    results = comparison["results"]
    data = {**meta, "classes": comparison["classes"].to_dict("records"),
            "ranks": comparison["ranks"].to_dict("records"),
            "differing_ranks": {k: [int(r) for r in v["rank"]]
                                for k, v in comparison["differing"].items()},
            "simulated_results": {k: results[k] for k in (
                "step_time_s", "step_breakdown_s", "exposed_comm_s", "fidelity")}}
    path = out / "comparison.json"
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(_clean(data), indent=2, allow_nan=False) + "\n")
    written.append(path)
    if plot:
        step = comparison["classes"].set_index("figure").loc["step"]
        title = (f"{meta['traces']} ({len(comparison['ranks'])} ranks, measured step "
                 f"{_ms(float(step['measured']))} ms) beside {meta['scenario']} "
                 f"(simulated {_ms(float(step['simulated']))} ms)")
        written.append(save(class_figure(comparison["classes"], title), out / "classes.png"))
    return written


def _clean(v: Any) -> Any:
    """JSON-ready: NaN (an error against a zero measurement) as null, numpy as Python."""
    if isinstance(v, Mapping):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    if hasattr(v, "item"):  # a numpy scalar
        v = v.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v
