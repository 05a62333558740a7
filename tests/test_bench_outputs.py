"""benchmarks/bench_outputs.py on a small run: every phase reports its seconds and its
resident memory, every file its bytes, and the run's peak is the highest phase's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from small_scenario import SMALL

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_outputs.py"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_each_phase_reports_its_memory_and_each_file_its_bytes(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_outputs", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_outputs"] = bench
    spec.loader.exec_module(bench)
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL)
    r = bench.measure(str(scenario), [], "full", "parquet", "stages", tmp_path / "run",
                      plots=False)
    phases = r["phases"]
    assert {"build", "simulate", "metrics", "span_table", "write_timeline"} <= set(phases)
    assert all(0 < p["after_MB"] <= p["peak_MB"] * 1.01 for p in phases.values())
    assert r["peak_rss_GB"] * 1e3 >= max(p["peak_MB"] for p in phases.values())
    assert r["files_bytes"]["critical_path.parquet"] > 0
    assert r["files_bytes"]["results.json"] == (tmp_path / "run" / "results.json").stat().st_size
    lines = bench.report(r)
    for name, p in phases.items():  # a line per phase with its peak and what stayed
        assert any(line.startswith(name) and f"{p['peak_MB']:,.0f}" in line.split()
                   and f"{p['after_MB']:,.0f}" in line.split() for line in lines), name
    import simulator.api as api

    assert api._timed.__module__ == "simulator.api"  # the wrapper is gone after the run
