"""The results' long lists as Parquet tables: written beside a small results.json, read
back equal, and an older run directory (lists inline) still drawn."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from small_scenario import SMALL

from simulator.api import simulate_scenario, write_outputs, write_results
from simulator.cli.main import main
from simulator.errors import UserError
from simulator.outputs.plots.run import plot_all
from simulator.outputs.result_tables import (
    INLINE_RANKS,
    TABLES,
    attach_tables,
    split_tables,
    write_tables,
)
from simulator.outputs.run_files import read_results
from simulator.spec.load import scenario_from_dict

RESULTS_LIMIT = 1 << 20  # results.json of the headline scenario stays under 1 MB
SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


@pytest.fixture(scope="module")
def small_run() -> tuple[dict[str, Any], Any]:
    import yaml

    return simulate_scenario(scenario_from_dict(yaml.safe_load(SMALL)), method="engine")


def test_tables_leave_results_json_and_read_back_equal(tmp_path: Path,
                                                       small_run: tuple[Any, Any]) -> None:
    results, spans = small_run
    write_outputs(tmp_path, results, spans, plots=False)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    split = {k: t for k, t in TABLES.items() if len(results[k]) > t.inline_max}
    assert set(split) == {"critical_path", "memory_timeline"}  # 8 ranks: breakdown inline
    assert on_disk["tables"] == {k: t.file for k, t in split.items()}
    assert on_disk["time_breakdown_s"] == results["time_breakdown_s"]
    assert not (tmp_path / TABLES["time_breakdown_s"].file).exists()
    for key, table in split.items():
        assert key not in on_disk
        frame = pq.read_table(tmp_path / table.file).to_pandas()
        rows = results[key]
        expected = sum(len(c["points"]) for c in rows) if key == "memory_timeline" \
            else len(rows)
        assert len(frame) == expected > 0
        assert list(frame.columns) == list(table.columns or rows[0])
    back = read_results(tmp_path / "results.json")
    for key in TABLES:
        assert back[key] == results[key]  # exact: float64 both ways
    assert {k: v for k, v in back.items() if k != "tables"} == \
        json.loads(json.dumps(results))  # nothing else moved either


_path = st.lists(st.fixed_dictionaries({
    "rank": st.integers(0, 2**31 - 1), "start": st.floats(0, 1e3),
    "end": st.floats(0, 1e3), "category": st.sampled_from(["forward", "tp_wait", "é \""])}))
_curves = st.lists(st.fixed_dictionaries({
    "rank": st.integers(0, 4096), "stage": st.integers(0, 64),
    "points": st.lists(st.lists(st.floats(0, 1e12), min_size=2, max_size=2), min_size=1)}),
    unique_by=lambda c: c["rank"])
_seconds = st.floats(0, 1e4, allow_subnormal=True)
_BREAKDOWN_KEYS = ("rank", "stage", "forward", "tp_wait", "é \"")  # one order, as runs have
_breakdowns = st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 64), _seconds,
                                 _seconds, _seconds).map(
    lambda values: dict(zip(_BREAKDOWN_KEYS, values, strict=True))), max_size=40)


@settings(max_examples=25, deadline=None)
@given(path=_path, curves=_curves, breakdown=_breakdowns)
def test_split_then_attach_is_the_identity(tmp_path_factory: pytest.TempPathFactory,
                                           path: list[dict[str, Any]],
                                           curves: list[dict[str, Any]],
                                           breakdown: list[dict[str, Any]]) -> None:
    results = {"step_time_s": 1.0, "critical_path": path, "memory_timeline": curves,
               "time_breakdown_s": breakdown}
    out = tmp_path_factory.mktemp("tables")
    small = dataclasses.replace(TABLES["time_breakdown_s"], inline_max=20)
    with patch.dict(TABLES, {"time_breakdown_s": small}):
        summary, frames = split_tables(results)
        write_tables(out, frames)
        back = attach_tables(summary, out)
    assert "critical_path" not in summary and summary["tables"]["memory_timeline"]
    assert ("time_breakdown_s" in summary) == (len(breakdown) <= 20)  # a few stay inline
    assert back == results
    assert [list(e) for e in back["time_breakdown_s"]] == [list(e) for e in breakdown]
    assert all(type(e["rank"]) is int and type(e["forward"]) is float
               for e in back["time_breakdown_s"])  # the JSON types, not numpy's


def test_an_older_run_with_inline_lists_still_plots(tmp_path: Path,
                                                    small_run: tuple[Any, Any]) -> None:
    results, spans = small_run
    write_outputs(tmp_path, results, spans, plots=False)
    write_results(tmp_path / "results.json", results)  # the lists inline, as before
    for table in TABLES.values():
        (tmp_path / table.file).unlink(missing_ok=True)
    assert read_results(tmp_path / "results.json")["critical_path"] == results["critical_path"]
    assert [p.name for p in plot_all(tmp_path)] == ["timeline.png", "breakdown.png",
                                                    "memory.png"]
    write_outputs(tmp_path / "new", results, spans, plots=False)
    assert main(["diff", str(tmp_path), str(tmp_path / "new"), "--out",
                 str(tmp_path / "diff")]) == 0  # an old run beside a new one
    diff = json.loads((tmp_path / "diff" / "diff.json").read_text())
    assert diff["step_time_s"]["delta"] == 0.0


def test_a_missing_or_misnamed_table_is_one_line(tmp_path: Path,
                                                 small_run: tuple[Any, Any]) -> None:
    results, spans = small_run
    write_outputs(tmp_path, results, spans, plots=False)
    (tmp_path / "memory_timeline.parquet").unlink()
    with pytest.raises(UserError, match=r"memory_timeline.parquet.* is missing .*run the "):
        read_results(tmp_path / "results.json")
    (tmp_path / "memory_timeline.parquet").write_bytes(b"PAR1 cut short")
    with pytest.raises(UserError, match="is not a readable memory_timeline table"):
        read_results(tmp_path / "results.json")
    data = json.loads((tmp_path / "results.json").read_text())
    data["tables"]["critical_path"] = "../elsewhere.parquet"
    (tmp_path / "results.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"tables\.critical_path"):
        read_results(tmp_path / "results.json")


def test_plot_and_diff_read_a_new_run_directory(tmp_path: Path) -> None:
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL)
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", str(scenario), "--out", str(a), "--no-plots"]) == 0
    assert main(["run", str(scenario), "--out", str(b), "--set", "parallel.pp=1",
                 "--set", "parallel.dp=4", "--no-plots"]) == 0
    assert {t.file for t in TABLES.values() if t.inline_max < 0} <= set(
        json.loads((a / "manifest.json").read_text())["files"])
    assert main(["plot", str(a)]) == 0
    assert (a / "memory.png").stat().st_size > 10_000
    assert main(["diff", str(a), str(b), "--out", str(tmp_path / "d")]) == 0
    diff = json.loads((tmp_path / "d" / "diff.json").read_text())
    assert diff["critical_path"]["forward"]["a"] > 0


def test_a_breakdown_of_many_ranks_moves_to_parquet(tmp_path: Path) -> None:
    """264 data-parallel ranks of the small model at full fidelity: their breakdown
    (more than INLINE_RANKS entries) is time_breakdown.parquet, results.json stays small
    and reads back whole."""
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL)
    out = tmp_path / "run"
    assert main(["run", str(scenario), "--out", str(out), "--no-plots", "--fidelity", "full",
                 "--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set",
                 "parallel.dp=264", "--set", "cluster.nodes=33", "--set",
                 "training.global_batch=528", "--allow-oom"]) == 0
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["tables"]["time_breakdown_s"] == "time_breakdown.parquet"
    assert "time_breakdown_s" not in on_disk and (out / "results.json").stat().st_size < 64 << 10
    back = read_results(out / "results.json")["time_breakdown_s"]
    assert len(back) == 264 > INLINE_RANKS and [e["rank"] for e in back] == list(range(264))


def test_results_json_of_a_small_run_is_small(tmp_path: Path,
                                              small_run: tuple[Any, Any]) -> None:
    results, spans = small_run
    write_outputs(tmp_path, results, spans, plots=False)
    assert (tmp_path / "results.json").stat().st_size < 64 << 10


@pytest.mark.slow
def test_headline_run_keeps_results_json_under_a_megabyte(tmp_path: Path) -> None:
    """GPT-3 175B on 1,024 GPUs, folded (~10 s): results.json < 1 MB, trace.json < 50 MB."""
    assert main(["run", str(SCENARIOS / "gpt3-175b-1024.yaml"), "--out", str(tmp_path),
                 "--no-plots"]) == 0
    assert (tmp_path / "results.json").stat().st_size < RESULTS_LIMIT
    assert (tmp_path / "trace.json").stat().st_size < 50_000_000
    assert len(read_results(tmp_path / "results.json")["critical_path"]) > 1000
