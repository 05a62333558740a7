"""Per-rank memory: the model's states, activations and logits
(:mod:`simulator.model.memory`) with what each strategy adds: ZeRO's sharding of the
states, the communication buffers of DDP's buckets or ZeRO-3's gathered units
(:func:`simulator.strategies.data.strategy.bucket_buffers`,
:func:`simulator.strategies.zero3.strategy.zero3_buffers`), ZeRO-Offload's states on
the host, gradient compression's buffers and states, and a new strategy's own terms
(its ``memory_terms``). One :class:`~simulator.model.memory.MemoryBreakdown` per
pipeline stage; 1 GB = 1e9 bytes.
"""

from __future__ import annotations

from dataclasses import replace

from simulator.model.inventory.ops import dtype_bytes
from simulator.model.memory import (
    MemoryBreakdown,
    activations,
    logits,
    rank_params,
    stage_expert_params,
    stage_params,
    state_bytes_per_param,
)
from simulator.spec.placement import head_rank, stage_layers
from simulator.spec.scenario import Scenario
from simulator.strategies import registry
from simulator.strategies.compression.arithmetic import memory_extra
from simulator.strategies.data.strategy import bucket_buffers
from simulator.strategies.offload import offloaded
from simulator.strategies.zero3.strategy import zero3_buffers


def comm_buffers(s: Scenario, stage: int) -> float:
    """Communication buffers on one GPU of ``stage``: two gradient buckets in flight under
    DDP and ZeRO-1/2, ZeRO-3's gathered units (none without data parallelism)."""
    if s.parallel.dp == 1:
        return 0.0
    if s.parallel.zero <= 2:
        return bucket_buffers(s)
    return zero3_buffers(s, stage)


def _extended(s: Scenario, stage: int, m: MemoryBreakdown) -> MemoryBreakdown:
    """``m`` with each strategy's own terms added, by field."""
    extra: dict[str, float] = {}
    for strategy in registry.strategies():
        for field, nbytes in strategy.memory_terms(s, stage).items():
            extra[field] = extra.get(field, 0.0) + nbytes
    if not extra:
        return m
    return replace(m, **{field: getattr(m, field) + nbytes for field, nbytes in extra.items()})


def stage_breakdown(scenario: Scenario, stage: int) -> MemoryBreakdown:
    """Memory of one GPU of pipeline ``stage``.

    ZeRO shards the dense parameters' states over the data-parallel ranks with
    their context-parallel peers (dp · cp, Megatron's ``dp-cp`` group) and the
    routed experts' states over the expert data-parallel ranks (edp)."""
    par, dtype = scenario.parallel, scenario.training.dtype
    runs = stage_layers(scenario.model.layers, par, stage)
    total = stage_params(scenario.model, par.pp, stage, runs, head_rank(par))
    experts = stage_expert_params(scenario.model, par.pp, stage, runs)
    psi = rank_params(scenario, total - experts, 0)
    grad_bytes = scenario.stack.main_grad_bytes(dtype_bytes(dtype))
    fp32 = scenario.stack.fp32_params(dtype_bytes(dtype))
    w, g, o = state_bytes_per_param(par.zero, par.dp * par.cp, dtype, grad_bytes, fp32)
    gradients, optimizer = psi * g, psi * o
    weights = psi * w
    if experts:
        psi_e = experts / (par.etp * par.ep)
        we, ge, oe = state_bytes_per_param(par.zero, max(par.edp, 1), dtype, grad_bytes, fp32)
        weights, gradients, optimizer = weights + psi_e * we, gradients + psi_e * ge, \
            optimizer + psi_e * oe
    gradients, optimizer = offloaded(scenario, gradients, optimizer)
    buffers, compression_state = memory_extra(scenario, stage)
    out = MemoryBreakdown(
        stage=stage,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer + compression_state,
        activations=activations(scenario, stage),
        logits=logits(scenario, stage),
        comm_buffers=comm_buffers(scenario, stage) + buffers,
        capacity=scenario.hardware_of_stage(stage).gpu.memory_GB * 1e9,
    )
    return _extended(scenario, stage, out)


def memory_report(scenario: Scenario) -> list[MemoryBreakdown]:
    """One breakdown per pipeline stage."""
    return [stage_breakdown(scenario, stage) for stage in range(scenario.parallel.pp)]


def peak_memory(scenario: Scenario) -> MemoryBreakdown:
    """The stage with the largest total (the first such stage on ties)."""
    return max(memory_report(scenario), key=lambda item: item.total)
