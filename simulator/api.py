"""One call from a scenario to results: Scenario → Layout → Workload → Engine → Report.

``simulate_scenario`` is what ``clustersim run``, sweeps and ``compare`` use;
``write_outputs`` writes results.json, timeline.csv, trace.json and the PNGs,
each atomically, so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from simulator import report
from simulator.analytic import analytic_estimate
from simulator.budget import check_engine_cost, check_stages
from simulator.engine import simulate
from simulator.memory_timeline import memory_timeline
from simulator.scenario import Scenario
from simulator.trace_export import atomic_output, write_chrome_trace, write_timeline_csv
from simulator.workload import build_workload

PROGRESS_TASKS = 500_000  # above this many tasks a run reports progress


def _ranks(s: Scenario, fidelity: str) -> range:
    return range(s.parallel.pp if fidelity == "folded" else s.parallel.world)


def _progress_line(fraction: float) -> None:
    print(f"  simulated {fraction:.0%} of the estimated step", file=sys.stderr, flush=True)


def simulate_scenario(s: Scenario, method: str | None = None, fidelity: str | None = None,
                      progress: bool = False, max_tasks: int | None = None
                      ) -> tuple[dict[str, Any], pd.DataFrame | None]:
    """Results dict (the results.json contract) and the span table (engine only).

    Refuses (UserError) a run above ``max_tasks`` estimated tasks before building it
    (default :data:`simulator.budget.DEFAULT_MAX_TASKS`).
    """
    method = method or s.simulation.method
    fidelity = fidelity or s.simulation.fidelity
    spans = None
    if method == "analytic":
        check_stages(s)
        out = analytic_estimate(s)
        out["fidelity"] = None
    else:
        check_engine_cost(s, fidelity, max_tasks)
        if progress:
            print(f"building the workload of {len(_ranks(s, fidelity))} rank(s) ...",
                  file=sys.stderr, flush=True)
        workload = build_workload(s, fidelity=fidelity)
        horizon = 0.0
        if progress and len(workload.tasks) > PROGRESS_TASKS:
            horizon = analytic_estimate(s)["step_time_s"]
        result = simulate(workload, s.hardware, _progress_line if horizon else None, horizon)
        out = report.engine_metrics(s, result)
        # one rank per stage keeps results.json small in full fidelity
        firsts = {workload.layout.coord(r).pp: r for r in sorted(workload.programs, reverse=True)}
        out["memory_timeline"] = memory_timeline(s, result, ranks=sorted(firsts.values()))
        spans = report.spans_frame(result)
    out.update(report.common_metrics(s, out["step_time_s"]))
    out["method"] = method
    out["scenario"] = s.to_dict()
    out["hardware"] = s.hardware.model_dump(mode="json")
    return out, spans


def write_results(path: Path, results: dict[str, Any]) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")


def write_outputs(out_dir: Path, results: dict[str, Any], spans: pd.DataFrame | None,
                  plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if spans is not None:
        written.append(write_timeline_csv(out_dir / "timeline.csv", spans))
        written.append(write_chrome_trace(out_dir / "trace.json", spans, results))
    # results.json last: its presence means the run's outputs are complete
    write_results(out_dir / "results.json", results)
    written.append(out_dir / "results.json")
    if plots and spans is not None:
        from simulator.plots import plot_all

        written.extend(plot_all(out_dir))
    return written
