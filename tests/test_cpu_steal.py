"""The hypervisor's share of the CPU (steal): read from ``/proc/stat``, judged by the
calibration's busy guard, recorded with each measured run and shown in the validation
table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

import calibration.host as host
from calibration.host import STEAL_LIMIT, StealMeter, cpu_times, steal_share
from calibration.microbench.busy_guard import judge

# user nice system idle iowait irq softirq steal guest guest_nice
STAT = "cpu  {u} 0 100 {i} 0 0 0 {st} 50 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1 2\n"


def _stat(user: int, idle: int, steal: int) -> str:
    return STAT.format(u=user, i=idle, st=steal)


def test_cpu_times_reads_the_all_cpu_line_and_leaves_guest_out() -> None:
    # guest (50) is already in user: the total is the first eight fields
    assert cpu_times(_stat(1000, 8000, 900)) == (900, 1000 + 100 + 8000 + 900)
    assert cpu_times("cpu  1 2 3 4\n") is None  # a kernel without the steal field
    assert cpu_times("intr 1 2\n") is None
    assert cpu_times("cpu  a b c d e f g h\n") is None


def test_steal_share_is_the_steal_ticks_over_all_ticks_between_readings() -> None:
    before = cpu_times(_stat(1000, 8000, 900))
    after = cpu_times(_stat(1600, 8200, 1100))  # +600 user, +200 idle, +200 steal
    assert steal_share(before, after) == pytest.approx(200 / 1000)
    assert steal_share(before, before) is None  # no tick passed
    assert steal_share(None, after) is None and steal_share(before, None) is None


def test_meter_measures_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([(900, 10000), (1250, 11000)])
    monkeypatch.setattr(host, "cpu_times", lambda: next(readings))
    with StealMeter() as meter:
        assert meter.share is None
    assert meter.share == pytest.approx(0.35)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux only")
def test_meter_on_this_machine_reads_a_share() -> None:
    with StealMeter() as meter:
        sum(i * i for i in range(300_000))
    assert meter.share is None or 0.0 <= meter.share <= 1.0


def _ref(time_s: float) -> dict[str, Any]:
    return {"kind": "reference", "time_s": time_s, "spread": 0.02}


def test_busy_guard_fires_on_steal_even_with_steady_timings() -> None:
    steady = [{"kind": "gemm", "ok": True, "spread": 0.03}] * 10
    quiet = judge([_ref(1e-3), _ref(1e-3)], steady, steal=0.02)
    assert not quiet.busy and quiet.warning() is None
    assert quiet.as_dict()["steal"] == 0.02 and quiet.as_dict()["steal_limit"] == STEAL_LIMIT
    stolen = judge([_ref(1e-3), _ref(1e-3)], steady, steal=0.35)
    assert stolen.busy and STEAL_LIMIT < 0.35
    text = stolen.warning() or ""
    assert "hypervisor took 35% of the CPU" in text and "\n" not in text
    assert not judge([_ref(1e-3), _ref(1e-3)], steady).busy  # no steal counter: no verdict


def test_measured_run_records_its_steal_and_warns(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import calibration.measured.measure as msr

    def fake_launch(cfg: Any, config_path: Path) -> None:
        (Path(cfg.out_dir) / "measured.json").write_text(json.dumps({"step_time_s": 1.0}))

    readings = iter([(0, 1000), (300, 2000)])
    monkeypatch.setattr(msr, "launch", fake_launch)
    monkeypatch.setattr(host, "cpu_times", lambda: next(readings))
    got = msr.run_config(msr.make_config(tp=1, pp=1, dp=2, out_dir=str(tmp_path)))
    assert got["cpu_steal"] == 0.3
    assert any("hypervisor took 30%" in w for w in got["warnings"])
    assert json.loads((tmp_path / "measured.json").read_text())["cpu_steal"] == 0.3


def test_validation_row_and_table_show_the_steal(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import calibration.measured.compare as cmp
    import calibration.measured.measure as msr
    from calibration.measured.validation_configs import CPU_CONFIGS
    from calibration.measured.validation_runs import run_one
    from calibration.measured.validation_table import markdown, summary

    monkeypatch.setattr(msr, "run_measure", lambda *a, **k: {
        "step_times_s": [1.0, 1.0, 1.0, 1.0], "cpu_steal": 0.35})
    fig = {"step_time_s": 1.0, "compute_s": 0.8, "idle_fraction": 0.1}
    monkeypatch.setattr(cmp, "run_compare", lambda *a, **k: {
        "measured": fig, "simulated": fig,
        "relative_error": {"step_time_s": 0.0, "compute_s": 0.0}})
    args = argparse.Namespace(retries=1, micro_batches=4, steps=None, warmup=None,
                              device="cpu", threads=1, timeout=60.0, micro_batch_size=2,
                              repeats=1)
    row = run_one(CPU_CONFIGS[0], args, "p.yaml", tmp_path / "dp2-ddp", "small-gpt")
    assert row["cpu_steal"] == 0.35  # measured again (steady steps, but stolen): no better
    assert row["note"] == ("1 run(s) set aside for steal (35%); every run stolen, kept the "
                           "least; the hypervisor took 35% of the CPU (steal) during the run")
    header = {"device": "cpu", "device_name": "vm", "threads": 1, "torch": "x",
              "profile": "p.yaml", "date": "d", "micro_batches": 4, "micro_batch_size": 2,
              "steps": 8, "model": "small-gpt", "calibration_steal": 0.04}
    md = markdown([row], header)
    assert "profile `p.yaml` (calibrated with 4% steal)," in md
    assert "| 10% | 10% | 35% | 1 run(s) set aside for steal (35%)" in md
    assert "1 row(s) ran while the hypervisor took 35% of the CPU (steal" in summary([row])
    other = {**row, "config": "pp2-gpipe", "cpu_steal": 0.08}
    assert "2 row(s) ran while the hypervisor took 8%–35% of the CPU" in summary([row, other])


def test_profile_steal_reads_the_busy_guard(tmp_path: Path) -> None:
    from calibration.measured.validation import profile_steal

    path = tmp_path / "p.yaml"
    path.write_text("provenance:\n  busy_guard:\n    steal: 0.12\n")
    assert profile_steal(str(path)) == 0.12
    path.write_text("gpu: {}\n")
    assert profile_steal(str(path)) is None
    assert profile_steal(str(tmp_path / "missing.yaml")) is None
