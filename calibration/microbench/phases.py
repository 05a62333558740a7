"""The phases of a calibration, in the order ``clustersim calibrate`` measures them.

GEMMs (the chosen dtype's curve, a few shapes in the other dtypes, the backward
layouts, FP8 where the device runs it), attention (forward and backward),
memory-bound kernels (the curves per cost class and the per-kernel overhead), then
the collectives and the two-rank terms in one torchrun launch. Each phase walks its
jobs against the results file, so a resumed run measures only what the file lacks;
:func:`calibration.microbench.busy_guard.read_between` times the reference kernel
between them. ``--skip`` leaves a phase out.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from calibration.microbench.calibrate_options import Options
from simulator.system.devices import preset_for

Phase = tuple[str, Callable[[], None]]


def phases(opts: Options, device: Any, budget: Any, store: Any, have_nccl: bool) -> list[Phase]:
    """Every phase not left out, as (name, run); collectives last."""
    collectives: list[Phase] = [] if "collectives" in opts.skip else [
        ("collectives", functools.partial(_measure_collectives, opts, device, budget, store,
                                          have_nccl))]
    return [*compute_phases(opts, device, budget, store), *collectives]


def compute_phases(opts: Options, device: Any, budget: Any,
                    store: Any) -> list[Phase]:
    """The compute part's phases not left out with ``--skip``, as (name, run)."""
    runs = {"gemm": _measure_gemm, "attention": _measure_attention, "memory": _measure_memory}
    return [(name, functools.partial(run, opts, device, budget, store))
            for name, run in runs.items() if name not in opts.skip]


def _measure_gemm(opts: Options, device: Any, budget: Any, store: Any) -> None:
    from calibration.microbench import bench_compute as bc
    from calibration.microbench import bench_terms as bt
    from calibration.microbench.bench_fp8 import run_fp8_gemm

    bc.run_gemm(device, opts.dtype, budget, store)
    if not (opts.device == "cuda" and datasheet(opts)):
        for other in ("bf16", "fp16", "fp32"):
            if other != opts.dtype:
                bc.run_gemm(device, other, budget, store, bc.probe_shapes(budget, device),
                            stage=f"gemm-{other}")
    bt.run_gemm_layouts(device, opts.dtype, budget, store)
    run_fp8_gemm(device, budget, store, bc.gemm_plan(budget, device))


def _measure_attention(opts: Options, device: Any, budget: Any, store: Any) -> None:
    from calibration.microbench import bench_compute as bc
    from calibration.microbench import bench_terms as bt

    bc.run_attention(device, opts.dtype, budget, store)
    bt.run_attention_bwd(device, opts.dtype, budget, store)


def _measure_memory(opts: Options, device: Any, budget: Any, store: Any) -> None:
    from calibration.microbench import bench_compute as bc
    from calibration.microbench import bench_terms as bt

    bc.run_memory(device, opts.dtype, budget, store)
    bt.run_overhead(device, opts.dtype, budget, store)


def _measure_collectives(opts: Options, device: Any, budget: Any, store: Any,
                         have_nccl: bool) -> None:
    from calibration.microbench.bench_collectives import run_collectives

    if have_nccl:
        return
    if opts.nproc < 2:
        print("collectives: skipped (one process; use --nproc 2 or more)", file=sys.stderr,
              flush=True)
        return
    run_collectives(device, opts.nproc, budget, store, opts.timeout_s)


def datasheet(opts: Options) -> bool:
    """Whether a datasheet preset names the device (its peaks then come from there)."""
    return preset_for(opts.device_name) is not None
