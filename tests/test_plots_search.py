"""Search figures on real search output: the sweep heatmap and the plan's Pareto plot."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection

from simulator.errors import UserError
from simulator.outputs.plots.search import heatmap_axes, heatmap_figure, heatmap_grid, pareto_figure
from simulator.outputs.search_files import write_plan
from simulator.search.candidates import PlanRequest
from simulator.search.plan import run_plan
from simulator.search.sweep import run_sweep

SCENARIOS = Path(__file__).parent.parent / "scenarios"
AXES = {"parallel.zero": ["0", "3"], "parallel.tp": ["1", "2", "3", "4"],
        "parallel.dp": ["auto"], "training.micro_batch": ["1", "2"]}


@pytest.fixture(scope="module")
def sweep_table() -> pd.DataFrame:
    # a 10B GPT on 8 A100-40GB: without ZeRO and TP 1 it does not fit; TP 3 is invalid
    return run_sweep(SCENARIOS / "gpt-10b-8xa100-40gb-zero0.yaml", AXES,
                     executor=ThreadPoolExecutor(1))


def test_heatmap_cells_are_the_fastest_point_that_fits(sweep_table: pd.DataFrame) -> None:
    x, y = heatmap_axes(sweep_table, list(AXES))
    assert (x, y) == ("parallel.zero", "parallel.tp")  # dp=auto has one value
    xs, ys, grid, notes = heatmap_grid(sweep_table, x, y)
    assert xs == ["0", "3"] and ys == ["1", "2", "3", "4"]
    t = sweep_table
    for j, tp in enumerate(ys):
        for i, zero in enumerate(xs):
            cell = t[(t[x] == zero) & (t[y] == tp)]
            ok = cell[(cell["error"] == "") & cell["fits_in_memory"].fillna(False)]
            if len(ok):
                assert grid[j, i] == ok["step_time_s"].min() and notes[j][i] == ""
            else:
                assert math.isnan(grid[j, i])
    assert notes[ys.index("3")] == ["invalid", "invalid"]
    assert notes[ys.index("1")][xs.index("0")] == "out of\nmemory"
    # ZeRO-3 with TP 1: micro-batch 2 does not fit, so the cell is micro-batch 1's time
    zero3 = t[(t[x] == "3") & (t[y] == "1")].set_index("training.micro_batch")
    assert not zero3.loc["2", "fits_in_memory"]
    assert grid[ys.index("1"), xs.index("3")] == zero3.loc["1", "step_time_s"]


def test_heatmap_figure_and_axis_errors(sweep_table: pd.DataFrame) -> None:
    fig = heatmap_figure(sweep_table, "parallel.zero", "parallel.tp")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(texts) == 8 and texts.count("invalid") == 2
    with pytest.raises(UserError, match="two swept axes"):
        heatmap_axes(sweep_table, ["parallel.dp", "parallel.zero"])


def test_pareto_figure_marks_frontier_and_choice(tmp_path: Path) -> None:
    req = PlanRequest("llama2-7b", 8, "dgx-a100-40gb", 32, top_k=2, micro_batches=(1, 2))
    plan = run_plan(req, ThreadPoolExecutor(1))
    write_plan(plan, tmp_path, plots=False)
    table = pd.read_csv(tmp_path / "plan.csv", keep_default_na=False, na_values=[""])
    fig = pareto_figure(table, {"gpu_memory_GB": 40})
    collections = [c for c in fig.axes[0].collections if isinstance(c, PathCollection)]
    cloud, front, engine, chosen = (len(c.get_offsets()) for c in collections)
    assert cloud == plan.counts["fit"] == int(table["fits"].sum())
    assert front == int(table["pareto"].sum()) >= 1
    assert engine == plan.counts["simulated"] == int(table["engine_step_time_s"].notna().sum())
    assert engine > 2 and chosen == 1  # the best two, and each ZeRO stage's best besides
    star = np.asarray(collections[3].get_offsets())[0]
    best = table[table["chosen"]].iloc[0]
    assert tuple(star) == (best["peak_memory_GB"], best["engine_step_time_s"])
    # the frontier is what no other fitting candidate beats on both axes
    fits = table[table["fits"]]
    for _, row in fits[fits["pareto"]].iterrows():
        better = fits[(fits["peak_memory_GB"] <= row["peak_memory_GB"])
                      & (fits["analytic_step_time_s"] < row["analytic_step_time_s"])]
        assert better.empty
