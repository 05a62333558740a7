"""How every measured worker times its steps and reports them: the timed steps, one
profiled step, peak memory, the bytes of the training state, and the summary rank 0
writes to ``measured.json``.

Measurement: ``warmup`` untimed steps, then ``steps`` steps, each started after a
device synchronisation (``torch.cuda.synchronize`` on CUDA) and ``dist.barrier()``
and timed with ``time.perf_counter`` to the rank's own end of the step (its device
synchronised); the step time of a step is the slowest rank's. The barrier is the
harness's, not training's, so it is not inside the time: a barrier after the
optimizer is a collective after compute, and on the project's 2-core VM it added
3-4 ms to a tiny-gpt DP 2 step of ~52 ms (52.3 and 52.6 ms without it, 55.3 and 56.6
ms with it, two runs each).  Then one more step runs under ``torch.profiler``; every
rank writes its Chrome trace and :mod:`calibration.measured.measure_trace` splits it
into compute and communication.  Peak memory is
``torch.cuda.max_memory_allocated`` on CUDA and, on CPU, the process's peak
resident set size (``ru_maxrss``), which includes the Python interpreter and
torch libraries.

A trainer is whatever runs one optimizer step when called (the dense
:class:`calibration.measured.parallel_worker.Trainer`, the MoE and CP workers' own),
with its ``optimizer``; :mod:`calibration.measured.worker_run` strings these together.
"""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from calibration.host import cpu_name, keep_freed_memory
from calibration.measured.measure_config import MeasureConfig


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # Linux reports ru_maxrss in KiB: whole-process peak RSS, not tensor bytes.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_reserved_bytes(device: torch.device) -> int | None:
    """The caching allocator's peak (``torch.cuda.max_memory_reserved``: what the process
    holds from the device, blocks and fragmentation included); None off CUDA."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def state_bytes(trainer: Any) -> int:
    """Bytes of this rank's parameters, gradients and AdamW states (local shards).

    Gradients are freed by ``zero_grad`` when this is read, so they are counted
    at the size of the parameters they belong to.
    """

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    total = 2 * sum(local_bytes(p) for p in params)
    for state in trainer.optimizer.state.values():
        total += sum(
            local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim()
        )
    return total


def timed_steps(
    trainer: Callable[[], Any], cfg: MeasureConfig, device: torch.device
) -> tuple[list[float], list[float] | None]:
    """Step times (this rank's, from the barrier that starts the step to its own end of
    it) and losses (ranks that see the loss) of the timed steps: ``cfg.steps`` of them,
    then more where they spanned less than ``cfg.min_seconds`` (:func:`more_steps`)."""
    for _ in range(cfg.warmup):
        trainer()
    times: list[float] = []
    losses = []

    def timed(count: int) -> None:
        for _ in range(count):
            sync(device)
            start = time.perf_counter()
            loss = trainer()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            losses.append(loss)

    timed(cfg.steps)
    if cfg.min_seconds > 0:
        # Every rank must run the same steps (they meet in collectives): the most asked.
        extra = torch.tensor([more_steps(times, cfg.min_seconds)], device=device)
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
        timed(int(extra.item()))
    sync(device)
    # Read losses only now: .item() inside the loop would add device syncs.
    if any(loss is None for loss in losses):
        return times, None
    return times, [float(loss) for loss in losses if loss is not None]


def more_steps(times: list[float], min_seconds: float) -> int:
    """Steps to add to ``times`` so that the timed steps span ``min_seconds`` at their
    median pace (0 where they already do). On the project's 2-core VM a run's level moves
    on a scale of seconds (tiny-gpt TP 2, six runs back to back: medians 373-496 ms, one
    run's steps about 510 ms for 8 s, then about 415 ms), so a few seconds of steps is
    one draw of that level; steps spanning tens of seconds average over more of it."""
    short = min_seconds - sum(times)
    return math.ceil(short / statistics.median(times)) if times and short > 0 else 0


def profile_one_step(trainer: Callable[[], Any], device: torch.device, path: Path) -> float:
    """Run one step under torch.profiler, write its Chrome trace; returns its wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        trainer()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    prof.export_chrome_trace(str(path))
    return elapsed


def summarize(
    cfg: MeasureConfig,
    device: torch.device,
    per_rank: list[dict[str, Any]],
    tied_diff: float | None,
) -> dict[str, Any]:
    """Everything rank 0 writes to ``measured.json``."""
    timed = len(per_rank[0]["step_times_s"])  # cfg.steps, or more (cfg.min_seconds)
    steps = [max(r["step_times_s"][i] for r in per_rank) for i in range(timed)]
    with_loss = [r["losses"] for r in per_rank if r["losses"] is not None]
    # Mean over the ranks holding the loss: replicas differ (own data), TP peers agree.
    losses = (
        [statistics.fmean(ls[i] for ls in with_loss) for i in range(timed)]
        if with_loss
        else None
    )
    slowest = max(per_rank, key=lambda r: r["compute_s"] + r["comm_s"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "step_time_s": statistics.median(steps),
        "step_times_s": steps,
        "losses": losses,
        "compute_s": slowest["compute_s"],
        "comm_s": slowest["comm_s"],
        "exposed_comm_s": slowest["exposed_comm_s"],
        "optimizer_s": slowest["optimizer_s"],
        "profiled_step_s": slowest["profiled_step_s"],
        "breakdown_rank": slowest["rank"],
        "breakdown_method": (
            "one profiled step per rank (torch.profiler), reported for the rank with the most "
            "compute+comm; see calibration/measured/measure_trace.py for what counts as "
            "communication"
        ),
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in per_rank],
        "peak_memory_kind": "cuda_max_memory_allocated"
        if device.type == "cuda"
        else "process_peak_rss",
        "peak_reserved_bytes": [r.get("peak_reserved_bytes") for r in per_rank],
        "state_bytes": [r["state_bytes"] for r in per_rank],
        "per_rank": per_rank,
        "world_size": cfg.world_size,
        **{k: v for k, v in asdict(cfg).items() if k not in ("out_dir", "timeout_s")},
        "global_batch": cfg.micro_batch_size * cfg.micro_batches * cfg.dp,
        "dtype": "bf16" if device.type == "cuda" else "fp32",
        "tied_weight_max_abs_diff": tied_diff,
        "torch_version": torch.__version__,
        "device_name": name,
        # what worker_run.worker_main set before the first tensor (applied once)
        "allocator": keep_freed_memory() if device.type == "cpu" else "CUDA caching allocator",
        "python_version": sys.version.split()[0],
    }
