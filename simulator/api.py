"""One call from a scenario to results: Scenario → Layout → Workload → Engine → Report.

``run_scenario`` is what ``clustersim run`` uses: results, the span table and,
for the ranks the trace will show, its flows and counters
(:mod:`simulator.outputs.trace_links`). ``simulate_scenario`` is the same without the
trace's extras, for sweeps, ``compare``, notebooks and tests. ``write_outputs``
is the one function that writes a run directory: results.json, the results'
long tables and the timeline (Parquet; the timeline as CSV on request), trace.json
and the PNGs, each atomically, so an
interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.analysis import report
from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.extras import extras_lines
from simulator.analysis.memory_timeline import memory_timeline
from simulator.builder.budget import check_engine_cost, check_stages
from simulator.builder.columns import task_columns
from simulator.builder.workload import build_workload, simulated_ranks
from simulator.engine.engine import simulate
from simulator.errors import UserError
from simulator.limits import check_ranks
from simulator.outputs.rank_selection import RankSelection, select_ranks
from simulator.outputs.result_tables import split_tables, write_tables
from simulator.outputs.span_table import span_table
from simulator.outputs.timeline_files import write_timeline
from simulator.outputs.trace_export import TRACE_FILES, atomic_output, write_chrome_trace
from simulator.outputs.trace_links import TraceLinks, trace_links
from simulator.spec.rules import not_yet_simulated
from simulator.spec.scenario import Scenario

#: Above this many tasks a run on a terminal shows a bar (about 2 s of engine time).
PROGRESS_TASKS = 200_000


def _ranks(s: Scenario, fidelity: str) -> tuple[int, ...]:
    """The ranks a run of this fidelity simulates (build_workload's choice)."""
    return tuple(simulated_ranks(s, fidelity))


#: Phase name -> (wall seconds, CPU seconds of this process); filled when passed.
Timings = dict[str, tuple[float, float]]


@contextmanager
def _timed(timings: Timings | None, phase: str) -> Iterator[None]:
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    if timings is not None:
        w0, c0 = timings.get(phase, (0.0, 0.0))
        timings[phase] = (w0 + time.perf_counter() - wall, c0 + time.process_time() - cpu)


@contextmanager
def _engine_bar(active: bool) -> Iterator[Callable[[float], None] | None]:
    """A bar of the simulated share of the estimated step (stderr, a terminal only)."""
    if not active:
        yield None
        return
    from simulator.outputs.progress import progress_bar

    with progress_bar(100, "simulating", "%") as bar:
        def advance(fraction: float) -> None:
            bar.update(max(0.0, min(100.0, 100 * fraction) - bar.n))

        yield advance


@dataclass
class Run:
    """What one ``clustersim run`` produces before anything is written."""

    results: dict[str, Any]  # the results.json contract
    spans: pd.DataFrame | None  # the span table (engine only)
    trace: TraceLinks | None  # flows and counters of the traced ranks (engine only)


def run_scenario(s: Scenario, method: str | None = None, fidelity: str | None = None,
                 progress: bool = False, trace_ranks: RankSelection | None = "stages",
                 timings: Timings | None = None, max_tasks: int | None = None,
                 max_ranks: int | None = None) -> Run:
    """Simulate ``s``; with ``trace_ranks``, also the trace's extras for those ranks.
    Refuses (UserError) what has no workload yet (:func:`not_yet_simulated`) and a run
    above ``max_tasks`` estimated tasks before building it (default
    :data:`simulator.builder.budget.DEFAULT_MAX_TASKS`), and a cluster of more than
    ``max_ranks`` GPUs (default :data:`simulator.limits.MAX_RANKS`; only ``run`` has the
    option).
    ``timings`` (benchmarks) receives each phase's wall and CPU seconds: build,
    simulate, metrics, span_table, memory_timeline, trace_links."""
    unsupported = not_yet_simulated(s)
    if unsupported:
        raise UserError(unsupported)
    method = method or s.simulation.method
    fidelity = fidelity or s.simulation.fidelity
    check_ranks(s.parallel.world, max_ranks, option="--max-ranks" if max_ranks else "")
    spans, links = None, None
    tp_dp = s.parallel.tp * s.parallel.cp * s.parallel.dp  # ranks per stage
    traced: list[int] = []
    if trace_ranks is not None and method != "analytic":  # a bad selection fails first
        traced = select_ranks(trace_ranks, _ranks(s, fidelity), tp_dp)
    if method == "analytic":
        check_stages(s)
        out = analytic_estimate(s)
        out["fidelity"] = None
    else:
        check_engine_cost(s, fidelity, max_tasks)
        if progress:
            print(f"building the workload of {len(_ranks(s, fidelity))} rank(s) ...",
                  file=sys.stderr, flush=True)
        with _timed(timings, "build"):
            workload = build_workload(s, fidelity=fidelity)
        horizon = 0.0
        if progress and len(workload.tasks) > PROGRESS_TASKS and sys.stderr.isatty():
            horizon = analytic_estimate(s)["step_time_s"]
        with _timed(timings, "simulate"), _engine_bar(horizon > 0) as advance:
            result = simulate(workload, s.hardware, advance, horizon)
        with _timed(timings, "metrics"):
            columns = task_columns(workload)
            out = report.engine_metrics(s, result, columns)
        with _timed(timings, "span_table"):
            spans = span_table(result, columns)
        del columns
        with _timed(timings, "memory_timeline"):
            # one rank per stage keeps results.json small in full fidelity
            stages = select_ranks("stages", workload.programs, tp_dp)
            out["memory_timeline"] = memory_timeline(s, result, ranks=stages, spans=spans)
        if trace_ranks is not None:
            with _timed(timings, "trace_links"):
                links = trace_links(s, result, spans, traced, out["memory_timeline"])
    out.update(report.common_metrics(s, out["step_time_s"]))
    out["method"] = method
    out["scenario"] = s.to_dict()
    out["hardware"] = s.hardware.model_dump(mode="json")
    return Run(out, spans, links)


def simulate_scenario(s: Scenario, method: str | None = None, fidelity: str | None = None,
                      progress: bool = False, max_tasks: int | None = None
                      ) -> tuple[dict[str, Any], pd.DataFrame | None]:
    """Results dict (the results.json contract) and the span table (engine only)."""
    run = run_scenario(s, method, fidelity, progress, trace_ranks=None, max_tasks=max_tasks)
    return run.results, run.spans


def write_results(path: Path, results: dict[str, Any]) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")


def write_outputs(out_dir: Path, results: dict[str, Any], spans: pd.DataFrame | None,
                  plots: bool = True, timeline: str = "parquet",
                  trace: TraceLinks | None = None, timings: Timings | None = None,
                  trace_format: str = "json") -> list[Path]:
    """Write a run directory: the timeline in ``timeline`` format (parquet, csv or both),
    trace.json (or trace.json.gz with ``trace_format`` "json.gz"; the ranks and extras
    of ``trace``, else one rank per stage), the
    results' tables (:mod:`simulator.outputs.result_tables`), then results.json (their
    summaries and file names), then the PNGs, then report.html. Returns the paths written.
    ``timings`` (benchmarks) receives each file group's wall and CPU seconds (each
    table's under ``write_table:<file>``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if spans is not None:
        with _timed(timings, "write_timeline"):
            written.extend(write_timeline(out_dir, spans, timeline))
        with _timed(timings, "write_trace"):
            written.append(write_chrome_trace(out_dir / TRACE_FILES[trace_format], spans,
                                              results, trace))
    summary, tables = split_tables(results)  # the long lists as Parquet beside it
    for name, frame in tables.items():
        with _timed(timings, f"write_table:{name}"):
            written.extend(write_tables(out_dir, {name: frame}))
    # results.json last: its presence means the run's outputs are complete
    with _timed(timings, "write_results"):
        write_results(out_dir / "results.json", summary)
    written.append(out_dir / "results.json")
    if plots and spans is not None:
        from simulator.outputs.plots.run import plot_all

        with _timed(timings, "write_plots"):
            written.extend(plot_all(out_dir, results, spans))
    with _timed(timings, "write_report"):
        written.append(write_run_report(out_dir, results))
    return written


def write_run_report(out_dir: Path, results: dict[str, Any]) -> Path:
    """``report.html`` from ``results`` and the PNGs already in ``out_dir``."""
    from simulator.outputs.report_html import write_report

    return write_report(out_dir, results, report.summary_lines(results)
                        + extras_lines(results))
