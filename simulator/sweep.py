"""Design-space sweeps: one scenario, a grid of overrides, a table of outcomes.

``clustersim sweep SCENARIO --grid parallel.tp=1,2,4,8 --grid parallel.pp=1,2,4``
evaluates every combination of the grid's values (each point is the scenario with
those ``--set`` overrides), on any ``concurrent.futures.Executor`` — local
processes by default, so a Dask or Ray executor drops in. ``parallel.dp=auto``
fills in the data-parallel degree that makes tp · pp · dp equal the cluster's
GPUs. A point that does not validate is a row with its errors, not a failure of
the sweep. The analytic method is the default (milliseconds a point); ``--method
engine`` runs the discrete-event engine on each point.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.errors import Problem, UserError

COLUMNS = ("step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "memory_peak_bytes",
           "fits_in_memory")


def parse_grid(specs: Sequence[str]) -> dict[str, list[str]]:
    """``key.path=v1,v2,...`` strings into an ordered mapping of axes."""
    axes: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not items:
            raise UserError([Problem("--grid", spec, "expected key.path=v1,v2,..., e.g. "
                                     "parallel.tp=1,2,4,8")])
        axes[key.strip()] = items
    return axes


def points(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    keys = list(axes)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*axes.values())]


def _assignments(point: dict[str, str], data: dict[str, Any]) -> list[str]:
    """``--set`` strings for a point, resolving ``parallel.dp=auto`` from the cluster."""
    out = [f"{k}={v}" for k, v in point.items() if not (k == "parallel.dp" and v == "auto")]
    if point.get("parallel.dp") != "auto":
        return out
    from pydantic import ValidationError

    from simulator.scenario import ClusterSpec, apply_overrides

    probe = apply_overrides(data, out)
    par = probe.get("parallel") or {}
    try:
        gpus = ClusterSpec.model_validate(probe.get("cluster")).gpus
        dp = gpus // (int(par.get("tp", 1)) * int(par.get("pp", 1)))
    except (ValidationError, TypeError, ValueError, ZeroDivisionError):
        dp = 1  # validation of the point reports what is wrong
    return [*out, f"parallel.dp={max(dp, 1)}"]


def evaluate(path: str, base_sets: list[str], point: dict[str, str],
             method: str) -> dict[str, Any]:
    """One point: its figures, or its validation errors (module level: picklable)."""
    from simulator.api import simulate_scenario
    from simulator.hardware import read_yaml
    from simulator.scenario import load_scenario

    row: dict[str, Any] = dict(point)
    try:
        data = read_yaml(Path(path), "scenario")
        s = load_scenario(path, [*base_sets, *_assignments(point, data)])
        results, _ = simulate_scenario(s, method)
    except UserError as exc:
        row["error"] = "; ".join(exc.lines())
        return row
    row.update({k: results[k] for k in COLUMNS})
    row.update(results["step_breakdown_s"])  # the accounting's categories, mean over ranks
    row.update(tp=s.parallel.tp, pp=s.parallel.pp, dp=s.parallel.dp,
               microbatches=s.microbatches, error="")
    return row


def run_sweep(path: str | Path, axes: dict[str, list[str]], base_sets: Iterable[str] = (),
              method: str = "analytic", executor: Executor | None = None,
              progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Every point of the grid, in grid order."""
    grid = points(axes)
    own = executor is None
    pool = executor or ProcessPoolExecutor(max_workers=min(os.cpu_count() or 1, len(grid)))
    try:
        futures = {pool.submit(evaluate, str(path), list(base_sets), p, method): i
                   for i, p in enumerate(grid)}
        rows: list[dict[str, Any] | None] = [None] * len(grid)
        for done, future in enumerate(as_completed(futures), 1):
            rows[futures[future]] = future.result()
            if progress:
                progress(done, len(grid))
    finally:
        if own:
            pool.shutdown()
    return pd.DataFrame(rows)


def best(table: pd.DataFrame, n: int = 5) -> pd.DataFrame:
    """The fastest points that validate and fit in memory."""
    if "tokens_per_s" not in table:
        return table.iloc[0:0]
    ok = table[(table["error"] == "") & table["fits_in_memory"].astype(bool)]
    return ok.sort_values("tokens_per_s", ascending=False).head(n)


def print_progress(done: int, total: int) -> None:
    if done == total or done % max(total // 20, 1) == 0:
        print(f"  {done}/{total} points", file=sys.stderr, flush=True)
