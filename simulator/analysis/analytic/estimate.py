"""Analytic estimate: the closed-form step time.

The oracle the engine is tested against where the closed form is exact, and the
fast path for sweeps. Per micro-batch and stage, compute comes from the same
block costs the engine uses (roofline × efficiency); TP collectives add their
uncontended α-β time on the critical path. The pipeline then takes

- GPipe / 1F1B: (m + p − 1) × t_stage,
- interleaved: (m + (p − 1)/v) × t_stage (t_stage is the whole stage, all chunks),
- ZB-H1: m × (t_F + t_B + t_W) + (p − 1)(t_F + t_B − t_W) (when m ≥ p),

with t_stage the slowest stage's. An uneven layer placement
(``parallel.layers_per_stage``, :mod:`simulator.spec.placement`) gives every virtual
stage its own times; the schedule's actions are then placed in time with them
(:func:`simulator.schedules.action.execute`, exact with free communication: the slowest
stage sets the pace, e.g. 1F1B with the last stage slowest takes Σ_i (t_F,i + t_B,i)
+ (m − 1)(t_F + t_B) of the last stage). A mixture of experts adds, per MoE layer
and pass, its routed experts' compute and two all-to-alls (and the expert-TP all-
gather and reduce-scatter) to the pass they sit in, its experts' gradient reductions
over the expert data-parallel group to the DP reduction and their shard to the
optimizer step. Pipeline transfers on the fill and drain (2(p − 1) of them, each
with the profile's send sync cost ``gpu.send_sync_us``, as the engine's sends) are
exposed; DP gradient all-reduce is exposed beyond what the last backward hides (all of
it without overlap; the backward as the step has it, ZeRO-3's exposed gathers in it);
then the tied word embedding's all-reduce between the first and the last stage (the
pipeline strategy's term), the optimizer step and, under ZeRO-1/2, the parameter
all-gather. ZeRO-3 adds
each layer's gathers beyond what the neighbouring layer's compute hides and, per
micro-batch, the root unit's gather (embedding, head), which waits for the compute
before it (FSDP2's root pre-forward); with experts each MoE layer's expert unit too,
over edp, and the links those gathers share with the gradient reduce-scatters
(:mod:`simulator.strategies.zero3.experts`); ZeRO-Offload replaces the optimizer step
with CPU Adam and the copy back. Contention between concurrent flows is ignored here —
that is the engine's job, as are degraded links and jitter (a slow GPU slows its
stage's compute).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from simulator.analysis.accounting.breakdown import schedule_bubble
from simulator.analysis.accounting.metrics import metrics
from simulator.analysis.accounting.vocabulary import categories
from simulator.analysis.analytic.stage import (
    AGAIN,
    every_stage_times,
    pipeline_phase,
    pipeline_time,
    slowdown,
    stage_passes,
)
from simulator.analysis.priced import Price, direct
from simulator.builder.workload import BlockCosts, block_costs, layout_of, local_scenario
from simulator.model import transformer as mdl
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import ROOT_TENSORS, fsdp_reduce_parts
from simulator.model.memory import stage_params
from simulator.spec.placement import (
    head_rank,
    holds_embedding,
    holds_head,
    stage_ends,
    stage_layer_count,
    stage_layers,
)
from simulator.spec.scenario import Scenario
from simulator.strategies import registry
from simulator.strategies.base import AnalyticView
from simulator.strategies.compression.arithmetic import effective_method
from simulator.strategies.compression.strategy import compressed_reduction, momentum_exchange
from simulator.strategies.context.strategy import cp_exposed
from simulator.strategies.data.grad_norm import grad_norm_time
from simulator.strategies.data.strategy import ddp_copies, parameter_gather
from simulator.strategies.expert.layer import edp_group
from simulator.strategies.expert.strategy import Experts, expert_times, stage_expert_split
from simulator.strategies.offload import cpu_adam_s, offload_step_s
from simulator.strategies.pipeline.strategy import pipeline_sends
from simulator.strategies.tensor.strategy import Ends, tp_ends, tp_optimizer, tp_time
from simulator.strategies.timing import collective_time, interference, stretch
from simulator.strategies.zero3.buffers import zero3_root_bytes
from simulator.strategies.zero3.deferred import deferred, deferred_exposed
from simulator.strategies.zero3.strategy import Zero3Step, zero3_reductions, zero3_step
from simulator.system.costs import CostModel
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout
from simulator.system.units import CollectiveName


@dataclass(frozen=True)
class _Pipe:
    """The pipeline phase and what produced it."""

    c: BlockCosts
    per_stage: dict[int, BlockCosts]  # a mixed-generation cluster: a stage's own blocks
    t_tp: float
    experts: Experts
    t_cp: float
    ends: Ends
    stages: list[tuple[float, ...]]  # (t_F, t_B_input, t_W) per stage
    slowest: int
    t_pipe: float
    t_cp_again: float = 0.0  # of t_cp, a recomputed core's exchange before the backward


@dataclass(frozen=True)
class _Grads:
    """The busiest stage's gradients and their reduction."""

    busiest: int
    layers: list[int]  # layers per stage
    params: float
    expert_params: list[float]  # each MoE layer's routed experts on one rank
    grad_bytes: float
    param_bytes: float
    dp_op: CollectiveName
    t_dp: float
    t_dp_early: float  # a micro-batch's before the last (hybrid sharding may all-reduce once)
    #: ZeRO-3: what each backward issues at its end (its last unit's and the root's), which
    #: the compute stream waits for (the last micro-batch's, the earlier ones'; the root's)
    t_tail: tuple[float, float, float] = (0.0, 0.0, 0.0)


@dataclass(frozen=True)
class LayerTerms:
    """One layer's costs per micro-batch on one rank: its blocks and the collectives on
    its critical path (TP, the experts', CP's exposed exchange, TP at the model's ends).
    They read the layer's knobs only (TP, CP, EP, sequence parallelism, recomputation,
    micro-batch size, whether the pipeline has stages, and the fixed model, stack and
    hardware), not the pipeline depth, data parallelism, schedule or ZeRO stage, so a
    planner computes them once for every candidate that shares those knobs."""

    c: BlockCosts
    t_tp: float
    experts: Experts
    t_cp: float
    ends: Ends
    t_cp_again: float = 0.0  # of t_cp, a recomputed core's exchange before the backward


def cost_model(s: Scenario, hw: HardwareProfile | None = None) -> CostModel:
    """The cost model the estimate prices ``s`` with (``hw``: another hardware profile)."""
    return CostModel(hw or s.hardware, s.training.dtype, host_us=s.stack.host_us,
                     ranks=s.parallel.world)


def layer_terms(s: Scenario, cost: CostModel, hw: HardwareProfile,
                costs: BlockCosts | None = None) -> LayerTerms:
    """:class:`LayerTerms` of ``s`` (``costs``: its block costs, when already priced)."""
    c = costs or block_costs(s, cost)
    local = local_scenario(s)  # a context-parallel rank's view: seq_len / cp tokens
    layout = layout_of(local)
    t_cp, again = cp_exposed(local, layout, c, hw)
    return LayerTerms(c, tp_time(local, layout, cost, hw), expert_times(local, layout, cost, hw),
                      t_cp, tp_ends(local, layout, cost, hw), again)


def _pipeline(s: Scenario, cost: CostModel, hw: HardwareProfile, terms: LayerTerms,
              per_stage: dict[int, BlockCosts]) -> _Pipe:
    par = s.parallel
    c, t_tp, experts, t_cp, ends = terms.c, terms.t_tp, terms.experts, terms.t_cp, terms.ends
    again = terms.t_cp_again
    stages = every_stage_times(s, c, t_tp, experts, t_cp, ends, per_stage, again)
    slowest = max(range(par.pp), key=lambda st: sum(stages[st]))
    t_pipe = pipeline_phase(s, c, t_tp, experts, t_cp, stages[slowest], per_stage, ends,
                            again)
    return _Pipe(c, per_stage, t_tp, experts, t_cp, ends, stages, slowest, t_pipe, again)


def _gradients(s: Scenario, layout: Layout, hw: HardwareProfile) -> _Grads:
    """The busiest stage's parameters (its layers plus the embedding on the first stage
    and the output layer, with a tied embedding's copy, on the last, as memory counts
    them; with experts the stage with the most, which reduce over edp) and the time of
    their gradients' reduction."""
    par, spec, trn = s.parallel, s.model, s.training
    layers = [stage_layer_count(spec.layers, par, st, spec.mtp_layers) for st in range(par.pp)]
    held = [stage_params(spec, par.pp, st, stage_layers(spec.layers, par, st, spec.mtp_layers),
                         head_rank(par), stage_ends(par, st)) for st in range(par.pp)]
    busiest = max(range(par.pp), key=held.__getitem__)
    params: float = held[busiest]
    expert_params: list[float] = []
    if spec.is_moe:  # the stage with the most experts; experts reduce over edp
        by_stage = [stage_expert_split(s, st) for st in range(par.pp)]
        dense_tp, expert_params = max(by_stage, key=lambda d: sum(d[1]))
        params = dense_tp * par.tp
    rdt = s.stack.reduce_bytes(dtype_bytes(trn.dtype))  # the reduction's dtype
    grad_bytes = params / par.tp * rdt
    param_bytes = params / par.tp * dtype_bytes(trn.dtype)
    dp_op: CollectiveName = "all_reduce" if par.zero == 0 else "reduce_scatter"
    t_dp = collective_time(s, layout, dp_op, grad_bytes, layout.dp_group(0), hw)
    t_early, tail = t_dp, (0.0, 0.0, 0.0)
    if par.zero == 3 and par.dp * par.cp > 1:  # per layer (module), root
        r = zero3_reductions(s, layout, hw, busiest, layers[busiest], dp_op)
        t_dp, t_early, tail = r.last, r.early, (r.tail, r.tail_early, r.root)
    if expert_params:  # the expert data-parallel group: dp · cp ranks of a dense model
        group = edp_group(layout, 0, par.etp, par.ep)
        t_dp += sum(collective_time(s, layout, dp_op, e * rdt, group, hw) for e in expert_params)
        t_early = t_dp
    return _Grads(busiest, layers, params, expert_params, grad_bytes, param_bytes, dp_op, t_dp,
                  t_early, tail)


def _reduction(s: Scenario, layout: Layout, cost: CostModel, hw: HardwareProfile,
               pipe: _Pipe, g: _Grads, z: Zero3Step) -> tuple[float, float, float, float, float]:
    """(exposed reduction, its compute, interference's stretch of the backward, the
    momentum exchange, its compute): the reduction beyond what the last backward hides
    (all of it without overlap), every micro-batch's under ZeRO-2/3, or compression's.
    ZeRO-3's exposed gathers (``z``) lengthen the backward, and the micro-batch, the
    reductions run beside: each window is the pass as the step has it, so compute added
    to a pass (a recomputed forward) that shortens the gathers' wait leaves it as long."""
    par, m = s.parallel, s.microbatches
    _, b, w = pipe.stages[pipe.slowest]
    overlaps = hw.gpu.comm_overlaps_compute
    hidden = (b + w) / par.virtual_stages if s.stack.overlap(par.overlap).dp and overlaps \
        else 0.0
    t_comp = 0.0  # compression compute on the exposed path (counted as optimizer)
    # the backward the reduction overlaps runs 1/f as fast while it is in flight
    f = interference(s, layout, g.dp_op, g.grad_bytes, layout.dp_group(0), hw)
    slow = stretch(g.t_dp, hidden, f)
    waits = z.bwd / par.virtual_stages if hidden else 0.0  # no compute to slow there
    defer = deferred(s)  # torch.distributed.pipelining: after each stage's last backward
    beside = _before_root(s, cost, pipe, g) if hidden and g.t_tail[0] and not defer else 0.0
    tails = [max(g.t_tail[2], t - beside) if hidden else 0.0
             for t in g.t_tail[:2]]  # ZeRO-3: the reductions issued at each backward's end
    exposed_dp = max(tails[0], g.t_dp - hidden - waits - slow)
    if defer:
        slow, exposed_dp = 0.0, deferred_exposed(g.t_dp, b + w, par.virtual_stages,
                                                 bool(hidden))
    elif par.zero >= 2 and par.dp * par.cp > 1 and m > 1:
        # sharded gradients reduce after every micro-batch (the engine's data pass, FSDP2,
        # DeepSpeed's stage 2): the earlier micro-batches' reductions in line where
        # communication does not overlap compute, else beside the next micro-batch's work
        # (that work slowed while they are in flight: max(t − window, stretch), as a layer
        # behind a ZeRO-3 gather); under ZeRO-3 beside their own backward only, which the
        # compute stream waits for them after (DataPass.reduce_wait)
        window = sum(pipe.stages[pipe.slowest]) + z.fwd + z.bwd if hidden else 0.0
        if par.zero == 3 and hidden:
            window = hidden + waits
        exposed_dp += (m - 1) * max(tails[1], g.t_dp_early - window,
                                    stretch(g.t_dp_early, window, f))
    if effective_method(s) != "none":
        slow = 0.0
        exposed_dp, t_comp = compressed_reduction(s, layout, hw, cost, hidden, g.busiest)
    t_exch, t_exch_comp = momentum_exchange(s, layout, hw, cost, g.busiest)
    return exposed_dp, t_comp, slow, t_exch, t_exch_comp


def _before_root(s: Scenario, cost: CostModel, pipe: _Pipe, g: _Grads) -> float:
    """ZeRO-3: the compute between the backward's last layer's reduce-scatter and the root
    unit's, which the former runs beside: the embedding's backward and the stack's FSDP
    kernels before the root's reduce-scatter (FSDP1's cast and pre-divide); after the
    root's, the compute stream waits for both (:meth:`~simulator.strategies.data.
    workload.DataPass.reduce_wait`)."""
    par = s.parallel
    dt = dtype_bytes(s.training.dtype)
    elements = zero3_root_bytes(s, g.busiest)[0] / dt
    compute, before, _ = fsdp_reduce_parts(
        s.stack, elements, par.shard, dt, s.stack.reduce_bytes(dt), ROOT_TENSORS,
        s.microbatches > 1, par.dp * par.cp // par.shard)
    embed = sum(pipe.c.embed[1:]) if holds_embedding(par, g.busiest) else 0.0
    return embed + cost.ops_time((*compute, *before))


def _optimizer(s: Scenario, layout: Layout, cost: CostModel, hw: HardwareProfile,
               stage_cost: dict[int, CostModel], g: _Grads) -> tuple[float, float]:
    """(the optimizer step, the rank's shard): the stack's AdamW on the busiest stage's
    shard with the TP norms' all-reduces, at the slowest GPU's pace; or ZeRO-Offload's."""
    par, spec = s.parallel, s.model
    shard = g.params / par.tp / (par.shard if par.zero >= 1 else 1)
    if g.expert_params:
        shard += sum(g.expert_params) / (par.edp if par.zero >= 1 else 1)
    if par.zero_offload:  # CPU Adam on the shard, then the shard back over PCIe
        return offload_step_s(s, layout, hw, shard), shard
    runs = stage_layers(spec.layers, par, g.busiest, spec.mtp_layers)
    opt = mdl.optimizer_op_of(s, shard, runs, "all" if g.expert_params else "dense")
    t_opt = max(sc.op_time(opt) for sc in (cost, *stage_cost.values())) \
        + tp_optimizer(s, layout, cost, hw, g.layers[g.busiest],
                      holds_head(par, g.busiest))
    if s.variability.slow_gpus:  # the slowest GPU's optimizer step ends the step
        t_opt *= max(slowdown(s).values(), default=1.0)
    return t_opt, shard


def _extensions(view: AnalyticView) -> dict[str, float]:
    """Seconds each strategy's own terms add to the step, by category (nothing for the
    built-in ones, whose terms are above)."""
    out: dict[str, float] = {}
    for strategy in registry.strategies():
        for category, seconds in strategy.analytic_terms(view).items():
            out[category] = out.get(category, 0.0) + seconds
    return out


def _entries(s: Scenario, layout: Layout, pipe: _Pipe,
             after: dict[str, float]) -> tuple[list[dict[str, Any]], list[float]]:
    """Per stage, the breakdown (its passes times m, then what follows the pipeline)
    with its bubble split from imbalance by the schedule's closed form."""
    par, m = s.parallel, s.microbatches
    entries, bubbles = [], []
    for st in range(par.pp):
        entry: dict[str, Any] = {"rank": layout.rank(st, 0, 0), "stage": st}
        entry.update(dict.fromkeys(categories(), 0.0))
        passes = stage_passes(s, pipe.per_stage.get(st, pipe.c), pipe.t_tp, st, pipe.experts,
                              pipe.t_cp, pipe.ends)
        for category, seconds in passes.items():
            if category != AGAIN:  # a share of the transfers, not a category
                entry[category] = m * seconds
        for category, seconds in after.items():
            entry[category] += seconds
        own = pipe.stages[st]
        idle = pipe.t_pipe - m * sum(own)
        ideal = pipeline_time(par.schedule, par.pp, m, par.virtual_stages, *own) - m * sum(own)
        entry["pipeline_bubble"] = min(idle, max(ideal, 0.0))
        entry["imbalance_idle"] = idle - entry["pipeline_bubble"]
        entries.append(entry)
        bubbles.append(schedule_bubble(ideal, idle))
    return entries, bubbles


def analytic_estimate(s: Scenario, costs: BlockCosts | None = None,
                      cost: CostModel | None = None, hw: HardwareProfile | None = None,
                      terms: LayerTerms | None = None, breakdown: bool = True,
                      price: Price = direct) -> dict[str, Any]:
    """The closed-form results. ``cost`` and ``hw`` replace the scenario's cost model and
    hardware profile (``--what-if`` prices the same step with one class faster);
    ``terms``: the layer's terms when already computed (:func:`layer_terms` of ``s``
    with the same ``cost`` and ``hw``; a planner shares them between candidates).
    Without ``breakdown``, ``step_time_s`` alone (the same figure; what a planner ranks
    by), without the per-stage breakdown and the metrics derived from it. ``price``: how
    the pipeline phase, the gradients' reduction and the optimizer step are computed
    (:mod:`simulator.analysis.priced`)."""
    hw = hw or s.hardware
    cost = cost or cost_model(s, hw)
    terms = terms or layer_terms(s, cost, hw, costs)
    # a mixed-generation cluster: each stage's blocks on its own system
    stage_cost = {st: replace(cost, hw=h) for st, h in s.stage_hardware.items()}
    per_stage = {st: block_costs(s, sc) for st, sc in stage_cost.items()}
    s = local_scenario(s)  # a context-parallel rank's view: seq_len / cp tokens
    par = s.parallel
    layout = layout_of(s)
    overlaps = hw.gpu.comm_overlaps_compute
    c = terms.c
    pipe = price("pipeline", -1, lambda: _pipeline(s, cost, hw, terms, per_stage))
    g = price("gradients", -1, lambda: _gradients(s, layout, hw))
    f, b, _ = pipe.stages[pipe.slowest]
    z = zero3_step(s, layout, cost, hw, c, f, b, g.layers[pipe.slowest], g.busiest,
                   g.layers[g.busiest], pipe.slowest)
    t_zero, fsdp_fwd, fsdp_bwd = z.total, z.fsdp_fwd, z.fsdp_bwd
    exposed_dp, t_comp, slow, t_exch, t_exch_comp = _reduction(s, layout, cost, hw, pipe, g, z)
    t_p2p = pipeline_sends(s, layout, hw, not (s.stack.overlap(par.overlap).pp and overlaps))
    t_opt, shard = price("optimizer", -1,
                         lambda: _optimizer(s, layout, cost, hw, stage_cost, g))
    t_ddp = ddp_copies(s, cost, g.busiest, g.layers[g.busiest])
    t_gather = parameter_gather(s, layout, hw, g.param_bytes, g.expert_params) \
        + grad_norm_time(s, layout, hw)
    t_pipe = pipe.t_pipe
    step = t_pipe + t_p2p + exposed_dp + slow + t_opt + t_gather + t_zero + t_exch + t_ddp
    extra = _extensions(AnalyticView(s, layout, cost, hw, t_pipe))
    for seconds in extra.values():
        step += seconds
    if not breakdown:
        return {"step_time_s": step}
    after = {"pp_transfer": t_p2p, "zero_transfer": t_zero - fsdp_fwd - fsdp_bwd,
             "forward": fsdp_fwd, "backward_weight": fsdp_bwd + t_ddp, "backward_input": slow,
             "dp_transfer": exposed_dp - t_comp + t_gather + t_exch - t_exch_comp}
    if par.zero_offload:
        after["optimizer"] = cpu_adam_s(layout, hw, shard) + t_comp + t_exch_comp
        after["offload_transfer"] = t_opt + t_comp + t_exch_comp - after["optimizer"]
    else:
        after["optimizer"] = t_opt + t_comp + t_exch_comp
    for category, seconds in extra.items():
        after[category] = after.get(category, 0.0) + seconds
    entries, bubbles = _entries(s, layout, pipe, after)
    out = metrics(entries, step, (0.0, t_pipe), bubbles)
    out["optimizer_s"] = t_opt
    return out
