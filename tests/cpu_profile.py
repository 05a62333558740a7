"""The profile the calibration-term tests fit from synthetic records: a test CPU of two
processes over the ``cpu-1thread`` preset (one place, so a change to what a calibrated
profile holds reaches all of them)."""

from __future__ import annotations

from typing import Any

from calibration.microbench.fit_profile import fit_compute
from calibration.microbench.profile_build import build_profile
from simulator.system.profiles import load_system


def profile_from(records: list[dict[str, Any]], drift: float | None = None) -> dict[str, Any]:
    """The profile ``clustersim calibrate`` would write from ``records``."""
    fits = fit_compute(records, "cpu", "fp32", 1, "test cpu", drift)
    return build_profile(fits, load_system("cpu-1thread"), name="t", device="cpu",
                         device_name="test cpu", gpus_per_node=2, memory_GB=8.0,
                         provenance={}, datasheet=False)
