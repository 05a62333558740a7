"""The kernel-level MFU ceiling: the most a step could reach if its kernels alone set it.

A step's MFU is the model's FLOPs over (GPUs × peak × step time). Its kernels execute
the hardware FLOPs (the model's plus what recomputation runs again), none faster than
the best efficiency any of the profile's compute curves reaches: the generic GEMM and
attention curves, a calibrated class curve of a GEMM or attention class, a fused
attention kernel's curves (:class:`~simulator.system.hardware.GPUSpec`). With no
communication, no bubble and memory-bound kernels free, the step would take at least
executed FLOPs / (GPUs × peak × e_best), so

    MFU ≤ e_best × model FLOPs / executed FLOPs,

the ceiling here. The executed FLOPs are the hardware FLOPs less what a causal fused
attention kernel skips (the blocks above the diagonal: its calls execute
``Op.compute_scale`` of their counted FLOPs, the curves of such kernels are quoted
against what they execute), so at long sequences, where attention dominates and the
model counts its full square, the ceiling rises above e_best. A prediction above it
says the figure rests on something other than the kernels' measured speed (a curve, an
overlap or a FLOP count to look at); the planner warns where one does
(:mod:`simulator.search.plan`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from simulator.memo import by_identity
from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.spec.model_spec import ModelSpec
from simulator.spec.recompute import ModeRuns, flops_modes, policy
from simulator.spec.scenario import Scenario
from simulator.spec.stack import StackSpec
from simulator.system.curves import EfficiencyCurve
from simulator.system.hardware import GPUSpec

#: the cost classes whose curves are compute (FLOPs), not bytes moved
COMPUTE_PREFIXES = ("gemm_", "attention_")


def _compute_curves(gpu: GPUSpec) -> Iterable[EfficiencyCurve]:
    yield gpu.gemm_efficiency
    yield gpu.attention_efficiency
    for cost_class, curve in gpu.class_efficiency.items():
        if cost_class.startswith(COMPUTE_PREFIXES):
            yield curve
    for kernel in gpu.attention_kernels.values():
        yield from kernel.fwd.values()
        yield from kernel.bwd.values()


#: :func:`best_kernel_efficiency` by GPU (held beside it, so its id names no other GPU
#: while kept; a GPU spec is frozen): a planner asks it for every candidate
_BEST: dict[int, tuple[GPUSpec, float]] = {}


def best_kernel_efficiency(gpu: GPUSpec) -> float:
    """The highest achieved / peak any compute curve of ``gpu`` reaches."""
    return by_identity(_BEST, gpu, lambda: max(
        value for curve in _compute_curves(gpu) for _, value in curve.points), 64)


def skipped_flops(model: ModelSpec, global_batch: int, recompute: mdl.RecomputeMode,
                  stack: StackSpec, modes: ModeRuns | None = None) -> float:
    """Counted FLOPs of a step that its kernels do not execute: each layer op's counted
    FLOPs × (1 − ``compute_scale``) over the forward, both backward passes and the
    recomputed forward (the causal half a fused attention kernel skips, less the
    backward's recomputation of QKᵀ, which it executes on top). ``modes``: the layers by
    recompute mode when only some are recomputed
    (:func:`simulator.spec.recompute.flops_modes`)."""
    total = 0.0
    for mode, runs in modes or ((recompute, (range(model.layers + model.mtp_layers),)),):
        for r in runs:
            for i, n in moe.run_kinds(model, r):
                ops = [op for p in mdl.PASSES
                       for op in mdl.layer_ops(model, global_batch, 1, False, "bf16", p, i,
                                               stack)]
                ops += mdl.layer_recompute_ops(model, global_batch, 1, False, "bf16", mode, i,
                                               stack)
                total += n * sum(op.flops * (1.0 - op.compute_scale) for op in ops)
    return total


@functools.lru_cache(maxsize=256)
def _step_flops(model: ModelSpec, global_batch: int, recompute: mdl.RecomputeMode,
                stack: StackSpec, modes: ModeRuns | None) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) of a step: the same for every layout of a plan that
    recomputes alike, so cached."""
    return (mdl.model_flops_per_step(model, global_batch),
            mdl.hardware_flops_per_step(model, global_batch, recompute, modes, stack)
            - skipped_flops(model, global_batch, recompute, stack, modes))


def mfu_ceiling(s: Scenario) -> float:
    """e_best × model FLOPs / executed FLOPs of ``s`` (module note); the lowest e_best
    of its stages' GPUs on a mixed cluster."""
    best = min(best_kernel_efficiency(s.hardware_of_stage(st).gpu)
               for st in range(s.parallel.pp))
    modes = flops_modes(s.parallel, s.model.layers, s.model.mtp_layers)
    model, executed = _step_flops(s.model, s.training.global_batch, policy(s.parallel),
                                  s.stack, modes)
    return best * model / executed
