"""The profile the calibration-term tests fit from synthetic records: a test CPU of two
processes over the ``cpu-1thread`` preset (one place, so a change to what a calibrated
profile holds reaches all of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from calibration.microbench.fit_profile import fit_compute
from calibration.microbench.profile_build import build_profile
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.system.profiles import SYSTEMS_DIR, load_system


def profile_from(records: list[dict[str, Any]], drift: float | None = None) -> dict[str, Any]:
    """The profile ``clustersim calibrate`` would write from ``records``."""
    fits = fit_compute(records, "cpu", "fp32", 1, "test cpu", drift)
    return build_profile(fits, load_system("cpu-1thread"), name="t", device="cpu",
                         device_name="test cpu", gpus_per_node=2, memory_GB=8.0,
                         provenance={}, datasheet=False)


def in_line_scenario(tmp_path: Path, stack: str, parallel: dict[str, Any]) -> Scenario:
    """tiny-gpt on two ranks of a CPU profile with sync and functional-collective costs
    but no burst curve, so communication runs in line with compute: the scenario the
    analytic-against-engine tests price both ways."""
    import yaml

    system = yaml.safe_load((SYSTEMS_DIR / "cpu-1thread.yaml").read_text())
    system["gpu"].update({"collective_sync_us": {"intra_node": 800.0},
                          "funcol_host": {"all_reduce": {"us": 500.0, "us_per_mib": 100.0},
                                          "all_gather": {"us": 700.0, "us_per_mib": 300.0}},
                          "host_overhead_us": 5.0})
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(system))
    return scenario_from_dict({
        "name": "t", "model": {"preset": "tiny-gpt"}, "stack": stack,
        "cluster": {"system": str(path), "nodes": 1, "gpus_per_node": 2},
        "parallel": parallel,
        "training": {"global_batch": 8, "micro_batch": 2, "dtype": "fp32"}})
