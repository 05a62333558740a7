"""Compute microbenchmarks: GEMM, attention and memory-bound kernels on one device.

Each benchmark is a list of jobs (key, size, runner), each runner timing its kernel
with :func:`calibration.microbench.bench_timing.time_calls`, walked (resumed, rechecked,
re-measured on a busy machine) by :mod:`calibration.microbench.bench_jobs`.

What each record's size means — the cost model's size axis:

- GEMM and attention: FLOPs (2mnk; 4·b·a·s²·d forward, causal not discounted).
- memory-bound kernels: logical bytes moved, reading inputs and writing outputs
  once (norms, softmax, GELU, copy: 2N elements; the cross-entropy over vocabulary-wide
  fp32 rows: the logits read, the log-probabilities written, 2N; SwiGLU silu(g)·u, add and mul:
  3N; a sum over the last dimension: N, its output a row per 1/hidden of that;
  AdamW: parameter, gradient and two moments read, three written, 7 fp32 words
  per parameter). Each kernel belongs to one cost class (:data:`KERNEL_CLASS`),
  whose own curve calibration fits beside the shared one. The backward GEMM
  layouts and attention backward are timed in :mod:`calibration.microbench.bench_terms`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from calibration.microbench.bench_jobs import Job, Runner, key_prefix, run_jobs
from calibration.microbench.bench_results import ResultsStore
from calibration.microbench.bench_shapes import (
    AttentionShape,
    GemmShape,
    attention_shapes,
    grid_gemm_shapes,
    model_gemm_shapes,
    spread_by_size,
)
from calibration.microbench.bench_timing import (
    Budget,
    Device,
    random_tensor,
    rotation_count,
    time_calls,
    torch_dtype,
)

MEMORY_KERNELS = ("layer_norm", "rms_norm", "softmax", "cross_entropy", "gelu", "swiglu", "add",
                  "mul", "sum", "copy", "adamw")
# logical bytes per output element, in units of the element size (adamw: fp32 words)
_MEM_WORDS = {"layer_norm": 2, "rms_norm": 2, "softmax": 2, "cross_entropy": 2, "gelu": 2,
              "swiglu": 3, "add": 3,
              "mul": 3, "sum": 1, "copy": 2, "adamw": 7}
#: The op inventory's cost class of each memory-bound kernel timed.
KERNEL_CLASS = {"layer_norm": "norm", "rms_norm": "norm", "softmax": "softmax",
                "cross_entropy": "cross_entropy",
                "gelu": "elementwise", "swiglu": "elementwise", "add": "elementwise",
                "mul": "elementwise", "sum": "reduction", "copy": "copy", "adamw": "optimizer"}
#: kernels timed in fp32 whatever the calibrated dtype: AdamW's states, and the loss, which
#: runs on fp32 logits (the measured runs' ``loss_fn``; Megatron's fp32 cross-entropy)
FP32_KERNELS = ("adamw", "cross_entropy")


# ---------------------------------------------------------------- GEMM


def gemm_plan(budget: Budget, device: Device) -> list[GemmShape]:
    return sorted(model_gemm_shapes(budget, device.kind) + grid_gemm_shapes(budget),
                  key=lambda s: (s.flops, s.m, s.n, s.k))


def gemm_jobs(device: Device, dtype: str, budget: Budget, shapes: list[GemmShape]) -> list[Job]:
    prefix = key_prefix(device, dtype)
    return [Job(f"{prefix}/gemm/{s.label}", "gemm", f"{s.label} {dtype}", s.flops, "gemm",
                {"dtype": dtype, "device": device.kind, "threads": device.threads, "m": s.m,
                 "n": s.n, "k": s.k, "flops": s.flops, "source": s.source},
                gemm_runner(device, budget, dtype, s)) for s in shapes]


#: The three GEMMs of a linear layer Y[m, n] = X[m, k] · W[k, n], as (A, B, C) shapes
#: and whether A and B are used transposed: forward, the input gradient
#: dX = dY · Wᵀ and the weight gradient dW = Xᵀ · dY (2mnk FLOPs each).
GEMM_LAYOUTS = {"fwd": ("mk", "kn", "mn", False, False), "dgrad": ("mn", "kn", "mk", False, True),
                "wgrad": ("mk", "mn", "kn", True, False)}


def gemm_call(device: Device, dtype: str, shape: GemmShape, layout: str,
              nbuf: int) -> Callable[[int], object]:
    """``call(i)``: the GEMM of ``layout`` on the i-th of ``nbuf`` input and output sets.

    The outputs are written once here, before any timing. ``torch.empty`` maps pages
    without touching them, and the timed repeats (5-25 of them) do not get round all
    32 sets, so every timed call used to write a never-touched output and pay its page
    faults: on this project's VM 512x512x512 read 4.8 ms against 1.4 ms into a written
    buffer, a third of the peak, while a training step's outputs land in memory the
    allocator already holds (:func:`calibration.host.keep_freed_memory`).
    """
    import torch

    dim = {"m": shape.m, "n": shape.n, "k": shape.k}
    sa, sb, sc, ta, tb = GEMM_LAYOUTS[layout]
    dt = torch_dtype(dtype)
    dev = device.torch_device
    a = [random_tensor((dim[sa[0]], dim[sa[1]]), dt, dev) for _ in range(nbuf)]
    b = [random_tensor((dim[sb[0]], dim[sb[1]]), dt, dev) for _ in range(nbuf)]
    c = [torch.zeros((dim[sc[0]], dim[sc[1]]), dtype=dt, device=dev) for _ in range(nbuf)]
    return lambda i: torch.mm(a[i].t() if ta else a[i], b[i].t() if tb else b[i], out=c[i])


def gemm_runner(device: Device, budget: Budget, dtype: str, shape: GemmShape,
                 layout: str = "fwd") -> Runner:
    def run() -> tuple[float, dict[str, Any]]:
        import torch

        elt = torch.tensor([], dtype=torch_dtype(dtype)).element_size()
        per_set = (shape.m * shape.k + shape.k * shape.n + shape.m * shape.n) * elt
        nbuf = rotation_count(device, per_set, 0.25 * device.free_bytes())
        call = gemm_call(device, dtype, shape, layout, nbuf)
        t = time_calls(device, call, nbuf, budget.target_s, budget.min_reps, budget.max_reps,
                       budget.min_batch_s)
        return t.time_s, {"reps": t.reps, "calls": t.calls_per_rep, "spread": round(t.spread, 4),
                          "buffers": nbuf}
    return run


def run_gemm(device: Device, dtype: str, budget: Budget, store: ResultsStore,
             shapes: list[GemmShape] | None = None, stage: str = "gemm") -> None:
    shapes = gemm_plan(budget, device) if shapes is None else shapes
    run_jobs(stage, gemm_jobs(device, dtype, budget, shapes), store, budget, "flops")


def probe_shapes(budget: Budget, device: Device) -> list[GemmShape]:
    """A few GEMMs timed in the other dtypes to scale their peaks.

    Large ones on a GPU (where the peak is reached); mid-sized ones (~3e7 FLOPs)
    on a CPU, where a dtype without native kernels (fp16) runs at ~1 GFLOP/s.
    """
    plan = gemm_plan(budget, device)
    if device.kind == "cuda":
        big = [s for s in plan if s.flops >= 0.1 * plan[-1].flops]
        return spread_by_size(big, 3, lambda s: s.flops)
    near = sorted(plan, key=lambda s: abs(math.log10(s.flops) - math.log10(3e7)))[:2]
    return sorted(near, key=lambda s: s.flops)


# ---------------------------------------------------------------- attention


def run_attention(device: Device, dtype: str, budget: Budget, store: ResultsStore) -> None:
    prefix = key_prefix(device, dtype)
    jobs = [Job(f"{prefix}/attention/{s.label}", "attention", f"{s.label} {dtype}", s.flops,
                "attention",
                {"dtype": dtype, "device": device.kind, "threads": device.threads,
                 "batch": s.batch, "heads": s.heads, "seq": s.seq, "head_dim": s.head_dim,
                 "flops": s.flops, "causal": True, "source": s.source},
                _attention_runner(device, budget, dtype, s))
            for s in attention_shapes(budget, device.kind)]
    run_jobs("attention", jobs, store, budget, "flops")


def _attention_runner(device: Device, budget: Budget, dtype: str, s: AttentionShape) -> Runner:
    def run() -> tuple[float, dict[str, Any]]:
        import torch
        import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention

        dt = torch_dtype(dtype)
        shape = (s.batch, s.heads, s.seq, s.head_dim)
        elt = torch.tensor([], dtype=dt).element_size()
        per_set = 4 * s.batch * s.heads * s.seq * s.head_dim * elt
        nbuf = rotation_count(device, per_set, 0.25 * device.free_bytes())
        qkv = [[random_tensor(shape, dt, device.torch_device) for _ in range(3)]
               for _ in range(nbuf)]

        def call(i: int) -> object:
            q, k, v = qkv[i]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        with torch.no_grad():
            t = time_calls(device, call, nbuf, budget.target_s, budget.min_reps, budget.max_reps,
                           budget.min_batch_s)
        return t.time_s, {"reps": t.reps, "calls": t.calls_per_rep, "spread": round(t.spread, 4)}
    return run


# ---------------------------------------------------------------- memory-bound


#: a vocabulary's width for the cross-entropy's rows (GPT-2's 50,257 and Llama's 32,000
#: on a GPU; the measured CPU runs' 4,096), a model's hidden size for the other kernels
VOCAB_WIDTH = {"cuda": 32768, "cpu": 4096}
HIDDEN_WIDTH = {"cuda": 4096, "cpu": 1024}


def memory_plan(budget: Budget, device: Device) -> list[tuple[str, int, int]]:
    """(kernel, rows, hidden) with logical bytes spread from ~64 KB to the budget's cap."""
    lo, hi = math.log10(64e3), math.log10(budget.max_memory_bytes)
    plan: list[tuple[str, int, int]] = []
    for kernel in MEMORY_KERNELS:
        hidden = (VOCAB_WIDTH if kernel == "cross_entropy" else HIDDEN_WIDTH)[device.kind]
        for j in range(budget.memory_sizes):
            target = 10 ** (lo + (hi - lo) * j / max(budget.memory_sizes - 1, 1))
            numel = target / (_MEM_WORDS[kernel] * 4)  # sized as if fp32
            shape = (kernel, max(1, round(numel / hidden)), hidden)
            if shape not in plan:  # wide rows: the smallest targets are all one row
                plan.append(shape)
    return plan


def memory_job(device: Device, dtype: str, budget: Budget, kernel: str, rows: int,
               hidden: int, kind: str = "memory") -> Job:
    """One memory-bound kernel of ``rows`` × ``hidden`` elements, sized by bytes moved."""
    dt_bytes = 4 if kernel in FP32_KERNELS or dtype == "fp32" else 2
    nbytes = float(_MEM_WORDS[kernel] * rows * hidden * dt_bytes)
    return Job(f"{key_prefix(device, dtype)}/{kind}/{kernel}/{rows}x{hidden}", kind,
               f"{kernel} {rows}x{hidden} {dtype}", nbytes, kernel,
               {"dtype": dtype, "device": device.kind, "threads": device.threads,
                "kernel": kernel, "cost_class": KERNEL_CLASS[kernel], "rows": rows,
                "hidden": hidden, "bytes": nbytes},
               _memory_runner(device, budget, dtype, kernel, rows, hidden))


def run_memory(device: Device, dtype: str, budget: Budget, store: ResultsStore) -> None:
    jobs = [memory_job(device, dtype, budget, kernel, rows, hidden)
            for kernel, rows, hidden in memory_plan(budget, device)]
    run_jobs("memory", jobs, store, budget, "bytes")


def _memory_runner(device: Device, budget: Budget, dtype: str, kernel: str, rows: int,
                   hidden: int) -> Runner:
    def run() -> tuple[float, dict[str, Any]]:
        import torch

        dt = torch.float32 if kernel in FP32_KERNELS else torch_dtype(dtype)
        nbytes = _MEM_WORDS[kernel] * rows * hidden * torch.tensor([], dtype=dt).element_size()
        nbuf = rotation_count(device, nbytes, 0.25 * device.free_bytes())
        call = _memory_kernel(kernel, (rows, hidden), dt, device.torch_device, nbuf)
        with torch.no_grad():
            t = time_calls(device, call, nbuf, budget.target_s, budget.min_reps, budget.max_reps,
                           budget.min_batch_s)
        return t.time_s, {"reps": t.reps, "calls": t.calls_per_rep, "spread": round(t.spread, 4),
                          "buffers": nbuf}
    return run


def _memory_kernel(kernel: str, shape: tuple[int, int], dt: Any, dev: str,
                   nbuf: int) -> Callable[[int], object]:
    import torch
    import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention

    h = shape[1]
    xs = [random_tensor(shape, dt, dev) for _ in range(nbuf)]
    w, b = random_tensor((h,), dt, dev), random_tensor((h,), dt, dev)
    if kernel == "layer_norm":
        return lambda i: F.layer_norm(xs[i], (h,), w, b)
    if kernel == "rms_norm":
        return lambda i: F.rms_norm(xs[i], (h,), w)
    if kernel == "softmax":
        return lambda i: torch.softmax(xs[i], dim=-1)
    if kernel == "cross_entropy":  # log_softmax + nll_loss over fp32 logits, as the loss
        ts = [torch.randint(0, h, (shape[0],), device=dev) for _ in range(nbuf)]
        return lambda i: F.cross_entropy(xs[i], ts[i])
    if kernel == "gelu":
        return lambda i: F.gelu(xs[i])
    if kernel == "sum":
        return lambda i: xs[i].sum(dim=-1)
    ys = [random_tensor(shape, dt, dev) for _ in range(nbuf)]
    if kernel == "swiglu":
        return lambda i: F.silu(xs[i]) * ys[i]
    if kernel == "add":
        return lambda i: torch.add(xs[i], ys[i])
    if kernel == "mul":
        return lambda i: torch.mul(xs[i], ys[i])
    if kernel == "copy":
        return lambda i: ys[i].copy_(xs[i])
    if kernel == "adamw":
        return _adamw_step(xs, ys, dev)
    raise ValueError(f"unknown memory kernel {kernel}")


def _adamw_step(params: list[Any], grads: list[Any], dev: str) -> Callable[[int], object]:
    import torch

    opts = []
    for p, g in zip(params, grads, strict=True):
        p.requires_grad_(True)
        p.grad = g
        fused = True if dev.startswith("cuda") else None
        opts.append(torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=fused))
    return lambda i: opts[i].step()
