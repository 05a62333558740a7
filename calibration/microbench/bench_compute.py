"""Compute microbenchmarks: GEMM, attention and memory-bound kernels on one device.

Each benchmark is a list of jobs (key, size, runner). The walk skips keys the
results file already holds (a resumed run), times each kernel with
:func:`calibration.microbench.bench_timing.time_calls` and appends the record at once. An
exception (out of memory, an unsupported dtype, an injected failure) becomes a
failure record and the walk goes on.

Recheck passes. On a shared machine another process can take the core for
seconds, and every kernel timed in that window reads slow. After the walk, each
point whose rate (FLOP/s or bytes/s) is more than 15% below the median of its
neighbours by size (two on each side; the same kernel for memory-bound ones) is
timed again, later, in a second and third pass; the fitter keeps each key's fastest reading
(interference only ever adds time, and a genuinely slow shape stays slow). A
marker record per finished pass lets a resumed run skip it.

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

A busy-machine re-measure (``Budget.retry`` > 0) times every job again, whatever
the results already hold; the fitter keeps each key's fastest reading.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from calibration.microbench.bench_results import (
    ResultsStore,
    check_injected_failure,
    failure_record,
    progress,
)
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
RECHECK_SLOWER_THAN = 1.15
Runner = Callable[[], tuple[float, dict[str, Any]]]


@dataclass(frozen=True)
class Job:
    key: str
    kind: str  # gemm | attention | memory
    label: str
    size: float  # FLOPs or bytes
    group: str  # points expected on one smooth curve (the kernel, for memory-bound ones)
    meta: dict[str, Any]
    runner: Runner


def key_prefix(device: Device, dtype: str) -> str:
    return f"{device.kind}/{dtype}/t{device.threads}"


def run_jobs(stage: str, jobs: list[Job], store: ResultsStore, budget: Budget,
             unit: str) -> None:
    """Measure every job not yet in the results, then the recheck passes; on a
    busy-machine retry, every job once more."""
    done = store.done()
    if budget.retry:
        _retry(stage, jobs, store, unit, budget.retry, done)
        return
    for i, job in enumerate(jobs, 1):
        if job.key in done:
            progress(stage, i, len(jobs), f"{job.label}: already in results, skipped")
            continue
        _measure(stage, i, len(jobs), job, store, unit, 0)
    for p in range(1, budget.recheck_passes + 1):
        if not jobs:
            break
        m = jobs[0].meta
        marker = f"{m['device']}/{m['dtype']}/t{m['threads']}/{stage}#recheck{p}"
        if marker in done:
            continue
        slow = _slow_jobs(jobs, best_times(store.records()))
        for i, job in enumerate(slow, 1):
            _measure(f"{stage} recheck {p}", i, len(slow), job, store, unit, p)
        store.append({"key": marker, "kind": "pass", "ok": True, "rechecked": len(slow)})


def _retry(stage: str, jobs: list[Job], store: ResultsStore, unit: str, attempt: int,
           done: set[str]) -> None:
    """Re-time every job (a marker per finished attempt lets a resumed run skip it)."""
    if not jobs:
        return
    m = jobs[0].meta
    marker = f"{m['device']}/{m['dtype']}/t{m['threads']}/{stage}#retry{attempt}"
    if marker in done:
        return
    for i, job in enumerate(jobs, 1):
        _measure(f"{stage} retry {attempt}", i, len(jobs), job, store, unit, f"retry{attempt}")
    store.append({"key": marker, "kind": "pass", "ok": True, "retried": len(jobs)})


def _measure(stage: str, i: int, total: int, job: Job, store: ResultsStore, unit: str,
             recheck: int | str) -> None:
    try:
        check_injected_failure(job.key)
        time_s, extra = job.runner()
    except Exception as exc:  # OOM, unsupported kernel/dtype, injected: record, skip
        rec = failure_record(job.key, job.kind, exc, **job.meta)
        store.append(rec)
        progress(stage, i, total, f"{job.label}: FAILED ({rec['error']})")
        _free_cache()
        return
    store.append({"key": job.key, "kind": job.kind, "ok": True, "time_s": time_s,
                  "pass": recheck, **job.meta, **extra})
    rate = job.size / time_s
    text = (f"{rate / 1e12:.4g} TFLOP/s" if unit == "flops" else f"{rate / 1e9:.3g} GB/s")
    progress(stage, i, total, f"{job.label}: {_fmt_time(time_s)}, {text}")


def _fmt_time(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def best_times(records: list[dict[str, Any]]) -> dict[str, float]:
    """Fastest successful reading per key (what the fitter uses)."""
    best: dict[str, float] = {}
    for r in records:
        if r.get("ok") and "time_s" in r:
            best[r["key"]] = min(best.get(r["key"], math.inf), float(r["time_s"]))
    return best


def _slow_jobs(jobs: list[Job], best: dict[str, float]) -> list[Job]:
    """Jobs >15% slower than their neighbours (two on each side by size, same group) suggest."""
    import statistics

    out: list[Job] = []
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        if job.key in best:
            groups.setdefault(job.group, []).append(job)
    for members in groups.values():
        members.sort(key=lambda j: j.size)
        rate = [j.size / best[j.key] for j in members]
        for i, job in enumerate(members):
            near = sorted(range(len(members)), key=lambda k: abs(k - i))[1:5]
            near = [k for k in near if abs(k - i) <= 2] or near[:2]
            if len(near) >= 2 and rate[i] * RECHECK_SLOWER_THAN < statistics.median(
                    rate[k] for k in near):
                out.append(job)
    return sorted(out, key=lambda j: j.size)


def _free_cache() -> None:
    with contextlib.suppress(Exception):  # best effort: freeing the cache is optional
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
