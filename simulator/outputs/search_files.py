"""What a search writes: a sweep's and a plan's tables (CSV and Parquet), their JSON
summaries and their figures (a sweep's heatmap, a plan's Pareto front), each file
atomically.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.outputs.plots.search import plot_heatmap, plot_pareto
from simulator.outputs.writing import atomic_output, output_lock
from simulator.search.cache import code_version
from simulator.search.plan import Plan


def write_table(table: pd.DataFrame, path: Path) -> Path:
    """CSV or Parquet by ``path``'s suffix, atomically."""
    with atomic_output(path) as tmp:
        if path.suffix == ".parquet":
            table.to_parquet(tmp, index=False)
        else:
            table.to_csv(tmp, index=False)
    return path


def write_sweep(table: pd.DataFrame, out: Path, meta: dict[str, Any],
                plots: bool = True) -> list[Path]:
    """sweep.csv, sweep.parquet, sweep.json (``meta``: axes, scenario, method) and, with
    two axes of more than one value, heatmap.png."""
    with output_lock(out):
        return _write_sweep(table, out, meta, plots)


def _write_sweep(table: pd.DataFrame, out: Path, meta: dict[str, Any],
                 plots: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [write_table(table, out / "sweep.csv"), write_table(table, out / "sweep.parquet")]
    with atomic_output(out / "sweep.json") as tmp:
        tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    written.append(out / "sweep.json")
    varied = [a for a in meta.get("axes", []) if table[a].nunique() > 1]
    if plots and len(varied) >= 2:
        written.append(plot_heatmap(out))
    return written


def write_plan(plan: Plan, out: Path, plots: bool = True) -> list[Path]:
    """plan.csv, plan.parquet, plan.json (request, counts, choice) and pareto.png."""
    with output_lock(out):
        return _write_plan(plan, out, plots)


def _write_plan(plan: Plan, out: Path, plots: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [write_table(plan.table, out / "plan.csv"),
               write_table(plan.table, out / "plan.parquet")]
    meta = {"request": asdict(plan.request), "counts": plan.counts, "wall_s": plan.wall_s,
            "gpu_memory_GB": plan.gpu_memory_GB, "usable_GB": plan.usable_GB,
            "chosen": None if plan.chosen is None
            else _plain(plan.table.loc[plan.chosen].to_dict()),
            "version": code_version()}
    with atomic_output(out / "plan.json") as tmp:
        tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    written.append(out / "plan.json")
    if plots:
        written.append(plot_pareto(out))
    return written


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """numpy scalars to Python ones, NaN to None (JSON)."""
    out = {}
    for k, v in row.items():
        value = v.item() if hasattr(v, "item") else v
        out[k] = None if isinstance(value, float) and math.isnan(value) else value
    return out
