"""GEMM curves read from XLA's published GEMM performance table (openxla/xla,
``xla/service/gpu/model/default_matmul_perf_table.txtpb`` at ad6eaee1 of 2026-07-10 and
336bb15c: bf16 dots timed by their CUPTI kernel durations,
``xla/tools/matmul_perf_table_gen.cc``).

The oracle is the table itself: its square GEMMs (m = n = k, b products in one launch),
achieved FLOP/s as published, and every bf16 entry of its H100 and B200 keys
(``tests/data/xla_gemm_bf16.csv``). The B200 preset's GEMM curve is the squares achieved
over the B200's dense bf16 peak at the launch's FLOPs net of its depth term, and its
depth term (``gpu.gemm_depth``) the entries of 1e10 FLOPs and up read per k against the
squares-only curve; the Hopper presets' curve below 1e10 FLOPs is the squares over the
H100's peak net of the presets' tile and depth terms, so that the whole model prices
each of those GEMMs at the table's speed.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.system.curves import interpolate_log
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


#: every bf16 entry of the table's sm_90 and sm_100_B200 keys: (key, b, m, n, k, FLOP/s)
TABLE = Path(__file__).parent / "data" / "xla_gemm_bf16.csv"
DEPTHS = (256, 512, 1024, 2048, 4096)


def _flops(b: int, side: int) -> float:
    return 2.0 * b * side ** 3


def _entries(key: str, floor: float = 0.0) -> list[tuple[GemmCall, float]]:
    """The table's bf16 entries of GPU ``key`` of ``floor`` FLOPs and up: (shape, FLOP/s)."""
    lines = (line for line in TABLE.read_text().splitlines() if not line.startswith("#"))
    out = []
    for r in csv.DictReader(lines):
        call = GemmCall(int(r["m"]), int(r["n"]), int(r["k"]), int(r["b"]))
        if r["gpu"] == key and call.flops * call.batch >= floor:
            out.append((call, float(r["bf16_flops_per_s"])))
    return out


def _squares_only(flops: float) -> float:
    """The B200 table's square GEMMs as a curve: achieved / 2,250 TFLOP/s at the launch's
    FLOPs, read as every curve is read (the preset before its depth term)."""
    return interpolate_log(sorted((_flops(b, side), v / 2.25e15)
                                  for (b, side), v in B200.items()), flops)


def _kept_per_k(ratios: list[tuple[int, float]]) -> dict[int, float]:
    """Per k, the median of ``ratios`` over their median at k = 4,096."""
    by_k: dict[int, list[float]] = {}
    for k, r in ratios:
        by_k.setdefault(k, []).append(r)
    base = statistics.median(by_k[4096])
    return {k: statistics.median(v) / base for k, v in by_k.items()}


def test_the_data_file_holds_every_bf16_entry_of_both_keys() -> None:
    for key in ("sm_90", "sm_100_B200"):
        entries = _entries(key)
        assert len(entries) == 375 == len({(c.batch, c.m, c.n, c.k) for c, _ in entries})
    squares = {(c.batch, int(c.m)): v for c, v in _entries("sm_100_B200")
               if c.m == c.n == c.k}
    assert squares == B200  # the two readings of the file agree
    assert {(c.batch, int(c.m)): v for c, v in _entries("sm_90")
            if c.m == c.n == c.k and c.m <= 1024} == SM90


@pytest.mark.parametrize(("b", "side"), sorted(B200))
def test_the_b200_curve_times_its_depth_is_xlas_b200_table(b: int, side: int) -> None:
    gpu = load_system("dgx-b200").gpu
    assert not gpu.gemm_tiles and gpu.gemm_depth is not None  # curve and depth price it
    measured = B200[(b, side)] / gpu.peak_flops("bf16")
    model = gpu.efficiency("gemm_fwd", _flops(b, side), gemm=GemmCall(side, side, side, b))
    assert model == pytest.approx(measured, rel=0.01)


def test_the_b200_depth_is_the_tables_median_per_k() -> None:
    """Of the entries of 1e10 FLOPs and up, achieved over the squares-only curve, per k
    over k = 4,096: the preset's points (to their three decimals)."""
    kept = _kept_per_k([(int(c.k), v / 2.25e15 / _squares_only(c.flops * c.batch))
                        for c, v in _entries("sm_100_B200", 1e10)])
    depth = load_system("dgx-b200").gpu.gemm_depth
    assert depth is not None
    assert dict(depth.points) == {k: pytest.approx(min(kept[k], 1.0), abs=5e-4)
                                  for k in DEPTHS}


def test_b200_gemms_from_1e10_flops_run_at_the_tables_speed_at_every_depth() -> None:
    """Curve x depth against the 108 entries of 1e10 FLOPs and up: each k's median
    within 1%, 98% of them within 5%; without the depth term the k = 512 entries read
    1.2x fast."""
    gpu = load_system("dgx-b200").gpu
    plain = gpu.model_copy(update={"gemm_depth": None})
    entries = _entries("sm_100_B200", 1e10)
    assert len(entries) == 108
    ratios: dict[int, list[float]] = {k: [] for k in DEPTHS}
    for call, achieved in entries:
        model = gpu.efficiency("gemm_fwd", call.flops * call.batch, gemm=call)
        ratios[int(call.k)].append(model * 2.25e15 / achieved)
    for k, rs in ratios.items():
        assert statistics.median(rs) == pytest.approx(1.0, abs=0.01), k
    every = [r for rs in ratios.values() for r in rs]
    assert sum(abs(r - 1) <= 0.05 for r in every) >= 0.98 * len(every)
    short = [plain.efficiency("gemm_fwd", c.flops * c.batch) * 2.25e15 / v
             for c, v in entries if c.k == 512]
    assert statistics.median(short) > 1.2


def test_xlas_h100_table_corroborates_the_hopper_depth() -> None:
    """The same reading of the table's sm_90 entries (achieved over the Hopper curve and
    tiles without depth) keeps within 0.03 of what the Hopper presets' curve, from our
    H200's calibration, keeps at k = 512, 1,024 and 2,048."""
    gpu = load_system("dgx-h100").gpu
    plain = gpu.model_copy(update={"gemm_depth": None})
    kept = _kept_per_k([(int(c.k), v / 989e12 / plain.efficiency(
        "gemm_fwd", c.flops * c.batch, gemm=c)) for c, v in _entries("sm_90", 1e10)])
    depth = gpu.gemm_depth
    assert depth is not None
    for k in (512, 1024, 2048):
        assert kept[k] == pytest.approx(depth(k), abs=0.03), k


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
