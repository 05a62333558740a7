"""Design-space sweeps: one scenario, a grid of overrides, a table of outcomes.

``clustersim sweep SCENARIO --grid parallel.tp=1,2,4,8 --grid parallel.pp=1,2,4``
evaluates every combination of the grid's values (each point is the scenario with
those ``--set`` overrides), on any ``concurrent.futures.Executor``: local
processes by default, or a Dask cluster's (:mod:`simulator.search.executors`).
``parallel.dp=auto`` fills in the data-parallel degree that makes tp · cp · pp · dp
equal the cluster's GPUs. A point that does not validate is a row with its
errors, not a failure of the sweep. The analytic method is the default
(milliseconds a point); ``--method engine`` runs the discrete-event engine on
each point.

Points are resolved (presets, overrides, validation) here, before anything is
sent to a worker, so each is looked up in the on-disk cache
(:mod:`simulator.search.cache`) by its resolved scenario: a repeated or interrupted
sweep computes only the points that are missing. The table goes to
``sweep.csv`` and ``sweep.parquet``, the grid's axes to ``sweep.json``.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.errors import Problem, UserError
from simulator.limits import MAX_POINTS, check_size
from simulator.loading import read_yaml
from simulator.search.cache import Figures, ResultCache, map_cached, scenario_key
from simulator.search.executors import RespawningPool
from simulator.spec.load import apply_overrides, load_scenario
from simulator.spec.scenario import ClusterSpec, Scenario

COLUMNS = ("step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "memory_peak_bytes",
           "fits_in_memory")


def parse_grid(specs: Sequence[str]) -> dict[str, list[str]]:
    """``key.path=v1,v2,...`` strings into an ordered mapping of axes (a value repeated
    on an axis is one value); a key the schema does not have is refused here, before any
    point is tried (one line, with the closest valid key), not reported as the same
    error on every point."""
    from simulator.spec.problems import key_problem

    axes: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not items:
            raise UserError([Problem("--grid", spec, "expected key.path=v1,v2,..., e.g. "
                                     "parallel.tp=1,2,4,8")])
        problem = key_problem(key.strip(), "--grid")
        if problem is not None:
            raise UserError([problem])
        axes[key.strip()] = list(dict.fromkeys(items))
    return axes


def grid_size(axes: dict[str, list[str]]) -> int:
    """The number of points of the grid, computed before any is made."""
    return math.prod(len(values) for values in axes.values())


def check_grid(axes: dict[str, list[str]], max_points: int = MAX_POINTS) -> int:
    """The grid's size, or a one-line refusal past ``max_points`` (``--max-points``)."""
    n = grid_size(axes)
    shape = " x ".join(str(len(v)) for v in axes.values())
    check_size("--grid", f"{shape} values", "sweep points", n, max_points, "--max-points",
               "sweep fewer values")
    return n


def points(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    keys = list(axes)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*axes.values())]


def _assignments(point: dict[str, str], data: dict[str, Any]) -> list[str]:
    """``--set`` strings for a point, resolving ``parallel.dp=auto`` from the cluster."""
    out = [f"{k}={v}" for k, v in point.items() if not (k == "parallel.dp" and v == "auto")]
    if point.get("parallel.dp") != "auto":
        return out
    from pydantic import ValidationError

    probe = apply_overrides(data, out)
    par = probe.get("parallel") or {}
    try:
        gpus = ClusterSpec.model_validate(probe.get("cluster")).gpus
        dp = gpus // (int(par.get("tp", 1)) * int(par.get("cp", 1)) * int(par.get("pp", 1)))
    except (ValidationError, TypeError, ValueError, ZeroDivisionError):
        dp = 1  # validation of the point reports what is wrong
    return [*out, f"parallel.dp={max(dp, 1)}"]


def resolve(path: str | Path, base_sets: Sequence[str], grid: Sequence[dict[str, str]],
            warn: Callable[[str], None] | None = None) -> list[Scenario | str]:
    """Each point's validated scenario, or its validation errors as one string;
    ``warn`` receives each distinct warning of the valid points (once, in grid order)."""
    from simulator.spec.rules import scenario_warnings

    data = read_yaml(Path(path), "scenario")
    out: list[Scenario | str] = []
    said: set[str] = set()
    for point in grid:
        try:
            s = load_scenario(path, [*base_sets, *_assignments(point, data)])
        except UserError as exc:
            out.append("; ".join(exc.lines()))
            continue
        out.append(s)
        if warn is None:
            continue
        for line in scenario_warnings(s):
            if line not in said:
                said.add(line)
                warn(line)
    return out


def evaluate(s: Scenario, method: str) -> Figures:
    """One point's figures (module level: picklable for process and Dask workers)."""
    from simulator.api import simulate_scenario

    results, _ = simulate_scenario(s, method)
    # the step's figures, then the accounting's categories (mean over ranks)
    return {**{k: results[k] for k in COLUMNS}, **results["step_breakdown_s"]}


def run_sweep(path: str | Path, axes: dict[str, list[str]], base_sets: Iterable[str] = (),
              method: str = "analytic", executor: Executor | None = None,
              cache: ResultCache | None = None, warn: Callable[[str], None] | None = None,
              max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Every point of the grid, in grid order; cached points are not computed again.
    ``warn`` receives the points' distinct warnings before anything is computed."""
    check_grid(axes, max_points)
    grid = points(axes)
    resolved = resolve(path, list(base_sets), grid, warn)
    scenarios = [s for s in resolved if isinstance(s, Scenario)]
    jobs = [(scenario_key(s, method, s.simulation.fidelity), (s, method)) for s in scenarios]
    own = executor is None
    pool = executor or RespawningPool(min(os.cpu_count() or 1, len(grid)))
    try:
        figures = iter(map_cached(pool, evaluate, jobs, cache, "points"))
    finally:
        if own:
            pool.shutdown()
    rows = []
    for point, s in zip(grid, resolved, strict=True):
        row: dict[str, Any] = dict(point)
        if isinstance(s, str):
            row["error"] = s
        else:
            row.update(next(figures))
            row.update(tp=s.parallel.tp, cp=s.parallel.cp, pp=s.parallel.pp,
                       dp=s.parallel.dp, ep=s.parallel.ep, microbatches=s.microbatches,
                       error="")
        rows.append(row)
    tail = ("tp", "cp", "pp", "dp", "ep", "microbatches", "error")
    columns = dict.fromkeys([*axes, *COLUMNS])
    for row in rows:  # the accounting's categories, from the first valid point
        columns.update(dict.fromkeys(k for k in row if k not in tail))
    table = pd.DataFrame(rows, columns=[*columns, *tail])
    # typed columns (nullable where an invalid point has no value): Parquet needs them
    table["fits_in_memory"] = table["fits_in_memory"].astype("boolean")
    for name in ("tp", "cp", "pp", "dp", "ep", "microbatches"):
        table[name] = table[name].astype("Int64")
    return table


def invalid_lines(table: pd.DataFrame, axes: Sequence[str], shown: int = 20) -> list[str]:
    """Each invalid point's settings and reason, one line each (the first ``shown``;
    a last line counts the rest)."""
    if "error" not in table:
        return []
    bad = table[table["error"] != ""]
    lines = [f"  {', '.join(f'{k}={row[k]}' for k in axes)}: {row['error']}"
             for _, row in bad.head(shown).iterrows()]
    if len(bad) > shown:
        lines.append(f"  ... and {len(bad) - shown} more (the error column of sweep.csv "
                     "with --out)")
    return lines


def best(table: pd.DataFrame, n: int = 5) -> pd.DataFrame:
    """The fastest points that validate and fit in memory."""
    if "tokens_per_s" not in table:
        return table.iloc[0:0]
    ok = table[(table["error"] == "") & table["fits_in_memory"].fillna(False).astype(bool)]
    return ok.sort_values("tokens_per_s", ascending=False).head(n)
