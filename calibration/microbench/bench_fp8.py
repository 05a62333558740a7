"""FP8 GEMMs (``torch._scaled_mm``, E4M3 operands with per-tensor fp32 scales, a bf16
result): the GEMMs of a stack with ``stack.fp8``, timed where the device runs them, for the
profile's ``gpu.peak_tflops.fp8`` and ``gpu.fp8_gemm_efficiency``.

Where: a CUDA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell: cuBLASLt's
FP8 GEMMs), and a CPU whose PyTorch build runs ``_scaled_mm`` (torch 2.13's CPU build
does, without FP8 units: slowly, but it is the kernel the CPU path would run). Elsewhere
the stage is skipped with the reason, and the fit keeps no FP8 curve
(:func:`calibration.microbench.fit_profile.fit_compute`). ``_scaled_mm`` wants its second
operand column-major (cuBLASLt's FP8 "TN" layout), so it is a transposed (n, k) tensor;
the shapes are the forward GEMMs of :func:`calibration.microbench.bench_compute.gemm_plan`
(on a CPU only the small ones), each record's size its FLOPs, 2mnk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from calibration.microbench.bench_jobs import Job, Runner, key_prefix, run_jobs
from calibration.microbench.bench_results import ResultsStore
from calibration.microbench.bench_shapes import GemmShape, spread_by_size
from calibration.microbench.bench_timing import Budget, Device, rotation_count, time_calls

#: FP8 GEMMs timed: a spread over the plan's sizes (at most the level's memory sizes per
#: kernel, at least two for a curve)
FP8_SHAPES = 8
#: the largest FP8 GEMM timed on a CPU, FLOPs (~0.1 s at the ~0.2-1 GFLOP/s of its
#: emulated FP8)
CPU_MAX_FLOPS = 3e7
#: CUDA compute capability from which cuBLASLt has FP8 GEMMs (Ada 8.9; Transformer Engine's
#: check_fp8_support: transformer_engine/pytorch/quantization.py)
MIN_CAPABILITY = (8, 9)


def fp8_support(device: Device) -> tuple[bool, str]:
    """Whether ``device`` runs ``torch._scaled_mm``, and if not why."""
    import torch

    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False, f"torch {torch.__version__} has no _scaled_mm / float8_e4m3fn"
    if device.kind == "cuda":
        cap = torch.cuda.get_device_capability(device.index)
        if cap < MIN_CAPABILITY:
            return False, (f"compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores "
                           "(8.9 or later needed)")
    try:  # the dispatcher raises NotImplementedError where no backend kernel exists
        call = _call(device, GemmShape(16, 16, 16, "probe"), 1)
        call(0)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return False, f"torch._scaled_mm on {device.kind}: {str(exc).splitlines()[0]}"
    return True, ""


def fp8_shapes(plan: list[GemmShape], device: Device, budget: Budget) -> list[GemmShape]:
    """The FP8 GEMMs to time: a spread of the plan's (on a CPU, of its small ones)."""
    cap = CPU_MAX_FLOPS if device.kind == "cpu" else float("inf")
    small = [s for s in plan if s.flops <= cap] or plan[:1]
    return spread_by_size(small, max(2, min(FP8_SHAPES, budget.memory_sizes)),
                          lambda s: s.flops)


def _call(device: Device, shape: GemmShape, nbuf: int) -> Callable[[int], object]:
    """``call(i)``: Y[m, n] = A[m, k] · B[k, n] in FP8 on the i-th of ``nbuf`` sets, B
    column-major, scales of one, the bf16 result written into a buffer touched before."""
    import torch

    dev, e4m3 = device.torch_device, torch.float8_e4m3fn
    a = [torch.randn(shape.m, shape.k, device=dev).to(e4m3) for _ in range(nbuf)]
    b = [torch.randn(shape.n, shape.k, device=dev).to(e4m3).t() for _ in range(nbuf)]
    one = torch.ones((), dtype=torch.float32, device=dev)

    def call(i: int) -> object:
        return torch._scaled_mm(a[i], b[i], scale_a=one, scale_b=one,
                                out_dtype=torch.bfloat16)
    return call


def _runner(device: Device, budget: Budget, shape: GemmShape) -> Runner:
    def run() -> tuple[float, dict[str, Any]]:
        per_set = shape.m * shape.k + shape.k * shape.n + 2 * shape.m * shape.n
        nbuf = rotation_count(device, per_set, 0.25 * device.free_bytes())
        t = time_calls(device, _call(device, shape, nbuf), nbuf, budget.target_s,
                       budget.min_reps, budget.max_reps, budget.min_batch_s)
        return t.time_s, {"reps": t.reps, "calls": t.calls_per_rep, "spread": round(t.spread, 4),
                          "buffers": nbuf}
    return run


def fp8_jobs(device: Device, budget: Budget, shapes: list[GemmShape]) -> list[Job]:
    prefix = key_prefix(device, "fp8")
    return [Job(f"{prefix}/gemm_fp8/{s.label}", "gemm_fp8", f"{s.label} fp8", s.flops, "gemm_fp8",
                {"dtype": "fp8", "device": device.kind, "threads": device.threads, "m": s.m,
                 "n": s.n, "k": s.k, "flops": s.flops, "source": s.source},
                _runner(device, budget, s)) for s in shapes]


def run_fp8_gemm(device: Device, budget: Budget, store: ResultsStore,
                 plan: list[GemmShape]) -> str:
    """Time the FP8 GEMMs where ``device`` runs them; returns why not ("" when it did)."""
    ok, why = fp8_support(device)
    if not ok:
        print(f"fp8 GEMMs: skipped ({why})", flush=True)
        return why
    run_jobs("gemm-fp8", fp8_jobs(device, budget, fp8_shapes(plan, device, budget)), store, budget,
             "flops")
    return ""
