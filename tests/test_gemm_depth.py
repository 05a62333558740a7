"""A GEMM's reduction depth (``gpu.gemm_depth``): what a short k-loop keeps of the FLOPs
curve's efficiency, on top of tile and wave quantisation.

The oracle is the project's own calibration of an H200 (``clustersim calibrate``,
docs/validation/profile-nvidia-h200-2026-12-04.results.jsonl and the session before,
``-run3``): cuBLAS bf16 GEMMs at training shapes, each set against the Hopper presets'
curve and tiles without the depth term.
"""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.system.gemm_shape import GemmCall
from simulator.system.hardware import GPUSpec
from simulator.system.profiles import load_system

SESSIONS = Path(__file__).parents[1] / "docs" / "validation"
REFERENCE = SESSIONS / "profile-nvidia-h200-2026-12-04.results.jsonl"
OTHER = SESSIONS / "profile-nvidia-h200-2026-12-04-run3.results.jsonl"
HOPPER = ("dgx-h100", "dgx-h200", "hgx-h800")


def _relative(path: Path) -> dict[int, float]:
    """Per k, the median of measured over preset (curve and tiles, no depth) efficiency
    of the GEMMs of 1.5e10 FLOPs and up, over that median of the k >= 4,096 shapes."""
    gpu = load_system("dgx-h200").gpu.model_copy(update={"gemm_depth": None})
    by_k: dict[int, list[float]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "gemm" and r["ok"] and r["flops"] >= 1.5e10:
            call = GemmCall(r["m"], r["n"], r["k"])
            preset = gpu.efficiency("gemm_fwd", r["flops"], gemm=call)
            by_k[int(r["k"])].append(r["flops"] / r["time_s"] / gpu.peak_flops("bf16") / preset)
    base = statistics.median(v for k, vs in by_k.items() if k >= 4096 for v in vs)
    return {k: statistics.median(vs) / base for k, vs in by_k.items()}


@pytest.mark.parametrize("system", HOPPER)
def test_the_presets_points_are_the_reference_sessions_medians(system: str) -> None:
    curve = load_system(system).gpu.gemm_depth
    assert curve is not None
    measured = _relative(REFERENCE)
    for k, kept in curve.points:
        assert kept == pytest.approx(min(measured[int(k)], 1.0), abs=5e-4), k


def test_the_other_session_reads_the_same_short_depths() -> None:
    """The session before (another machine, GEMMs 14% slower on the whole) loses as much
    at short k, relative to its own deep GEMMs: within 0.05 at k <= 1,376."""
    reference, other = _relative(REFERENCE), _relative(OTHER)
    for k in (512, 640, 1024, 1280, 1376):
        assert other[k] == pytest.approx(reference[k], abs=0.05), k


def test_a_short_k_costs_its_measured_share_on_an_h100() -> None:
    """An 8,192 × 8,192 output over k = 512 keeps 0.848 of what the same output over a
    deep k keeps (tiles and waves alike)."""
    gpu = load_system("dgx-h100").gpu
    deep = gpu.gemm_shape_factor(GemmCall(8192, 8192, 8192))
    assert gpu.gemm_shape_factor(GemmCall(8192, 8192, 512)) == pytest.approx(0.848 * deep)


def test_a_profile_without_the_curve_is_priced_and_echoed_as_before() -> None:
    gpu = load_system("dgx-a100-80gb").gpu
    assert gpu.gemm_depth is None and "gemm_depth" not in gpu.model_dump()
    assert gpu.gemm_shape_factor(GemmCall(8192, 8192, 512)) \
        == gpu.gemm_shape_factor(GemmCall(8192, 8192, 8192))


def test_a_depth_above_one_is_refused() -> None:
    data = load_system("dgx-h100").gpu.model_dump()
    data["gemm_depth"] = {"points": [[512, 1.2], [4096, 1.0]]}
    with pytest.raises(ValueError, match="gemm_depth"):
        GPUSpec.model_validate(data)


@given(m=st.integers(64, 65536), n=st.integers(64, 65536), k=st.integers(16, 65536),
       system=st.sampled_from(HOPPER))
def test_depth_never_speeds_a_gemm_and_deeper_never_loses_more(m: int, n: int, k: int,
                                                               system: str) -> None:
    """Property: the depth term is in (0, 1], 1 from k = 4,096 on, and a deeper k-loop over
    the same output keeps at least as much."""
    gpu = load_system(system).gpu
    plain = gpu.model_copy(update={"gemm_depth": None})
    with_depth = gpu.gemm_shape_factor(GemmCall(m, n, k))
    without = plain.gemm_shape_factor(GemmCall(m, n, k))
    assert 0 < with_depth <= without
    assert gpu.gemm_shape_factor(GemmCall(m, n, 2 * k)) / without >= with_depth / without - 1e-12
    if k >= 4096:
        assert with_depth == without
