"""All the figures of a run directory (``clustersim run``, ``clustersim plot DIR``).

Plots read a span table (:mod:`simulator.outputs.span_table`'s columns) and a
``results.json`` dict, never simulation objects, so ``clustersim plot DIR``
re-draws a finished run. Every figure is a :class:`matplotlib.figure.Figure`
rendered by the Agg canvas; ``*_figure`` functions (in the figure's own module:
:mod:`~simulator.outputs.plots.timeline`, :mod:`~simulator.outputs.plots.breakdown`,
:mod:`~simulator.outputs.plots.memory`) return the figure (for notebooks and tests);
``plot_*`` save it atomically and return the path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.outputs.plots.breakdown import plot_breakdown
from simulator.outputs.plots.common import drawn_ranks
from simulator.outputs.plots.memory import plot_memory
from simulator.outputs.plots.timeline import plot_timeline
from simulator.outputs.run_files import read_results, read_spans
from simulator.outputs.span_table import stage_representatives
from simulator.outputs.timeline_files import timeline_path, timeline_stage_ranks

# --- timeline ------------------------------------------------------------------------


# --- breakdown -----------------------------------------------------------------------


# --- memory --------------------------------------------------------------------------





# --- a run directory -----------------------------------------------------------------


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
        spans = spans[spans["rank"].isin(drawn_ranks(stage_representatives(spans), results))]
    elif (path := timeline_path(out)) is not None:
        spans = read_spans(path, drawn_ranks(timeline_stage_ranks(path), results))
    written = []
    if spans is not None:
        written.append(plot_timeline(spans, results, out / "timeline.png"))
    written.append(plot_breakdown(results, out / "breakdown.png"))
    written.append(plot_memory(results, out / "memory.png"))
    return written
