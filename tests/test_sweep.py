"""Sweeps: a grid of overrides, every point evaluated, invalid points kept as rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from simulator.api import simulate_scenario
from simulator.cli import main
from simulator.errors import UserError
from simulator.scenario import load_scenario
from simulator.sweep import best, parse_grid, points, run_sweep

BASE = """\
name: sweep
model: {preset: tiny-gpt, layers: 8}
cluster: {system: dgx-a100-80gb, nodes: 2, gpus_per_node: 8}
parallel: {tp: 2, pp: 2, dp: 4, schedule: 1f1b}
training: {global_batch: 64, micro_batch: 1}
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(BASE)
    return path


def test_parse_grid_and_points() -> None:
    axes = parse_grid(["parallel.tp=1,2", "parallel.schedule=gpipe, 1f1b"])
    assert axes == {"parallel.tp": ["1", "2"], "parallel.schedule": ["gpipe", "1f1b"]}
    assert len(points(axes)) == 4
    with pytest.raises(UserError, match="--grid"):
        parse_grid(["parallel.tp"])


def test_every_point_matches_a_single_run(scenario: Path) -> None:
    axes = {"parallel.tp": ["1", "2", "4"], "parallel.pp": ["2", "4"], "parallel.dp": ["auto"]}
    with ThreadPoolExecutor(2) as pool:  # any Executor
        table = run_sweep(scenario, axes, method="analytic", executor=pool)
    assert len(table) == 6 and (table["error"] == "").all()
    assert (table["tp"] * table["pp"] * table["dp"] == 16).all()  # dp=auto fills the cluster
    row = table[(table["tp"] == 4) & (table["pp"] == 2)].iloc[0]
    single, _ = simulate_scenario(load_scenario(scenario, ["parallel.tp=4", "parallel.pp=2",
                                                           "parallel.dp=2"]), "analytic")
    assert row["step_time_s"] == pytest.approx(single["step_time_s"], rel=1e-12)
    top = best(table, 3)
    assert list(top["tokens_per_s"]) == sorted(top["tokens_per_s"], reverse=True)


def test_invalid_points_are_rows(scenario: Path) -> None:
    table = run_sweep(scenario, {"parallel.tp": ["2", "3"]}, method="analytic",
                      executor=ThreadPoolExecutor(1))
    bad = table[table["parallel.tp"] == "3"].iloc[0]
    assert "parallel" in bad["error"] and "heads" in bad["error"]
    assert table[table["parallel.tp"] == "2"].iloc[0]["error"] == ""


def test_cli_sweep_writes_csv(scenario: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["sweep", str(scenario), "--grid", "parallel.schedule=gpipe,1f1b",
                 "--grid", "parallel.pp=2,4", "--grid", "parallel.dp=auto", "--workers", "2",
                 "--out", str(out)]) == 0
    table = pd.read_csv(out / "sweep.csv")
    assert len(table) == 4
    assert "fastest that fit" in capsys.readouterr().out
    assert main(["sweep", str(scenario), "--grid", "bogus"]) == 2
