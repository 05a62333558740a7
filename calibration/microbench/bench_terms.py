"""Microbenchmarks for the cost terms beyond the shared curves, and the reference kernel.

- Per-kernel overhead: an elementwise add and a copy from one element up to 16 Ki
  elements (4 bytes to ~200 KB moved), where a kernel's fixed cost dominates;
  :func:`calibration.microbench.fit.fit_intercept` reads the overhead off the
  intercept of t = o + bytes / bandwidth.
- GEMM backward layouts: for a spread of the forward shapes (an eighth of them,
  at least six), the input gradient dX = dY · Wᵀ and the weight gradient
  dW = Xᵀ · dY with the operands transposed as autograd passes them
  (:data:`calibration.microbench.bench_compute.GEMM_LAYOUTS`); same 2mnk FLOPs.
- Attention backward: ``scaled_dot_product_attention``'s gradient with respect to
  q, k and v (``torch.autograd.grad`` on a retained graph) for a third of the
  forward shapes (at least five), sized by twice the forward FLOPs (8·b·a·s²·d),
  as the cost model charges it.
- The reference kernel: one fixed GEMM timed at the start of a calibration and
  after each phase (and so in a re-measure), whose drift and repeat spread tell a
  busy machine (:mod:`calibration.microbench.busy_guard`).

Records use the kinds ``overhead``, ``gemm_layout`` and ``attention_bwd``; they
resume like every other compute measurement. The reference timings go to the
profile's provenance (``busy_guard``), not to the results file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from calibration.microbench.bench_compute import gemm_plan, gemm_runner, memory_job
from calibration.microbench.bench_jobs import Job, Runner, key_prefix, run_jobs
from calibration.microbench.bench_results import ResultsStore, progress
from calibration.microbench.bench_shapes import AttentionShape, attention_shapes, spread_by_size
from calibration.microbench.bench_timing import (
    Budget,
    Device,
    random_tensor,
    rotation_count,
    time_calls,
    torch_dtype,
)

OVERHEAD_KERNELS = ("add", "copy")
OVERHEAD_ELEMENTS = tuple(4**i for i in range(8))  # 1 .. 16384 elements
#: The reference GEMM (m = n = k) per device kind: ~1-5 ms on one CPU thread, ~0.1 ms
#: on a data-centre GPU.
REFERENCE_GEMM = {"cpu": 256, "cuda": 4096}


def run_overhead(device: Device, dtype: str, budget: Budget, store: ResultsStore) -> None:
    # a tiny kernel takes microseconds: a quarter of the usual time still buys its repeats
    budget = dataclasses.replace(budget, target_s=budget.target_s / 4)
    jobs = []
    for kernel in OVERHEAD_KERNELS:
        for numel in OVERHEAD_ELEMENTS:
            job = memory_job(device, dtype, budget, kernel, 1, numel, kind="overhead")
            jobs.append(Job(job.key, job.kind, job.label, job.size, f"overhead {kernel}",
                            job.meta, job.runner))
    run_jobs("overhead", jobs, store, budget, "bytes")


def run_gemm_layouts(device: Device, dtype: str, budget: Budget, store: ResultsStore) -> None:
    plan = gemm_plan(budget, device)
    shapes = spread_by_size(plan, max(6, len(plan) // 8), lambda s: s.flops)
    prefix = key_prefix(device, dtype)
    jobs = [Job(f"{prefix}/gemm_{layout}/{s.label}", "gemm_layout", f"{layout} {s.label} {dtype}",
                s.flops, f"gemm_{layout}",
                {"dtype": dtype, "device": device.kind, "threads": device.threads,
                 "layout": layout, "cost_class": f"gemm_{layout}", "m": s.m, "n": s.n, "k": s.k,
                 "flops": s.flops, "source": s.source},
                gemm_runner(device, budget, dtype, s, layout))
            for layout in ("dgrad", "wgrad") for s in shapes]
    run_jobs("gemm layouts", jobs, store, budget, "flops")


def run_attention_bwd(device: Device, dtype: str, budget: Budget, store: ResultsStore) -> None:
    all_shapes = attention_shapes(budget, device.kind)
    shapes = spread_by_size(all_shapes, max(5, len(all_shapes) // 3), lambda s: s.flops)
    prefix = key_prefix(device, dtype)
    jobs = [Job(f"{prefix}/attention_bwd/{s.label}", "attention_bwd", f"bwd {s.label} {dtype}",
                2 * s.flops, "attention_bwd",
                {"dtype": dtype, "device": device.kind, "threads": device.threads,
                 "cost_class": "attention_bwd", "batch": s.batch, "heads": s.heads,
                 "seq": s.seq, "head_dim": s.head_dim, "flops": 2 * s.flops, "causal": True,
                 "source": s.source},
                _attention_bwd_runner(device, budget, dtype, s))
            for s in shapes]
    run_jobs("attention backward", jobs, store, budget, "flops")


def _attention_bwd_runner(device: Device, budget: Budget, dtype: str,
                          s: AttentionShape) -> Runner:
    def run() -> tuple[float, dict[str, Any]]:
        import torch
        import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention

        dt = torch_dtype(dtype)
        shape = (s.batch, s.heads, s.seq, s.head_dim)
        elt = torch.tensor([], dtype=dt).element_size()
        # q, k, v, out, its gradient, three input gradients, and (math backend) the s×s
        # probabilities the graph keeps
        per_set = (8 * s.batch * s.heads * s.seq * s.head_dim
                   + 2 * s.batch * s.heads * s.seq * s.seq) * elt
        nbuf = rotation_count(device, per_set, 0.25 * device.free_bytes())
        graphs = []
        for _ in range(nbuf):
            q, k, v = (random_tensor(shape, dt, device.torch_device).requires_grad_(True)
                       for _ in range(3))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            graphs.append((out, (q, k, v), random_tensor(shape, dt, device.torch_device)))

        def call(i: int) -> object:
            out, inputs, grad = graphs[i]
            return torch.autograd.grad(out, inputs, grad, retain_graph=True)

        t = time_calls(device, call, nbuf, budget.target_s, budget.min_reps, budget.max_reps,
                       budget.min_batch_s)
        return t.time_s, {"reps": t.reps, "calls": t.calls_per_rep, "spread": round(t.spread, 4)}
    return run


def time_reference(device: Device, dtype: str, budget: Budget, phase: str) -> dict[str, Any]:
    """Time the reference GEMM now (``phase``: start, end, ...). Not a measurement to fit,
    so it stays out of the results file: a resumed run judges its own stretch of time."""
    from calibration.microbench.bench_shapes import GemmShape

    size = REFERENCE_GEMM[device.kind]
    shape = GemmShape(size, size, size, "reference")
    target = min(max(4 * budget.target_s, 0.2), 1.0)
    ref_budget = dataclasses.replace(budget, target_s=target, min_reps=max(budget.min_reps, 9))
    time_s, extra = gemm_runner(device, ref_budget, dtype, shape)()
    progress("reference", 1, 1, f"{phase}: {size}x{size}x{size} {dtype} {time_s * 1e3:.3f} ms, "
             f"repeat spread {extra['spread']:.1%}")
    return {"kind": "reference", "phase": phase, "time_s": time_s, "flops": shape.flops,
            "dtype": dtype, **extra}
