"""The part every measured worker shares: start the process group, time the steps,
profile one, and gather ``measured.json`` on rank 0.

:mod:`calibration.measured.parallel_worker`, :mod:`calibration.measured.moe_worker` and
:mod:`calibration.measured.cp_worker` build a trainer (a callable running one optimizer
step, with ``coords``, ``optimizer``) and hand it to :func:`record_run`;
:func:`worker_main` is their ``main``: it reads the
:class:`~calibration.measured.measure_config.MeasureConfig`, starts gloo (CPU) or NCCL
(CUDA) and runs them. Timing and profiling are :mod:`calibration.measured.timing`'s.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from calibration.host import keep_freed_memory
from calibration.measured.measure_config import MeasureConfig, write_json_atomic
from calibration.measured.measure_trace import breakdown_from_trace
from calibration.measured.timing import (
    peak_memory_bytes,
    peak_reserved_bytes,
    profile_one_step,
    state_bytes,
    summarize,
    timed_steps,
)


def autocast_for(device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    """bf16 autocast on CUDA (as the scenario's dtype says), nothing on CPU (fp32)."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext


def record_run(trainer: Any, cfg: MeasureConfig, device: torch.device,
               timed: Callable[[], Any] | None = None,
               extra: Callable[[int], dict[str, Any]] | None = None,
               tied_diff: Callable[[], float | None] | None = None) -> None:
    """Time ``trainer``'s steps (through ``timed`` where given: the trainer wrapped, say
    slowed down), profile one, and write ``measured.json`` from rank 0. ``extra`` adds to
    this rank's figures (given the count of timed steps), ``tied_diff`` measures the tied
    embedding's copies apart (every rank calls it, after profiling)."""
    times, losses = timed_steps(trainer if timed is None else timed, cfg, device)
    peak, reserved = peak_memory_bytes(device), peak_reserved_bytes(device)
    out = Path(cfg.out_dir)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    trace_path = out / "traces" / f"trace_rank{rank}.json"
    profiled = profile_one_step(trainer, device, trace_path)
    mine = {"rank": rank, **trainer.coords, "step_times_s": times, "losses": losses,
            "peak_memory_bytes": peak, "peak_reserved_bytes": reserved,
            "state_bytes": state_bytes(trainer),
            "profiled_step_s": profiled,
            **breakdown_from_trace(json.loads(trace_path.read_text()), device.type),
            **(extra(len(times)) if extra is not None else {})}
    diff = tied_diff() if tied_diff is not None else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        write_json_atomic(out / "measured.json", summarize(cfg, device, gathered, diff))
    dist.barrier()  # leave together: a rank tearing down while its peers talk can abort


def worker_main(argv: list[str] | None, description: str,
                run: Callable[[MeasureConfig, torch.device], None]) -> int:
    """Parse ``--config``, start the process group, ``run`` it, and tear the group down."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="MeasureConfig JSON written by run_measure")
    args = parser.parse_args(argv)
    cfg = MeasureConfig(**json.loads(Path(args.config).read_text()))
    torch.set_num_threads(cfg.threads)
    if cfg.device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timedelta(seconds=cfg.timeout_s), device_id=device)
    else:
        keep_freed_memory()  # as a GPU's caching allocator does (calibration.host)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.timeout_s))
    try:
        run(cfg, device)
    finally:
        dist.destroy_process_group()
    return 0
