"""ZeRO-3 / FSDP with a mixture of experts: each MoE layer's routed experts are a
ZeRO-3 unit of their own, sharded over the expert data-parallel group (edp), beside
the layer's dense unit (attention, norms, router, shared experts) sharded over the
data-parallel group as a dense layer's is.

torchtitan (``torchtitan/models/llama4/infra/parallelize.py`` ``apply_fsdp``, which
``deepseek_v3/infra/parallelize.py`` imports; commit a33d0e3, January 2026) wraps
``transformer_block.moe.experts`` with ``fully_shard`` on ``edp_mesh`` (its ``efsdp``
dimension, ``dp_shard · cp · tp / (etp · ep)`` ranks in
``torchtitan/distributed/parallel_dims.py``: our edp) before wrapping the block on the
dense ``dp_mesh``: "the router and the shared experts are sharded
together with the TransformerBlock; the routed experts are sharded with the
remaining edp_mesh". With EP it prefetches explicitly: each block's forward prefetches
``[next_transformer_block, next_transformer_block.moe.experts]`` (and the backward
the previous block's pair), so the expert unit's all-gather is issued right after the
block's, on the same all-gather stream, ``fsdp_prefetch`` units ahead like the block's.
Each rank holds experts / ep of a layer's experts, each matrix split over expert_tp,
so the expert unit's all-gather and reduce-scatter carry
experts · mlp_params(expert_ffn) / (expert_tp · ep) elements; their gradients
reduce-scatter over edp after every micro-batch (the expert pass,
:mod:`simulator.strategies.expert.workload`, as under ZeRO-2).

Simplification: the layer's compute waits for both of its units' gathers (the
experts' are issued with the block's and arrive just after it), where FSDP2 would
let the attention start once the block's own gather is done.

Closed form (:func:`moe_exposed`): each layer's two gathers beyond what the layer
before hides, as for a dense layer, and at least what the micro-batch's gathers take
beyond the part of its compute the gradient reduce-scatters leave free: the expert
units are most of a MoE model's parameters, and their gathers and fp32 gradient
reduce-scatters run over the same edp peers at once, so the links, not the compute,
often set the pace (in the engine they share the links; the dense-only estimate
ignores that contention).

DeepSpeed's engine refuses MoE with ZeRO stage 3 (``deepspeed/runtime/engine.py``:
``assert not self.has_moe_layers, "MoE not supported with Stage 3"``), so a stack
whose ZeRO-3 unit is the module (DeepSpeed's) stays refused with experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.model.inventory.experts import expert_tensors
from simulator.model.inventory.ops import dtype_bytes
from simulator.spec.placement import stage_layers
from simulator.spec.scenario import Scenario
from simulator.strategies.expert.layer import edp_group
from simulator.strategies.timing import collective_time
from simulator.strategies.zero3.deferred import deferred
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout


@dataclass(frozen=True)
class LayerUnits:
    """One kind of layer's ZeRO-3 units on one rank (elements of 16-bit parameters):
    its dense unit, over the shard group, and its routed experts' unit, over edp (0 for
    a dense layer), and how many layers of the stage are like it."""

    dense: float
    experts: float
    count: int


def dense_unit(s: Scenario, layer: int) -> float:
    """Elements of ``layer``'s dense ZeRO-3 unit on one rank: all but its routed
    experts, split over tp."""
    spec = s.model
    return (mdl.layer_params(spec, layer) - moe.expert_params(spec, layer)) / s.parallel.tp


def expert_unit(s: Scenario, layer: int) -> float:
    """Elements of ``layer``'s routed-expert ZeRO-3 unit on one rank (0 for a dense
    layer): its experts / ep experts, each split over expert_tp."""
    par = s.parallel
    return moe.expert_params(s.model, layer) / (par.etp * par.ep)


def expert_unit_tensors(s: Scenario) -> int:
    """Parameter tensors of one expert unit on one rank (torchtitan's GroupedExperts:
    w1, w2, w3; :func:`simulator.model.inventory.experts.expert_tensors`)."""
    return expert_tensors(s.model, s.stack, s.model.experts // s.parallel.ep)


def stage_units(s: Scenario, stage: int) -> list[LayerUnits]:
    """The ZeRO-3 units of pipeline ``stage``'s layers, by kind of layer (closed form:
    :func:`simulator.model.moe.layer_kinds`)."""
    return [LayerUnits(dense_unit(s, i), expert_unit(s, i), n)
            for run in stage_layers(s.model.layers, s.parallel, stage, s.model.mtp_layers)
            for i, n in moe.run_kinds(s.model, run)]


def expert_units_sharded(s: Scenario) -> bool:
    """Whether the expert units have anything to gather: ZeRO-3 installed (dp · cp > 1)
    on a mixture of experts whose expert data-parallel group has more than one rank."""
    par = s.parallel
    return par.zero == 3 and par.dp * par.cp > 1 and s.model.is_moe and par.edp > 1


def stage_expert_units(s: Scenario, stage: int) -> int:
    """MoE layers of ``stage``: one expert unit each, where they are sharded."""
    if not expert_units_sharded(s):
        return 0
    return sum(u.count for u in stage_units(s, stage) if u.experts)


# ---------------------------------------------------------------- closed form


def unit_gather_s(s: Scenario, layout: Layout, hw: HardwareProfile, u: LayerUnits) -> float:
    """One layer's ZeRO-3 gathers, back to back on one stream: its dense unit over the
    shard group, then its experts' over edp."""
    par, dt = s.parallel, dtype_bytes(s.training.dtype)
    t = collective_time(s, layout, "all_gather", u.dense * dt, layout.shard_group(0), hw)
    if u.experts and expert_units_sharded(s):
        t += collective_time(s, layout, "all_gather", u.experts * dt,
                             edp_group(layout, 0, par.etp, par.ep), hw)
    return t


def moe_exposed(s: Scenario, layout: Layout, hw: HardwareProfile, stage: int, t_f: float,
                t_b: float) -> tuple[float, float]:
    """ZeRO-3 per micro-batch on a mixture of experts' ``stage``, (in the forward, in the
    backward): each layer's gathers (its dense unit's and its experts',
    :func:`unit_gather_s`) before its forward and, resharded, before its backward,
    beyond what the layer before hides when prefetched (a layer's share of the stage's
    forward ``t_f`` and backward ``t_b``), as
    :func:`simulator.strategies.zero3.strategy.zero3_exposed` prices a dense layer's;
    the links' excess (below) stretches the backward, where the reductions run."""
    par = s.parallel
    units = stage_units(s, stage)
    layers = sum(u.count for u in units)
    if not layers:
        return 0.0, 0.0
    gathers = [(u.count, unit_gather_s(s, layout, hw, u)) for u in units]
    prefetch = par.overlap.zero3_prefetch and par.fsdp_prefetch > 0 \
        and hw.gpu.comm_overlaps_compute
    if not prefetch:
        once = sum(n * g for n, g in gathers)
        return once, once if par.reshard_after_forward else 0.0
    fwd = sum(n * max(0.0, g - t_f / layers) for n, g in gathers)
    bwd = sum(n * max(0.0, g - t_b / layers) for n, g in gathers)
    bwd = bwd if par.reshard_after_forward else 0.0
    if not s.stack.overlap(par.overlap).dp:
        return fwd, bwd
    # The gathers share the rank's links with the micro-batch's gradient reduce-scatters
    # (the experts' carry fp32 main grads over the same edp peers): the links carry both
    # within the micro-batch's compute, so the gathers wait for whatever part of the
    # window the reductions fill (a reduction beyond the window is the reduction's own
    # exposed time, counted with the gradients).
    # Deferred to the stage's last backward (zero3.deferred), no reduction runs within a
    # micro-batch, and a unit is gathered at most once a micro-batch.
    window, defer = t_f + t_b, deferred(s)
    total = sum(n * g for n, g in gathers) * (2 if par.reshard_after_forward and not defer
                                              else 1)
    reduction = 0.0 if defer else stage_reduction(s, layout, hw, stage)
    links = total - max(0.0, window - reduction)
    return fwd, max(bwd, links - fwd)


def stage_reduction(s: Scenario, layout: Layout, hw: HardwareProfile, stage: int) -> float:
    """A micro-batch's reduce-scatters of ``stage``'s units: the dense ones over the shard
    group and, where sharded, the experts' over edp."""
    par = s.parallel
    rdt = s.stack.reduce_bytes(dtype_bytes(s.training.dtype))
    edp = edp_group(layout, 0, par.etp, par.ep)
    experts = sum(u.count * collective_time(s, layout, "reduce_scatter", u.experts * rdt, edp,
                                            hw) for u in stage_units(s, stage) if u.experts)
    return moe_dense_reduction(s, layout, hw, stage) + experts


def moe_dense_reduction(s: Scenario, layout: Layout, hw: HardwareProfile, stage: int) -> float:
    """The reduce-scatters of ``stage``'s dense units per micro-batch over the shard group,
    each layer by its kind's size (its experts' reduce over edp in the expert terms)."""
    rdt = s.stack.reduce_bytes(dtype_bytes(s.training.dtype))
    group = layout.shard_group(0)
    return sum(u.count * collective_time(s, layout, "reduce_scatter", u.dense * rdt, group, hw)
               for u in stage_units(s, stage))
