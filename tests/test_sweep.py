"""Sweeps: a grid of overrides, every point evaluated, invalid points kept as rows."""

from __future__ import annotations

import json
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from simulator import __version__
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.errors import UserError
from simulator.search.cache import ResultCache, code_version, scenario_key
from simulator.search.executors import open_executor
from simulator.search.sweep import best, parse_grid, points, run_sweep
from simulator.spec.load import load_scenario

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
    assert len(pd.read_parquet(out / "sweep.parquet")) == 4
    assert "fastest that fit" in capsys.readouterr().out
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["axes"] == ["parallel.schedule", "parallel.pp", "parallel.dp"]
    assert (out / "heatmap.png").stat().st_size > 5_000  # two axes with two values each
    (out / "heatmap.png").unlink()
    assert main(["plot", str(out)]) == 0 and (out / "heatmap.png").exists()
    assert main(["sweep", str(scenario), "--grid", "bogus"]) == 2


class CountingExecutor(Executor):
    """Passes work on to another executor and counts what it was given."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        self.submitted += 1
        return self.inner.submit(fn, *args, **kwargs)


DASK_AXES = {"parallel.tp": ["1", "2", "3"], "parallel.pp": ["2", "4"], "parallel.dp": ["auto"],
             "parallel.schedule": ["gpipe", "1f1b"]}


def test_dask_cluster_gives_the_local_table_and_a_repeat_computes_nothing(
        scenario: Path, tmp_path: Path) -> None:
    with ProcessPoolExecutor(2) as pool:
        local = run_sweep(scenario, DASK_AXES, method="engine", executor=pool)
    valid = int((local["error"] == "").sum())
    assert valid == 8 and len(local) == 12  # tp 3 does not divide 4 heads
    with open_executor("local:2", processes=False) as dask:
        cache = ResultCache(tmp_path / "cache")
        first = CountingExecutor(dask)
        table = run_sweep(scenario, DASK_AXES, method="engine", executor=first, cache=cache)
        assert first.submitted == cache.stored == valid and cache.hits == 0
        pd.testing.assert_frame_equal(table, local)
        again = ResultCache(tmp_path / "cache")
        second = CountingExecutor(dask)
        table = run_sweep(scenario, DASK_AXES, method="engine", executor=second, cache=again)
        assert second.submitted == again.stored == 0 and again.hits == valid
        pd.testing.assert_frame_equal(table, local)


def test_an_interrupted_sweep_computes_only_what_is_missing(scenario: Path,
                                                            tmp_path: Path) -> None:
    cache = ResultCache(tmp_path / "cache")
    part = {**DASK_AXES, "parallel.schedule": ["gpipe"]}  # what finished before the interruption
    run_sweep(scenario, part, method="analytic", executor=ThreadPoolExecutor(1), cache=cache)
    assert cache.stored == 4
    counting = CountingExecutor(ThreadPoolExecutor(1))
    resumed = ResultCache(tmp_path / "cache")
    run_sweep(scenario, DASK_AXES, method="analytic", executor=counting, cache=resumed)
    assert counting.submitted == resumed.stored == 4 and resumed.hits == 4


def test_cache_key_is_the_resolved_scenario(scenario: Path) -> None:
    s = load_scenario(scenario)
    renamed = load_scenario(scenario, ["name=other", "description=same figures"])
    assert scenario_key(s, "engine", "folded") == scenario_key(renamed, "engine", "folded")
    for changed in (load_scenario(scenario, ["training.micro_batch=2"]),
                    load_scenario(scenario, ["cluster.inter_node_bandwidth_GBps=12.5"])):
        assert scenario_key(changed, "engine", "folded") != scenario_key(s, "engine", "folded")
    assert scenario_key(s, "engine", "full") != scenario_key(s, "engine", "folded")
    assert scenario_key(s, "analytic", "full") == scenario_key(s, "analytic", "folded")
    assert code_version().startswith(__version__ + "+")


def test_cache_ignores_an_unreadable_entry(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path)
    cache.put("ab" * 32, {"step_time_s": 1.5})
    assert cache.get("ab" * 32) == {"step_time_s": 1.5} and cache.hits == 1
    (tmp_path / "ab" / f"{'ab' * 32}.json").write_text("{truncated")
    assert cache.get("ab" * 32) is None and cache.hits == 1


@pytest.mark.parametrize("spec", ["local:0", "local:x", "localhost:8786", "tcp://"])
def test_bad_dask_spec_is_a_user_error(scenario: Path, spec: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", str(scenario), "--grid", "parallel.pp=2,4", "--dask", spec]) == 2
    err = capsys.readouterr().err
    assert f"--dask = '{spec}'" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_sweep_on_a_local_dask_cluster_of_processes(scenario: Path, tmp_path: Path) -> None:
    grid = ["--grid", "parallel.pp=2,4", "--grid", "parallel.dp=auto", "--method", "engine"]
    assert main(["sweep", str(scenario), *grid, "--out", str(tmp_path / "a")]) == 0
    assert main(["sweep", str(scenario), *grid, "--dask", "local:2", "--no-cache",
                 "--out", str(tmp_path / "b")]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "a" / "sweep.parquet"),
                                  pd.read_parquet(tmp_path / "b" / "sweep.parquet"))


def test_context_and_expert_parallel_degrees_sweep(tmp_path: Path) -> None:
    """cp and ep are axes like the others: dp=auto divides by tp · cp · pp, ep is carved
    out of the data-parallel ranks, and an invalid combination is a row."""
    path = tmp_path / "moe.yaml"
    path.write_text("""\
name: moe-sweep
model: {preset: tiny-gpt, layers: 4, experts: 4, experts_per_token: 2, seq_len: 1024}
cluster: {system: dgx-h100, nodes: 1, gpus_per_node: 8}
parallel: {tp: 1, pp: 1, dp: 8}
training: {global_batch: 16, micro_batch: 1}
""")
    table = run_sweep(path, {"parallel.ep": ["1", "2", "4", "8", "3"], "parallel.dp": ["auto"]},
                      method="engine", executor=ThreadPoolExecutor(1))
    ok = table[table["error"] == ""]
    assert sorted(ok["parallel.ep"].astype(int)) == [1, 2, 4]  # 8 > experts, 3 does not divide
    assert (table[table["parallel.ep"] == "3"]["error"].str.contains("parallel.ep")).all()
    ep_time = dict(zip(ok["parallel.ep"].astype(int), ok["ep_transfer"], strict=True))
    assert ep_time[1] == 0 and ep_time[2] > 0
    dense = tmp_path / "dense.yaml"
    dense.write_text(BASE.replace("tiny-gpt, layers: 8", "tiny-gpt, layers: 8, seq_len: 1024"))
    cp = run_sweep(dense, {"parallel.cp": ["1", "2", "4"], "parallel.dp": ["auto"],
                           "parallel.cp_comm_type": ["allgather"]},  # blocking: it shows
                   method="engine", executor=ThreadPoolExecutor(1))
    assert (cp["error"] == "").all()
    assert list(cp["tp"] * cp["cp"] * cp["pp"] * cp["dp"]) == [16, 16, 16]
    assert list(cp["cp_transfer"] + cp["cp_wait"] > 0) == [False, True, True]
