"""Per-rank memory: the model's states, activations and logits
(:mod:`simulator.model.memory`) with what each strategy adds: ZeRO's sharding of the
states, the communication buffers of DDP's buckets or ZeRO-3's gathered units
(:func:`simulator.strategies.data.strategy.bucket_buffers`,
:func:`simulator.strategies.zero3.buffers.zero3_buffers`), ZeRO-Offload's states on
the host, gradient compression's buffers and states, and a new strategy's own terms
(its ``memory_terms``), and the device's own terms beside the tensors
(:mod:`simulator.model.device_memory`). One :class:`~simulator.model.memory.MemoryBreakdown` per
pipeline stage; 1 GB = 1e9 bytes.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from simulator.analysis.priced import Price, direct
from simulator.model import moe
from simulator.model.device_memory import DEVICE_TERMS
from simulator.model.inventory.fp8 import weight_cache_bytes
from simulator.model.inventory.layer import fp8_expert_weights, fp8_weights
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.memory import (
    MemoryBreakdown,
    activations,
    in_flight_microbatches,
    logits,
    metric_logits,
    rank_params,
    stage_expert_params,
    stage_params,
    state_bytes_per_param,
)
from simulator.spec.placement import head_rank, stage_ends, stage_layers
from simulator.spec.scenario import Scenario
from simulator.spec.stack import STATE_BYTES
from simulator.strategies import registry
from simulator.strategies.compression.arithmetic import memory_extra
from simulator.strategies.data.strategy import bucket_buffers
from simulator.strategies.offload import offloaded
from simulator.strategies.zero3.buffers import moment_words, zero3_peak
from simulator.strategies.zero3.deferred import deferred


def loss_and_buffers(s: Scenario, stage: int) -> tuple[float, float]:
    """What the loss holds and the communication buffers on one GPU of ``stage`` at its
    peak: under DDP and ZeRO-1/2 every logits copy and two gradient buckets in flight
    (none without data parallelism); under ZeRO-3 those of the moment of its backward
    that holds the most (:func:`simulator.strategies.zero3.buffers.zero3_peak`: the
    loss's backward with its logits copies, or the first block's with the gathered,
    prefetched and unsharded gradients' buffers)."""
    if s.parallel.dp == 1:
        return logits(s, stage), 0.0
    if s.parallel.zero <= 2:
        return logits(s, stage), bucket_buffers(s)
    peak = zero3_peak(s, stage)
    return peak.logits, peak.buffers


def _extended(s: Scenario, stage: int, m: MemoryBreakdown) -> MemoryBreakdown:
    """``m`` with each strategy's own terms added, by field."""
    extra: dict[str, float] = {}
    for strategy in registry.strategies():
        for field, nbytes in strategy.memory_terms(s, stage).items():
            extra[field] = extra.get(field, 0.0) + nbytes
    if not extra:
        return m
    return replace(m, **{field: getattr(m, field) + nbytes for field, nbytes in extra.items()})


def stage_breakdown(scenario: Scenario, stage: int, price: Price = direct) -> MemoryBreakdown:
    """Memory of one GPU of pipeline ``stage`` (``price``: how its terms are computed,
    :mod:`simulator.analysis.priced`).

    ZeRO shards the dense parameters' states over the data-parallel ranks with
    their context-parallel peers (dp · cp, Megatron's ``dp-cp`` group; dp_shard · cp
    under hybrid sharding, :attr:`~simulator.spec.scenario.ParallelSpec.shard`) and the
    routed experts' states over the expert data-parallel ranks (edp)."""
    weights, gradients, optimizer = price("states", stage,
                                          functools.partial(states, scenario, stage))
    buffers, compression_state = memory_extra(scenario, stage)
    acts, held = price("activations", stage, functools.partial(_saved, scenario, stage))
    at_peak, comm = price("loss and buffers", stage,
                          functools.partial(loss_and_buffers, scenario, stage))
    out = MemoryBreakdown(
        stage=stage,
        weights=weights,
        gradients=fsdp_grads_at_peak(scenario, gradients, acts + held),
        optimizer=optimizer + compression_state,
        activations=acts,
        logits=at_peak,
        comm_buffers=comm + buffers,
        capacity=scenario.hardware_of_stage(stage).gpu.memory_GB * 1e9,
        device=tuple((t.name, price(t.name, stage, functools.partial(t.bytes, scenario, stage)))
                     for t in DEVICE_TERMS),
    )
    after = after_backward(scenario, stage, out, gradients, buffers + comm)
    out = _extended(scenario, stage, out)
    if after.moment:  # the stage has the metrics' moment: the larger of the two
        after = _extended(scenario, stage, after)
        return after if after.total > out.total else out
    return out


def after_backward(s: Scenario, stage: int, peak: MemoryBreakdown, gradients: float,
                   buffers: float) -> MemoryBreakdown:
    """The moment after a micro-batch's backward on the stage with the output layer while
    the trainer computes its first training metric (``stack.train_metrics``; the loss's
    tensors then: :func:`~simulator.model.memory.metric_logits`): every gradient made (all
    of FSDP's shards), no ZeRO-3 unit gathered (FSDP reshards the root unit in its
    post-backward), DDP's and ZeRO-1/2's buckets, and the activations of the other
    micro-batches in flight. ``peak`` itself where the stage has no such moment."""
    held = metric_logits(s, stage)
    if not held:
        return peak
    par = s.parallel
    n = in_flight_microbatches(par.schedule, par.pp, s.microbatches, par.virtual_stages, stage)
    return replace(peak, gradients=gradients, activations=peak.activations * (n - 1) / n,
                   logits=held, comm_buffers=buffers if par.zero <= 2 else 0.0,
                   moment="metrics")


def states(scenario: Scenario, stage: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of one GPU of ``stage``: its parameters'
    states sharded as :func:`stage_breakdown` says, the FP8 weight cache, what
    ZeRO-Offload leaves on the GPU."""
    par, dtype = scenario.parallel, scenario.training.dtype
    runs = stage_layers(scenario.model.layers, par, stage, scenario.model.mtp_layers)
    total = stage_params(scenario.model, par.pp, stage, runs, head_rank(par),
                         stage_ends(par, stage))
    experts = stage_expert_params(scenario.model, par.pp, stage, runs)
    psi = rank_params(scenario, total - experts, 0)
    grad_bytes = scenario.stack.main_grad_bytes(dtype_bytes(dtype))
    fp32 = scenario.stack.fp32_params(dtype_bytes(dtype))
    k = scenario.stack.optimizer_bytes(dtype_bytes(dtype))
    w, g, o = state_bytes_per_param(par.zero, par.shard, dtype, grad_bytes, fp32, k)
    gradients, optimizer = psi * g, psi * o
    weights = psi * w
    if experts:
        psi_e = experts / (par.etp * par.ep)
        we, ge, oe = state_bytes_per_param(par.zero, max(par.edp, 1), dtype, grad_bytes, fp32,
                                           k)
        weights, gradients, optimizer = weights + psi_e * we, gradients + psi_e * ge, \
            optimizer + psi_e * oe
    weights += fp8_weight_cache(scenario, runs)
    gradients, optimizer = offloaded(scenario, gradients, optimizer)
    return weights, gradients, optimizer


def _saved(scenario: Scenario, stage: int) -> tuple[float, float]:
    """(activations, logits) of one GPU of ``stage``."""
    return activations(scenario, stage), logits(scenario, stage)


def fsdp_grads_at_peak(s: Scenario, gradients: float, saved: float) -> float:
    """The sharded gradients that coexist with the activations' peak. PyTorch FSDP keeps
    them as the sharded parameters' ``.grad``, which ``zero_grad()`` sets to None after the
    step and each unit's reduce-scatter creates anew as the backward reaches it (FSDP2:
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_reduce``, which
    assigns ``sharded_param.grad`` where it is None; FSDP1: _runtime_utils.py
    ``_accumulate_sharded_gradient``). With one micro-batch a step the backward's start,
    where the saved tensors peak, holds none of them, and each layer's gradient is made as
    that layer's saved tensors are freed: the step holds max(saved, gradients) of the two,
    so only what the gradients exceed the saved tensors by is added. With more micro-batches
    the first one's gradients are there for the second's backward: all of them; but not
    where the reductions wait for the stage's last backward
    (:mod:`simulator.strategies.zero3.deferred`), whose backwards accumulate unsharded
    gradients instead (the ZeRO-3 buffers) and make the sharded ones after the last."""
    fsdp = s.parallel.zero == 3 and s.stack.master_weights == "parameters"
    if not fsdp or (s.microbatches > 1 and not deferred(s)):
        return gradients
    return max(gradients - saved, 0.0)


def fp8_weight_cache(s: Scenario, runs: list[range]) -> float:
    """The FP8 copies (row-wise and column-wise) of the FP8 linears' weights of the layer
    ``runs`` on one rank, which Transformer Engine keeps between micro-batches when it casts
    them once per step (none without ``stack.fp8``; cast every micro-batch, their saved
    copies are activations)."""
    if s.stack.fp8 == "none" or s.stack.fp8_weight_cast != "step":  # else kept per micro-batch
        return 0.0
    par = s.parallel
    elements = sum(n * (fp8_weights(s.model, s.stack, par.tp, i)[0]
                        + fp8_expert_weights(s.model, s.stack, par.ep, par.etp, i)[0])
                   for r in runs for i, n in moe.layer_kinds(s.model, r.start, r.stop))
    return weight_cache_bytes(s.stack.fp8, elements)


def memory_report(scenario: Scenario) -> list[MemoryBreakdown]:
    """One breakdown per pipeline stage."""
    return [stage_breakdown(scenario, stage) for stage in range(scenario.parallel.pp)]


def peak_memory(scenario: Scenario) -> MemoryBreakdown:
    """The stage with the largest total (the first such stage on ties)."""
    return max(memory_report(scenario), key=lambda item: item.total)


def stage_rows(report: list[MemoryBreakdown]) -> list[dict[str, float]]:
    """``{"stage", "total", "capacity"}`` per stage: the rows results.json's ``memory``
    holds, which :func:`simulator.cli.exit_codes.memory_verdict` judges."""
    return [{"stage": m.stage, "total": m.total, "capacity": m.capacity} for m in report]


#: Where each tensor field of a breakdown comes from (docs/model.md, "Memory per GPU")
TENSOR_SOURCES: dict[str, tuple[str, str]] = {
    "weights": ("weights", "16-bit parameters of the stage ÷ tp (÷ dp_shard·cp under ZeRO-3; "
                           "routed experts ÷ expert_tp·ep, ÷ edp under ZeRO-3)"),
    "gradients": ("grads", "stack.main_grad_bytes per parameter (Megatron-Core keeps fp32 main "
                           "grads, unsharded below ZeRO-2; PyTorch FSDP with one micro-batch "
                           "a step: only what exceeds the saved tensors, fsdp_grads_at_peak)"),
    "optimizer": ("optimizer", "AdamW fp32 master + moments, 12 B ÷ dp·cp (dp_shard·cp "
                               "hybrid; distrib_optimizer.py: 6 + 12/d with the grads)"),
    "activations": ("activations", "op inventory's saved tensors × the schedule's in-flight "
                                   "micro-batches (Korthikanti et al. 2022, Table 2)"),
    "logits": ("logits", "fp32 softmax of micro-batches awaiting backward, + its gradient "
                         "(ZeRO-3: at the peak's moment, zero3_peak)"),
    "comm_buffers": ("buffers", "DDP buckets (parallel.dp_bucket_MB) or ZeRO-3's gathered "
                                "units and unsharded gradients at the peak's moment: the "
                                "loss's backward or the first block's (zero3_peak)"),
}


#: The sources that differ at the moment after a backward (:func:`after_backward`)
AFTER_BACKWARD: dict[str, tuple[str, str]] = {
    "gradients": ("grads", "stack.main_grad_bytes per parameter, all of them made after a "
                           "backward (the trainer's metrics' moment)"),
    "activations": ("activations", "the other in-flight micro-batches' saved tensors, after "
                                   "a backward (the trainer's metrics' moment)"),
    "logits": ("logits", "after a backward: its 16-bit logits kept for the trainer's metrics, "
                         "autocast's fp32 copy and log_softmax's output (metric_logits)"),
    "comm_buffers": ("buffers", "DDP or ZeRO-1/2 buckets; no ZeRO-3 unit gathered after a "
                                "backward (after_backward)"),
}


def optimizer_source(s: Scenario) -> str:
    """The optimizer item's source under ``s``'s stack: AdamW's bytes per parameter, the
    master copy's and each moment's dtype, as the distributed optimizer shards them."""
    st, dt = s.stack, dtype_bytes(s.training.dtype)
    master = st.master_bytes(dt)
    kind = "int16 remainders" if st.param_remainders else st.main_params_dtype
    held = f"{kind} master {master:g} + " if master else "(fp32 params are the master) "
    return (f"AdamW {st.optimizer_bytes(dt):g} B/param: {held}exp_avg {st.exp_avg_dtype} "
            f"{STATE_BYTES[st.exp_avg_dtype]} + exp_avg_sq {st.exp_avg_sq_dtype} "
            f"{STATE_BYTES[st.exp_avg_sq_dtype]} (stack.*_dtype), ÷ dp·cp from ZeRO-1 "
            "(distrib_optimizer.py)")


def memory_items(m: MemoryBreakdown, s: Scenario | None = None) -> list[tuple[str, float, str]]:
    """Every item of ``m``: (name, bytes, source), the tensors' fields then the device's
    terms (:data:`simulator.model.device_memory.DEVICE_TERMS`); with the scenario ``s``,
    the optimizer's source names its state's dtypes (:func:`optimizer_source`)."""
    sources = {term.name: term.source for term in DEVICE_TERMS}
    tensors = dict(TENSOR_SOURCES)
    if m.moment == "metrics":  # after a backward, as the trainer's metrics run
        tensors.update(AFTER_BACKWARD)
    if s is not None:
        tensors["optimizer"] = ("optimizer", optimizer_source(s))
        if s.parallel.zero == 3 and s.parallel.dp > 1 and m.moment != "metrics":
            moment = moment_words(s, m.stage)
            tensors["comm_buffers"] = ("buffers", "ZeRO-3's gathered units and unsharded "
                                       f"gradients at the peak's moment, {moment} (zero3_peak)")
    return [*((name, getattr(m, field), source)
              for field, (name, source) in tensors.items()),
            *((name, nbytes, sources.get(name, "")) for name, nbytes in m.device)]
