"""The eager framework's host cost per kernel on a CPU "device" (``gpu.host_overhead_us``).

``clustersim validation --device cpu`` measures it right after calibrating and adds it
to the profile (:func:`add_to_profile`): it runs the measured runs' own model code,
which the kernel microbenchmarks (``calibration/microbench``) never import.

On a CPU the thread that runs a kernel also runs everything PyTorch eager does around
it: the Python module calls, the dispatcher, autograd's graph recording and backward
engine, the for-loop optimizer's Python. None of that is in the bare-kernel timings
(``kernel_overhead_us`` is the intercept of a tight loop of one op), and none of it
overlaps the kernels, as a GPU's host would.

The measurement: one training step (forward, backward, AdamW) of the measured GPT
(:mod:`calibration.measured.gpt`) at a degenerate size, width 8 and 2 tokens, where
every kernel is a few microseconds, timed as the minimum over repeats; divided by the
kernels the simulator's inventory counts for that step under the ``pytorch-eager``
stack (:mod:`simulator.inventory`), less the bare per-kernel overhead. The model is
the measured runs' own code, not a fit to their step times: what is measured is a
per-kernel constant at a size where the step is nothing else.

DTensor's share (``gpu.dtensor_overhead_us``): the same step with the measured runs'
TP plan (:func:`calibration.measured.parallel_worker.apply_tp`, with sequence
parallelism, so every kind of DTensor op is there) on a one-rank mesh, less the plain
step, divided by the ops the inventory marks as DTensor-dispatched for that plan.

A functional collective's share (``gpu.funcol_overhead_us``): DTensor's redistributions
issue ``torch.distributed._functional_collectives`` (an ``AsyncCollectiveTensor``, its
work registered, ``wait_tensor`` on first use), which the collective benchmark's plain
``dist.all_reduce`` does not. On the same one-rank group: a functional all-reduce and its
wait against ``dist.all_reduce`` of 256 KiB, per call (~50 µs here; 110 µs at 1 MiB,
the functional all-reduce being out of place, a copy more; in a two-rank TP run the
profiler shows 0.3-0.5 ms per ``_c10d_functional::all_reduce`` on the main thread).
"""

from __future__ import annotations

import time
from typing import Any

#: the degenerate measured GPT: every kernel is tiny, the step is host cost
HOST_GPT = {"layers": 4, "hidden": 8, "heads": 1, "ffn_hidden": 8, "vocab": 8, "seq_len": 2}
BATCH = 1


def step_kernels(sizes: dict[str, int] = HOST_GPT, batch: int = BATCH,
                 dtensor: bool = False) -> int:
    """Kernels of one step of the measured GPT as the simulator counts them (the
    ``pytorch-eager`` stack, fp32, one micro-batch, grads set to None before it); with
    ``dtensor`` the ones it dispatches on DTensors under TP with sequence parallelism
    (counted at TP 2: which ops are DTensors does not depend on the mesh size)."""
    from simulator import model as mdl
    from simulator.inventory import dtensor_tensors, layer_tensors
    from simulator.scenario import ModelSpec
    from simulator.stack import load_stack

    stack = load_stack("pytorch-eager")
    spec = ModelSpec.model_validate({**sizes, "kv_heads": sizes["heads"], "activation": "gelu",
                                     "norm": "layernorm", "bias": True,
                                     "tied_embeddings": True, "position": "learned"})
    tp, sp = (2, True) if dtensor else (1, False)
    if dtensor:
        spec = spec.model_copy(update={"heads": 2, "kv_heads": 2})
    total = 0
    for pass_ in ("fwd", "bwd_input", "bwd_weight"):
        layer = mdl.layer_ops(spec, batch, tp, sp, "fp32", pass_, 0, stack)
        if dtensor:
            total += sum(op.dtensor for op in layer if op.name != "grad_accum") * spec.layers
            continue
        ops = (*layer * spec.layers,
               *mdl.embedding_ops(spec, batch, 1, False, "fp32", pass_, stack),
               *mdl.head_ops(spec, batch, 1, False, "fp32", pass_, stack))
        # the first micro-batch's grads are stolen by AccumulateGrad, not added
        total += sum(op.kernels for op in ops if op.name != "grad_accum")
    tensors = spec.layers * layer_tensors(spec, stack) + 4
    dtensors = spec.layers * dtensor_tensors(spec, stack, tp, sp)
    opt = mdl.optimizer_op(1.0, tensors, stack, "fp32", dtensors)
    return total + (opt.dtensor if dtensor else opt.kernels)


def _step_seconds(tp: bool, threads: int, repeats: int, steps: int) -> float:
    """Minimum seconds of one training step of the degenerate GPT (TP on a 1-rank mesh)."""
    import torch

    from calibration.measured.gpt import GPT, GPTConfig, loss_fn, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(**HOST_GPT)
    model = GPT(cfg)
    if tp:
        from torch.distributed.device_mesh import init_device_mesh

        from calibration.measured.parallel_worker import apply_tp

        apply_tp(model, init_device_mesh("cpu", (1,)), sequence_parallel=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(cfg, BATCH, 0)

    def step() -> None:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(5):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t0) / steps)
    return min(times)


def _funcol_us(repeats: int = 7, calls: int = 100) -> float:
    """Host microseconds a functional all-reduce and its wait take beyond
    ``dist.all_reduce`` on the current (one-rank) group, the minimum over repeats."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    x = torch.zeros(64 << 10)  # 256 KiB: tiny-gpt's TP activations per micro-batch

    def per_call(fn: Any) -> float:
        for _ in range(10):
            fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls)
        return best

    group = dist.group.WORLD
    assert group is not None  # the caller made the one-rank group
    plain = per_call(lambda: dist.all_reduce(x))
    functional = per_call(lambda: funcol.all_reduce(x, "sum", group).wait())
    return round(max(functional - plain, 0.0) * 1e6, 3)


def measure_dtensor_us(threads: int, plain_s: float, repeats: int = 5,
                       steps: int = 5) -> tuple[float | None, float | None]:
    """Host microseconds DTensor adds per op it dispatches, and per functional collective
    (``torch.distributed._functional_collectives``, what its redistributions issue) beyond
    a plain ``dist`` collective; None when this process already has a process group (a
    one-rank gloo group is made and torn down here)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return None, None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tp_s = _step_seconds(True, threads, repeats, steps)
        funcol_us = _funcol_us()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(before)
    return round(max(tp_s - plain_s, 0.0) / step_kernels(dtensor=True) * 1e6, 3), funcol_us


def measure_host_us(threads: int, kernel_overhead_us: float, repeats: int = 7,
                    steps: int = 20) -> dict[str, Any]:
    """Host microseconds per kernel of eager PyTorch on this CPU, and DTensor's extra per
    op it dispatches (see the module note)."""
    import torch

    from calibration.host import keep_freed_memory

    keep_freed_memory()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain_s = _step_seconds(False, threads, repeats, steps)
    finally:
        torch.set_num_threads(before)
    kernels = step_kernels()
    per_kernel = plain_s / kernels * 1e6
    dtensor_us, funcol_us = measure_dtensor_us(threads, plain_s)
    return {"host_overhead_us": round(max(per_kernel - kernel_overhead_us, 0.0), 3),
            "dtensor_overhead_us": dtensor_us, "funcol_overhead_us": funcol_us,
            "step_s_min": plain_s, "kernels": kernels,
            "dtensor_ops": step_kernels(dtensor=True)}


def add_to_profile(path: str, threads: int) -> dict[str, Any]:
    """Measure and write ``gpu.host_serial``, ``host_overhead_us`` and
    ``dtensor_overhead_us`` into the CPU profile at ``path`` (atomically, validated)."""
    from pathlib import Path

    import yaml

    from calibration.microbench.fit_profile import write_profile

    profile = yaml.safe_load(Path(path).read_text())
    gpu = profile["gpu"]
    host = measure_host_us(threads, float(gpu.get("kernel_overhead_us", 0.0)))
    gpu["host_serial"] = True
    gpu["host_overhead_us"] = host["host_overhead_us"]
    if host["dtensor_overhead_us"] is not None:
        gpu["dtensor_overhead_us"] = host["dtensor_overhead_us"]
    if host["funcol_overhead_us"] is not None:
        gpu["funcol_overhead_us"] = host["funcol_overhead_us"]
    profile.setdefault("provenance", {})["host_overhead"] = host
    write_profile(profile, Path(path))
    return host
