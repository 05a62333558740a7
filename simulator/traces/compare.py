"""A real job's traces beside the simulation of its scenario: the tables.

``clustersim compare-trace DIR SCENARIO`` reads every rank's traces
(:mod:`simulator.traces.reader`), cuts them into classes per step
(:mod:`simulator.traces.measured`), simulates the scenario with the engine and cuts
the simulation the same way (:mod:`simulator.traces.simulated`). Three tables:

- by class (:func:`class_table`): each class and summary figure, per step, its mean
  over the measured ranks and the spread (min, max), the simulated mean over the same
  ranks, the difference and the relative error (simulated − measured) / measured;
- by rank (:func:`rank_table`): each rank's step, compute, communication, exposed
  communication and idle, measured and simulated, and two distances: ``off_sim``,
  how far the rank's measured breakdown lies from its simulation, and ``off_peers``,
  how far it lies from the median measured rank, each the sum over the classes,
  exposed communication and idle of |a − b|, as a fraction of the measured step;
- the ranks that differ most (:func:`differing_ranks`), by either distance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.errors import Problem, UserError
from simulator.spec.scenario import Scenario
from simulator.traces.classes import CLASSES, COMM_CLASSES, SUMMARY
from simulator.traces.measured import rank_figures
from simulator.traces.reader import read_traces
from simulator.traces.simulated import simulated_figures

#: The figures the distances add up: every class, then what overlap and waits leave.
DISTANCE_FIGURES = (*CLASSES, "exposed_comm", "idle")
RANK_FIGURES = ("step", "compute", "comm", "exposed_comm", "idle")
TABLE_ROWS = (*CLASSES, *SUMMARY)


def _relative(measured: float, simulated: float) -> float:
    return (simulated - measured) / measured if measured > 0 else math.nan


def _distance(a: Mapping[str, float], b: Mapping[str, float], step: float) -> float:
    return sum(abs(a[k] - b[k]) for k in DISTANCE_FIGURES) / step if step > 0 else math.nan


def measure_ranks(directory: Path, s: Scenario) -> dict[int, dict[str, float]]:
    """Each rank's measured figures per step; refuses a rank beyond the scenario's world."""
    traces = read_traces(directory)
    world = s.parallel.world
    for rank, files in traces.items():
        if rank >= world:
            raise UserError([Problem("", None, f"{files[0].path}: rank {rank} is not in the "
                                     f"scenario's {world} ranks; give the job's scenario "
                                     "(tp × cp × pp × dp = its world size)")])
    return {rank: rank_figures(files) for rank, files in traces.items()}


def class_table(measured: Mapping[int, Mapping[str, float]],
                simulated: Mapping[int, Mapping[str, float]]) -> pd.DataFrame:
    """One row per class and summary figure (seconds per step; see the module notes)."""
    ranks = sorted(measured)
    rows = []
    for figure in (*TABLE_ROWS, *(f"bytes_{k}" for k in COMM_CLASSES)):
        m = [measured[r][figure] for r in ranks]
        s = [simulated[r][figure] for r in ranks]
        if figure.startswith("bytes_") and not any(m) and not any(s):
            continue
        mean_m, mean_s = sum(m) / len(m), sum(s) / len(s)
        rows.append({"figure": figure, "unit": "bytes" if figure.startswith("bytes_")
                     else "s", "measured": mean_m, "measured_min": min(m),
                     "measured_max": max(m), "simulated": mean_s,
                     "difference": mean_s - mean_m, "error": _relative(mean_m, mean_s)})
    return pd.DataFrame(rows)


def rank_table(measured: Mapping[int, Mapping[str, float]],
               simulated: Mapping[int, Mapping[str, float]]) -> pd.DataFrame:
    """One row per measured rank (see the module notes)."""
    ranks = sorted(measured)
    median = {k: float(pd.Series([measured[r][k] for r in ranks]).median())
              for k in DISTANCE_FIGURES}
    rows = []
    for r in ranks:
        m, s = measured[r], simulated[r]
        row: dict[str, Any] = {"rank": r, "sim_rank": int(s["sim_rank"]),
                               "steps": int(m["steps"])}
        for k in RANK_FIGURES:
            row[f"{k}_measured"], row[f"{k}_simulated"] = m[k], s[k]
        row["off_sim"] = _distance(m, s, m["step"])
        row["off_peers"] = _distance(m, median, m["step"])
        rows.append(row)
    return pd.DataFrame(rows)


def differing_ranks(ranks: pd.DataFrame, key: str, top: int = 5) -> pd.DataFrame:
    """The ``top`` ranks of the rank table farthest by ``key`` (``off_sim`` or
    ``off_peers``), farthest first, ties by rank."""
    return ranks.sort_values([key, "rank"], ascending=[False, True]).head(top)


def compare_traces(directory: Path, s: Scenario, fidelity: str | None = None
                   ) -> dict[str, Any]:
    """Read, simulate, compare: the class and rank tables, the ranks that differ most,
    and the simulated results."""
    from simulator.api import simulate_scenario

    measured = measure_ranks(directory, s)  # the traces' errors before a simulation
    results, spans = simulate_scenario(s, "engine", fidelity)
    assert spans is not None  # the engine's
    simulated = simulated_figures(s, results, spans, list(measured))
    ranks = rank_table(measured, simulated)
    return {"classes": class_table(measured, simulated), "ranks": ranks,
            "differing": {k: differing_ranks(ranks, k) for k in ("off_sim", "off_peers")},
            "results": results,
            "measured": measured, "simulated": simulated}
