"""The eager framework's host cost per kernel (``gpu.host_overhead_us``).

``clustersim validation --device cpu`` measures it right after calibrating and adds it
to the profile (:func:`add_to_profile`); ``clustersim host-cost PROFILE --device cuda``
does the same for a GPU's host (on a GPU the degenerate step's kernels run beside the
host, whose time alone sets the step). It runs the measured runs' own model code, which
the kernel microbenchmarks (``calibration/microbench``) never import.

On a CPU the thread that runs a kernel also runs everything PyTorch eager does around
it: the Python module calls, the dispatcher, autograd's graph recording and backward
engine, the for-loop optimizer's Python. None of that is in the bare-kernel timings
(``kernel_overhead_us`` is the intercept of a tight loop of one op), and none of it
overlaps the kernels, as a GPU's host would.

The measurement: training steps (forward and backward of each micro-batch, then AdamW)
of the measured GPT (:mod:`calibration.measured.gpt`) at a degenerate size, width 8 and
2 tokens, where every kernel is a few microseconds, each timed as the minimum over
repeats, at one micro-batch and at ``MICRO_BATCHES`` (in turn in each repeat). The
difference is what the extra micro-batches' kernels cost, the rest of the one-micro-batch
step what the optimizer's cost, each divided by the kernels the simulator's inventory
counts for that part under the ``pytorch-eager`` stack (:mod:`simulator.model.inventory`;
the counts and the split: :mod:`calibration.measured.host_counts`), less the bare
per-kernel overhead:
``host_overhead_us`` for a layer's, the head's and the embedding's kernels,
``host_optimizer_us`` for the optimizer's. They differ: the for-loop AdamW's kernels
are small elementwise ops with no autograd around them (here ~3 µs per kernel against
~5 µs in the micro-batches; one figure for both, as before, priced a four-micro-batch
step's forward and backward at the optimizer-heavy average of a one-micro-batch step).
The model is the measured runs' own code, not a fit to their step times: what is
measured are per-kernel constants at a size where the step is nothing else.

DTensor's share (``gpu.dtensor_gemm_us``, ``gpu.dtensor_overhead_us``): the same steps
with the measured runs' TP plan (:func:`calibration.measured.parallel_worker.apply_tp`,
with sequence parallelism, so every kind of DTensor op is there) on a one-rank mesh,
less the plain steps. A GEMM on DTensors carries a matmul's sharding propagation and
the views and transposes around it; an elementwise, norm or optimizer op on DTensors
much less. The two steps' extra times give the two per-op figures
(``split_gemm``: the one-micro-batch step is optimizer-heavy, the later
micro-batches GEMM-heavy), divided among the ops the inventory marks as
DTensor-dispatched. Here ~140 µs per GEMM against ~11 µs per other op (one figure for
all, as before, read ~28 µs, the optimizer's many elementwise ops outweighing the
layers' GEMMs, so a tiny-gpt TP run with four micro-batches read ~40% short in compute).

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
from dataclasses import asdict
from typing import Any

from calibration.measured.host_counts import (
    BATCH,
    HOST_GPT,
    MICRO_BATCHES,
    split_gemm,
    split_per_op,
    step_counts,
)


def _step_seconds(tp: bool, threads: int, repeats: int, steps: int,
                  micro_batches: tuple[int, ...] = (1, MICRO_BATCHES),
                  device: str = "cpu") -> dict[int, float]:
    """Minimum seconds of one training step of the degenerate GPT (TP on a 1-rank mesh)
    with each of ``micro_batches`` micro-batches, timed in turn in every repeat (the
    machine's drift then moves both alike). On CUDA the step runs as the measured runs
    run it (one bf16 autocast region over the micro-batches, the optimizer outside it)
    and is timed between device synchronisations."""
    import torch

    from calibration.measured.gpt import GPT, GPTConfig, loss_fn, synthetic_batch
    from calibration.measured.worker_run import autocast_for

    torch.manual_seed(0)
    cfg = GPTConfig.from_dict(HOST_GPT)
    dev = torch.device(device)
    model = GPT(cfg).to(dev)
    autocast = autocast_for(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if tp:
        from torch.distributed.device_mesh import init_device_mesh

        from calibration.measured.parallel_worker import apply_tp

        apply_tp(model, init_device_mesh("cpu", (1,)), sequence_parallel=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = (t.to(dev) for t in synthetic_batch(cfg, BATCH, 0))

    def step(m: int) -> None:
        with autocast():
            for _ in range(m):
                loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for m in micro_batches:
        for _ in range(3):
            step(m)
    best = {m: float("inf") for m in micro_batches}
    for _ in range(repeats):
        for m in micro_batches:
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(m)
            sync()
            best[m] = min(best[m], (time.perf_counter() - t0) / steps)
    return best


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


def measure_dtensor_us(threads: int, plain_s: dict[int, float], repeats: int = 9,
                       steps: int = 3) -> dict[str, Any] | None:
    """Host microseconds DTensor adds per op it dispatches in the micro-batches and in the
    optimizer step, and per functional collective (``torch.distributed.
    _functional_collectives``, what its redistributions issue) beyond a plain ``dist``
    collective; None when this process already has a process group (a one-rank gloo
    group is made and torn down here)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tp_s = _step_seconds(True, threads, repeats, steps, tuple(plain_s))
        funcol_us = _funcol_us()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(before)
    extra = {m: max(tp_s[m] - plain_s[m], 0.0) for m in plain_s}
    per_gemm, per_op = split_gemm(extra[1], extra[MICRO_BATCHES], MICRO_BATCHES,
                                  step_counts(dtensor=True))
    return {"dtensor_overhead_us": round(per_op * 1e6, 3),
            "dtensor_gemm_us": round(per_gemm * 1e6, 3),
            "funcol_overhead_us": funcol_us,
            "dtensor_step_s_min": {str(m): t for m, t in tp_s.items()}}


def measure_host_us(threads: int, kernel_overhead_us: float, repeats: int = 9,
                    steps: int = 10, device: str = "cpu") -> dict[str, Any]:
    """Host microseconds per kernel of eager PyTorch in the micro-batches and in the
    optimizer step, and (on a CPU) DTensor's extra per op it dispatches (see the module
    note). On a CPU the kernels run on the same thread, so their bare overhead
    (``kernel_overhead_us``) comes off; on a GPU the degenerate step's kernels run
    beside the host, which alone sets its time: the figure is the host's whole."""
    import torch

    from calibration.host import keep_freed_memory

    if device == "cpu":
        keep_freed_memory()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain_s = _step_seconds(False, threads, repeats, steps, device=device)
    finally:
        torch.set_num_threads(before)
    counts = step_counts(device=device)
    per_kernel, per_opt_kernel = split_per_op(plain_s[1], plain_s[MICRO_BATCHES],
                                              MICRO_BATCHES, counts)
    # DTensor on a one-rank gloo mesh: the CPU runs' TP and FSDP2 (none on one GPU)
    dt = (measure_dtensor_us(threads, plain_s) if device == "cpu" else None) or {}
    off = kernel_overhead_us if device == "cpu" else 0.0
    return {"host_overhead_us": round(max(per_kernel * 1e6 - off, 0.0), 3),
            "host_optimizer_us": round(max(per_opt_kernel * 1e6 - off, 0.0), 3),
            "dtensor_overhead_us": dt.get("dtensor_overhead_us"),
            "dtensor_gemm_us": dt.get("dtensor_gemm_us"),
            "funcol_overhead_us": dt.get("funcol_overhead_us"),
            "micro_batches": [1, MICRO_BATCHES],
            "step_s_min": {str(m): t for m, t in plain_s.items()},
            "dtensor_step_s_min": dt.get("dtensor_step_s_min"),
            "device": device, "kernels": asdict(counts),
            "dtensor_ops": asdict(step_counts(dtensor=True, device=device))}


def add_to_profile(path: str, threads: int, device: str = "cpu") -> dict[str, Any]:
    """Measure and write ``gpu.host_serial``, ``host_overhead_us``,
    ``host_optimizer_us``, ``dtensor_overhead_us``, ``dtensor_gemm_us`` and
    ``funcol_overhead_us`` into the profile at ``path`` (atomically, validated). On CUDA
    the host runs beside the GPU (``host_serial`` false) and the DTensor terms are not
    measured."""
    from pathlib import Path

    import yaml

    from calibration.microbench.profile_build import write_profile

    profile = yaml.safe_load(Path(path).read_text())
    gpu = profile["gpu"]
    host = measure_host_us(threads, float(gpu.get("kernel_overhead_us", 0.0)), device=device)
    gpu["host_serial"] = device == "cpu"
    gpu["host_overhead_us"] = host["host_overhead_us"]
    gpu["host_optimizer_us"] = host["host_optimizer_us"]
    for key in ("dtensor_overhead_us", "dtensor_gemm_us"):
        if host[key] is not None:
            gpu[key] = host[key]
    if host["funcol_overhead_us"] is not None:
        gpu["funcol_overhead_us"] = host["funcol_overhead_us"]
    profile.setdefault("provenance", {})["host_overhead"] = host
    write_profile(profile, Path(path))
    return host


def refit_profile(path: str) -> dict[str, Any]:
    """Re-derive a profile's ``host_overhead_us`` and ``host_optimizer_us`` from the step
    times its provenance recorded, divided by the kernels the inventory counts today: a
    change to the inventory (a new op, a new count) changes the per-kernel figure that
    the same measurement implies, without measuring again."""
    from pathlib import Path

    import yaml

    from calibration.microbench.profile_build import write_profile
    from simulator.errors import Problem, UserError

    profile = yaml.safe_load(Path(path).read_text())
    host = (profile.get("provenance") or {}).get("host_overhead") or {}
    times = host.get("step_s_min") or {}
    if "1" not in times or str(MICRO_BATCHES) not in times:
        raise UserError([Problem("PROFILE", path, "records no host-cost step times; measure "
                                 "them with `clustersim host-cost PROFILE`")])
    device = str(host.get("device") or ("cpu" if profile["gpu"].get("host_serial") else "cuda"))
    counts = step_counts(device=device)
    x, y = split_per_op(times["1"], times[str(MICRO_BATCHES)], MICRO_BATCHES, counts)
    off = float(profile["gpu"].get("kernel_overhead_us", 0.0)) if device == "cpu" else 0.0
    gpu = profile["gpu"]
    gpu["host_overhead_us"] = host["host_overhead_us"] = round(max(x * 1e6 - off, 0.0), 3)
    gpu["host_optimizer_us"] = host["host_optimizer_us"] = round(max(y * 1e6 - off, 0.0), 3)
    host.update(device=device, kernels=asdict(counts), refit=time.strftime("%Y-%m-%d"))
    write_profile(profile, Path(path))
    return host


def add_parser(subparsers: Any) -> None:
    """Register ``host-cost`` on the CLI's subparsers."""
    import argparse

    p = subparsers.add_parser(
        "host-cost", help="time eager PyTorch's host cost per kernel (the measured GPT at a "
        "degenerate size) and write it into a profile",
        description="Time training steps of the measured runs' GPT at a degenerate size "
        "(width 8, 2 tokens: every kernel tiny, the step the host's alone) at 1 and 4 "
        "micro-batches, and write gpu.host_overhead_us and gpu.host_optimizer_us (on a CPU "
        "also host_serial and DTensor's terms) into PROFILE. `clustersim validation` does "
        "this itself on a CPU.",
        epilog="example:\n  clustersim calibrate --device cuda --quick --out h200.yaml\n"
        "  clustersim host-cost h200.yaml --device cuda",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", metavar="PROFILE.yaml", help="the profile to add the terms to")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                   help="where the GPT runs (default cuda)")
    p.add_argument("--threads", type=int, default=1, metavar="T",
                   help="torch threads (default 1, as the measured runs)")
    p.add_argument("--refit", action="store_true",
                   help="measure nothing: re-derive the terms from the step times the "
                   "profile recorded, with the kernels the inventory counts now")
    p.set_defaults(func=_cli_main)


def _cli_main(args: Any) -> int:
    from pathlib import Path

    from simulator.errors import Problem, UserError

    path = Path(args.profile)
    if not path.is_file():
        raise UserError([Problem("PROFILE", args.profile, "no such file; write one with "
                                 "`clustersim calibrate --out PROFILE.yaml`")])
    if args.threads < 1:
        raise UserError([Problem("--threads", args.threads, "use 1 or more")])
    if args.refit:
        host = refit_profile(str(path))
        print(f"host: {host['host_overhead_us']:.1f} us per kernel, "
              f"{host['host_optimizer_us']:.1f} us per optimizer host unit, re-derived "
              f"({host['device']}) -> {path}")
        return 0
    from calibration.host import require_torch

    torch = require_torch()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError([Problem("--device", "cuda", "PyTorch sees no CUDA GPU here; use "
                                 "--device cpu")])
    host = add_to_profile(str(path), args.threads, args.device)
    steps = " and ".join(f"{t * 1e3:.2f} ms at {m}" for m, t in host["step_s_min"].items())
    print(f"host: {host['host_overhead_us']:.1f} us per kernel, "
          f"{host['host_optimizer_us']:.1f} us per optimizer host unit (steps of {steps} "
          f"micro-batches) -> {path}")
    return 0
