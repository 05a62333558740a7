"""GEMM curves read from XLA's published GEMM performance table (openxla/xla,
``xla/service/gpu/model/default_matmul_perf_table.txtpb`` at ad6eaee1 of 2026-07-10:
bf16 dots timed by their CUPTI kernel durations, ``xla/tools/matmul_perf_table_gen.cc``).

The oracle is the table itself: its square GEMMs (m = n = k, b products in one launch),
achieved FLOP/s as published. The B200 preset's GEMM curve is those achieved over the
B200's dense bf16 peak at the launch's FLOPs; the Hopper presets' curve below 1e10 FLOPs
is them over the H100's peak net of the presets' tile and depth terms, so that the whole
model prices each of those GEMMs at the table's speed.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.system.gemm_shape import GemmCall
from simulator.system.profiles import load_system

#: (products, side) -> achieved bf16 FLOP/s, key sm_90 (H100)
SM90 = {(1, 256): 6721641025641, (2, 256): 12336188235294, (4, 256): 23899168091168,
        (1, 512): 43577184415584, (2, 512): 84733414141414, (4, 512): 146846529540481,
        (1, 1024): 252764082862523, (2, 1024): 382386689458689,
        (4, 1024): 499414801860465}
#: the same for key sm_100_B200 (B200)
B200 = {(1, 256): 6765006451612, (2, 256): 13527285627897, (4, 256): 24745156342182,
        (1, 512): 48480306303052, (2, 512): 89210852775008, (4, 512): 165292768472906,
        (1, 1024): 288020875536480, (2, 1024): 496183837338262,
        (4, 1024): 713924085106383, (1, 2048): 985762519164562,
        (2, 2048): 1160566721880699, (4, 2048): 1276364723922734,
        (1, 4096): 1416867213789406, (2, 4096): 1466617794742374,
        (4, 4096): 1670467342710337}
HOPPER = ("dgx-h100", "dgx-h200", "hgx-h800")
SYSTEMS = ("dgx-a100-40gb", "dgx-a100-80gb", *HOPPER, "dgx-b200", "gb200-nvl72")


def _flops(b: int, side: int) -> float:
    return 2.0 * b * side ** 3


@pytest.mark.parametrize(("b", "side"), sorted(B200))
def test_the_b200_curve_is_xlas_b200_table(b: int, side: int) -> None:
    gpu = load_system("dgx-b200").gpu
    assert not gpu.gemm_tiles and gpu.gemm_depth is None  # the curve alone prices it
    measured = B200[(b, side)] / gpu.peak_flops("bf16")
    assert gpu.efficiency("gemm_fwd", _flops(b, side)) == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("system", HOPPER)
@pytest.mark.parametrize(("b", "side"), sorted(SM90))
def test_a_small_hopper_gemm_runs_at_xlas_h100_speed(system: str, b: int, side: int) -> None:
    """Curve x tiles x depth of each square GEMM under 1e10 FLOPs: the table's speed (to
    the points' three decimals)."""
    gpu = load_system(system).gpu
    call = GemmCall(side, side, side, b)
    model = gpu.efficiency("gemm_fwd", _flops(b, side)) * gpu.gemm_shape_factor(call)
    assert model == pytest.approx(SM90[(b, side)] / 989e12, rel=0.03)


def test_large_hopper_gemms_keep_the_training_readings() -> None:
    """From 1e10 FLOPs the Hopper curve stays at its readings of training GEMM rates
    (below the table's bursts: 0.72 at 1e11 where 4096^3 bursts at 0.79)."""
    gpu = load_system("dgx-h100").gpu
    points = dict(gpu.gemm_efficiency.points)
    assert (points[1e10], points[1e11], points[1e12]) == (0.60, 0.72, 0.75)
    assert gpu.efficiency("gemm_fwd", 1.37e11) < SM90.get((1, 4096), 780193877565849) / 989e12


@pytest.mark.parametrize("system", SYSTEMS)
@given(st.floats(1e6, 1e14), st.floats(1.01, 100.0))
def test_a_bigger_gemm_never_runs_at_a_lower_efficiency(system: str, flops: float,
                                                         more: float) -> None:
    gpu = load_system(system).gpu
    small = gpu.efficiency("gemm_fwd", flops)
    assert 0 < small <= gpu.efficiency("gemm_fwd", flops * more) <= 1


def test_a_gemm_kernel_takes_microseconds_not_fractions() -> None:
    """The smallest square GEMM of the table, 256^3, takes about 5 us on both GPUs; the
    curves Hopper and B200 carried before put it at 0.4 us and 0.2 us."""
    for system, table in (("dgx-h100", SM90), ("dgx-b200", B200)):
        gpu = load_system(system).gpu
        flops = _flops(1, 256)
        call = GemmCall(256, 256, 256)
        seconds = flops / (gpu.peak_flops("bf16") * gpu.efficiency("gemm_fwd", flops, gemm=call))
        assert seconds == pytest.approx(flops / table[(1, 256)], rel=0.05)
        assert seconds > 4e-6
