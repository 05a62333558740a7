"""Preset curves read from published kernel timings, each pinned to its source's numbers:
the A100's small GEMMs (cuBLAS as triton-lang/triton#7085 publishes it), the rate its
large ones sustain at the power limit (Perlmutter's per-GPU GEMM times) and the Blackwell
presets' fused attention (NVIDIA/cudnn-frontend's SDPA training benchmarks on B200 and
GB200). The oracle is the published table; the model must price each published call at
its published speed."""

from __future__ import annotations

import pytest

from simulator.system.attention_kernels import AttentionCall
from simulator.system.gemm_shape import GemmCall
from simulator.system.profiles import load_system

#: m = n = k -> cuBLAS fp16 TFLOP/s on an A100, Triton 3.3's and 3.2's runs (#7085)
A100_CUBLAS = {256: (3.28, 3.28), 384: (10.05, 11.06), 512: (23.83, 21.85),
               640: (36.57, 39.38), 768: (58.98, 58.98), 896: (73.94, 70.25),
               1024: (99.86, 99.86), 1152: (129.83, 129.83)}
#: hpcgroup/perf-variability-ipdps26 plot/perlmutter/gemm/gemm_data.csv (d0250462): seconds
#: of a 32768^3 fp16 GEMM, 100 back to back, on Perlmutter's A100-SXM4-40GB, read at 11
#: offsets spread over the file: offset -> (rows, mean seconds)
PERLMUTTER_GEMM = {0: (730, 0.271833), 224000: (730, 0.272115), 448000: (730, 0.272011),
                   672000: (729, 0.271959), 896000: (730, 0.272067), 1120000: (730, 0.272534),
                   1344000: (731, 0.272173), 1568000: (731, 0.271223),
                   1792000: (729, 0.271953), 2016000: (730, 0.272055),
                   2240000: (731, 0.272271)}
#: cudnn-frontend sdpa_bf16_benchmark_results_NVIDIA_B200.csv: seq -> (fwd, bwd) TFLOP/s,
#: causal, head dim 128, by backend
B200_SDPA = {"cudnn": {4096: (855.678, 701.265), 8192: (1171.278, 942.509),
                       16384: (1332.415, 1074.776), 32768: (1419.000, 1108.688)},
             "flash2": {4096: (342.990, 273.484), 8192: (399.925, 318.004),
                        16384: (425.128, 336.635), 32768: (435.762, 345.634)}}
#: cudnn-frontend results/llama3.1/gb200 (cuDNN 9.27): seq -> (fwd, bwd) TFLOP/s, causal
GB200_CUDNN = {2048: (1061, 880), 4096: (1334, 1131), 8192: (1552, 1297),
               16384: (1608, 1271), 32768: (1556, 1241)}


@pytest.mark.parametrize("system", ["dgx-a100-40gb", "dgx-a100-80gb"])
def test_a_large_a100_gemm_runs_at_the_rate_it_sustains_at_the_power_limit(
        system: str) -> None:
    """From 1e12 FLOPs the curve is the mean rate of Perlmutter's 8,031 GEMM runs (0.829 of
    312 TFLOP/s), and no GEMM is priced above it: a training step runs its GEMMs back to
    back at the power limit, not at the burst of a short microbenchmark (~0.85)."""
    rows = sum(n for n, _ in PERLMUTTER_GEMM.values())
    seconds = sum(n * t for n, t in PERLMUTTER_GEMM.values()) / rows
    sustained = 2.0 * 32768 ** 3 / seconds / 312e12
    assert rows == 8031 and sustained == pytest.approx(0.829, abs=5e-4)
    gpu = load_system(system).gpu
    for flops in (1e12, 2.0 * 32768 ** 3, 1e15):
        assert gpu.efficiency("gemm_fwd", flops) == pytest.approx(sustained, abs=5e-4)
    assert max(e for _, e in gpu.gemm_efficiency.points) <= sustained + 5e-4


@pytest.mark.parametrize("system", ["dgx-a100-40gb", "dgx-a100-80gb"])
@pytest.mark.parametrize("side", sorted(A100_CUBLAS))
def test_a_small_a100_gemm_takes_its_published_time(system: str, side: int) -> None:
    gpu = load_system(system).gpu
    flops = 2.0 * side ** 3
    call = GemmCall(side, side, side)
    assert gpu.gemm_shape_factor(call) == 1.0  # square, under one wave: the curve alone
    published = sum(A100_CUBLAS[side]) / 2 * 1e12
    model = gpu.peak_flops("bf16") * gpu.efficiency("gemm_fwd", flops, gemm=call)
    assert model == pytest.approx(published, rel=0.01)


def test_an_a100_gemm_kernel_takes_microseconds() -> None:
    gpu = load_system("dgx-a100-80gb").gpu
    flops = 2.0 * 256 ** 3
    assert flops / (gpu.peak_flops("bf16") * gpu.efficiency("gemm_fwd", flops)) > 9e-6


@pytest.mark.parametrize(("system", "kernel", "table"), [
    ("dgx-b200", "cudnn", B200_SDPA["cudnn"]), ("dgx-b200", "flash2", B200_SDPA["flash2"]),
    ("gb200-nvl72", "cudnn", GB200_CUDNN)])
def test_blackwell_attention_runs_at_its_published_rate(system: str, kernel: str,
                                                         table: dict[int, tuple[float, float]]
                                                         ) -> None:
    gpu = load_system(system).gpu
    peak = gpu.peak_flops("bf16")
    for seq, (fwd, bwd) in table.items():
        call = AttentionCall(kernel, seq, 128)
        assert gpu.efficiency("attention_fwd", 1e12, call=call) * peak == \
            pytest.approx(fwd * 1e12, rel=0.01), seq
        assert gpu.efficiency("attention_bwd", 1e12, call=call) * peak == \
            pytest.approx(bwd * 1e12, rel=0.01), seq


@pytest.mark.parametrize("system", ["dgx-b200", "gb200-nvl72"])
def test_te_runs_cudnn_on_blackwell_and_flash2_a_third_of_it(system: str) -> None:
    gpu = load_system(system).gpu
    te, flash2 = AttentionCall("te", 16384, 128), AttentionCall("flash2", 16384, 128)
    cudnn = gpu.efficiency("attention_fwd", 1e12, call=te)
    assert cudnn == gpu.efficiency("attention_fwd", 1e12, call=AttentionCall("cudnn", 16384, 128))
    assert 0.25 < gpu.efficiency("attention_fwd", 1e12, call=flash2) / cudnn < 0.35


#: XLA's sm_100_B200 squares: m^3 -> (bf16, fp8 e4m3) achieved FLOP/s (ad6eaee1)
B200_FP8 = {512: (48480306303052, 39290903981264), 1024: (288020875536480, 332994828345479)}
#: A100 fp32 (no TF32) cuBLAS GFLOP/s-as-TFLOP/s of triton-lang/triton#2491, m = n = k
A100_FP32 = {256: 2.048, 512: 8.192, 1024: 16.008795}


def _gemm_time(system: str, dtype: str, side: int, precision: str = "") -> float:
    from simulator.model.inventory.ops import Op
    from simulator.system.costs import CostModel

    cost = CostModel(load_system(system), dtype)  # type: ignore[arg-type]
    flops = 2.0 * side ** 3
    op = Op("g", "gemm", flops, 0.0, flops, "gemm_fwd", gemm_call=GemmCall(side, side, side),
            precision=precision)
    return cost.op_parts(op)[0]


@pytest.mark.parametrize("side", sorted(A100_FP32))
def test_an_fp32_gemm_reads_the_curve_at_its_ideal_duration(side: int) -> None:
    """A100 fp32 SIMT GEMMs (19.5 TFLOP/s peak) against the bf16 curve read at the FLOPs
    of a bf16 GEMM as long: within 20% of cuBLAS as published (read at its own FLOPs, a
    256^3 fp32 GEMM would take ten times too long). Up to 1024^3, under one wave of the
    tensor-core tiles the tile term assumes (SIMT kernels tile otherwise)."""
    measured = 2.0 * side ** 3 / (A100_FP32[side] * 1e12)
    assert _gemm_time("dgx-a100-80gb", "fp32", side) == pytest.approx(measured, rel=0.2)


def test_an_fp8_gemm_reads_the_curve_at_half_its_flops() -> None:
    """On the B200 an FP8 GEMM takes as long as the bf16 one of half its FLOPs would at the
    bf16 peak (its shape's depth term alike): XLA's table shows it, the model does it."""
    for side in (1024, 2048, 4096):
        fp8 = _gemm_time("dgx-b200", "bf16", side, precision="fp8")
        gpu = load_system("dgx-b200").gpu
        flops = 2.0 * side ** 3
        kept = gpu.efficiency("gemm_fwd", flops / 2) \
            * gpu.gemm_shape_factor(GemmCall(side, side, side))
        expected = flops / (gpu.peak_flops("fp8") * kept)
        assert fp8 == pytest.approx(expected, rel=1e-12)
    # and against the table: 1024^3 fp8 within 12% of the published speed
    measured = 2.0 * 1024 ** 3 / B200_FP8[1024][1]
    assert _gemm_time("dgx-b200", "bf16", 1024, precision="fp8") == \
        pytest.approx(measured, rel=0.12)


def test_a_cpu_profile_reads_its_own_curve_at_its_own_flops() -> None:
    from simulator.system.costs import curve_flops

    cpu = load_system("cpu-1thread")
    assert curve_flops(cpu, "gemm_fwd", 1e9, cpu.gpu.peak_flops("fp32")) == 1e9
    gpu = load_system("dgx-h100")
    assert curve_flops(gpu, "gemm_fwd", 1e9, gpu.gpu.peak_flops("bf16")) == 1e9
    assert curve_flops(gpu, "attention_fwd", 1e9, gpu.gpu.peak_flops("fp32")) == 1e9
    assert curve_flops(gpu, "gemm_fwd", 1e9, gpu.gpu.peak_flops("fp32")) == \
        pytest.approx(1e9 * 989 / 67)
