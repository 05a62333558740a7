"""The profile's per-term schema: a curve per cost class with fallbacks to the generic
curves, the interference factor per link class and the uncertainty section; all
optional, so every bundled preset and older profile still loads unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from simulator.errors import UserError
from simulator.system.hardware import HardwareProfile
from simulator.system.profiles import load_system, preset_system_names, validate_profile
from simulator.system.units import COST_CLASSES, UNCERTAINTY_TERMS

ROOT = Path(__file__).resolve().parent.parent
PROFILES = [ROOT / "calibration" / "profiles" / "cpu-epyc-1thread.yaml",
            *sorted((ROOT / "docs" / "validation").glob("profile-*.yaml"))]


def _data(**gpu: Any) -> dict[str, Any]:
    """A preset's data with ``gpu`` fields added (a fresh copy each call)."""
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"].update(gpu)
    for key in ("class_efficiency", "interference", "collective_sync_us"):
        if key not in gpu:
            del data["gpu"][key]
    del data["uncertainty"]
    return data


def _curve(*pts: tuple[float, float]) -> dict[str, Any]:
    return {"points": [list(p) for p in pts]}


@pytest.mark.parametrize("name", preset_system_names())
def test_presets_load_without_the_new_terms(name: str) -> None:
    """No preset states the new terms but the norm class (PyTorch's LayerNorm, from a
    published microbenchmark: tests/test_norm_kernels.py); each other class falls back
    to its kind's curve."""
    gpu = load_system(name).gpu
    assert set(gpu.class_efficiency) <= {"norm"} and gpu.interference == {}
    assert load_system(name).uncertainty == {}
    for size in (1e3, 1e6, 1e9, 1e12):
        for cls in ("gemm_fwd", "gemm_dgrad", "gemm_wgrad"):
            assert gpu.efficiency(cls, size) == gpu.gemm_efficiency(size)
        for cls in ("attention_fwd", "attention_bwd"):
            assert gpu.efficiency(cls, size) == gpu.attention_efficiency(size)
        for cls in ("softmax", "cross_entropy", "elementwise", "norm", "reduction", "copy",
                    "optimizer"):
            if cls not in gpu.class_efficiency:
                assert gpu.efficiency(cls, size) == gpu.memory_efficiency(size)
    assert gpu.interference_factor("intra_node") == gpu.interference_factor("inter_node") == 1
    assert gpu.collective_sync_us == {} and gpu.collective_sync_s("intra_node") == 0


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_older_calibrated_profiles_still_load(path: Path) -> None:
    """Every committed profile loads; one written before the uncertainty section has
    none (the validation's newer profiles carry their spreads)."""
    profile = load_system(str(path))
    if "uncertainty:" not in path.read_text():
        assert profile.uncertainty == {}


def test_a_class_curve_replaces_only_its_own_class() -> None:
    prof = validate_profile(_data(class_efficiency={
        "gemm_wgrad": _curve((1e6, 0.2), (1e10, 0.6)),
        "softmax": _curve((1e3, 0.05), (1e7, 0.5))}), "p.yaml")
    gpu = prof.gpu
    assert gpu.efficiency("gemm_wgrad", 1e8) == pytest.approx(0.4)  # halfway in log10
    assert gpu.efficiency("gemm_wgrad", 1e4) == 0.2 and gpu.efficiency("gemm_wgrad", 1e12) == 0.6
    assert gpu.efficiency("gemm_fwd", 1e8) == gpu.gemm_efficiency(1e8)
    assert gpu.efficiency("softmax", 1e5) == pytest.approx(0.275)
    assert gpu.efficiency("norm", 1e5) == gpu.memory_efficiency(1e5)


def test_interference_and_uncertainty_round_trip(tmp_path: Path) -> None:
    data = _data(interference={"inter_node": 1.25})
    data["uncertainty"] = {"gemm": 0.03, "kernel_overhead": 0.2, "inter_node": 0.0}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    prof = load_system(str(path))
    assert prof.gpu.interference_factor("inter_node") == 1.25
    assert prof.gpu.interference_factor("intra_node") == 1.0
    assert prof.uncertainty == {"gemm": 0.03, "kernel_overhead": 0.2, "inter_node": 0.0}
    assert HardwareProfile.model_validate(prof.model_dump()) == prof


def test_every_cost_class_is_an_uncertainty_term() -> None:
    assert set(COST_CLASSES) <= set(UNCERTAINTY_TERMS)
    assert {"gemm", "attention", "memory", "kernel_overhead", "interference",
            "collective_sync"} <= set(UNCERTAINTY_TERMS)


def test_unknown_cost_class_is_refused_by_the_method() -> None:
    with pytest.raises(ValueError, match="unknown cost class"):
        load_system("dgx-h100").gpu.efficiency("gemm", 1e9)


def _with_uncertainty(value: Any) -> dict[str, Any]:
    data = _data()
    data["uncertainty"] = value
    return data


@pytest.mark.parametrize(("data", "fix"), [
    (_data(class_efficiency={"gemm_fw": _curve((1, 0.5))}),
     "unknown cost class 'gemm_fw'; did you mean 'gemm_fwd'"),
    (_data(class_efficiency={"softmax": _curve((1, 1.5))}), "efficiencies must lie in"),
    (_data(interference={"nvlink": 1.2}), "unknown link class 'nvlink'"),
    (_data(interference={"intra_node": 0.9}), "greater than or equal to 1"),
    (_data(interference={"intra_node": 11.0}), "less than or equal to 10"),
    (_with_uncertainty({"gemm": 1.5}), "less than or equal to 1"),
    (_with_uncertainty({"gemm": -0.1}), "greater than or equal to 0"),
    (_with_uncertainty({"flops": 0.1}), "unknown uncertainty term 'flops'"),
    (_with_uncertainty({"gemm": "0.1"}), "valid number"),
])
def test_bad_terms_are_one_line_user_errors(data: dict[str, Any], fix: str) -> None:
    with pytest.raises(UserError) as err:
        validate_profile(data, "p.yaml")
    text = str(err.value)
    assert fix in text and "\n" not in text.strip()
    assert "p.yaml" in text
