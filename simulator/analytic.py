"""Analytic estimate: the closed-form step time.

The oracle the engine is tested against where the closed form is exact, and the
fast path for sweeps. Per micro-batch and stage, compute comes from the same
block costs the engine uses (roofline × efficiency); TP collectives add their
uncontended α-β time on the critical path. The pipeline then takes

- GPipe / 1F1B: (m + p − 1) × t_stage,
- interleaved: (m + (p − 1)/v) × t_stage (t_stage is the whole stage, all chunks),
- ZB-H1: m × (t_F + t_B + t_W) + (p − 1)(t_F + t_B − t_W) (when m ≥ p),

with t_stage the slowest stage's. Pipeline transfers on the fill and drain
(2(p − 1) of them) are exposed; DP gradient all-reduce is exposed beyond what
the last backward hides (all of it without overlap); then the optimizer step
and, under ZeRO-1/2, the parameter all-gather. ZeRO-3 adds each layer's gathers
beyond what the neighbouring layer's compute hides; ZeRO-Offload replaces the
optimizer step with CPU Adam and the copy back. Contention between concurrent
flows is ignored here — that is the engine's job.
"""

from __future__ import annotations

from typing import Any

from simulator import accounting as acc
from simulator import model as mdl
from simulator.collectives import GroupShape, estimate, make_plan
from simulator.costs import CostModel
from simulator.hardware import CollectiveName, HardwareProfile
from simulator.layout import Layout
from simulator.scenario import Scenario
from simulator.schedules import schedule_spec
from simulator.workload import OPTIMIZER_BYTES_PER_PARAM, BlockCosts, block_costs


def _collective_time(s: Scenario, layout: Layout, op: CollectiveName, size: float,
                     group: tuple[int, ...], hw: HardwareProfile) -> float:
    if len(group) <= 1 or size <= 0:
        return 0.0
    shape = GroupShape(len(group), len(group) // layout.nodes_spanned(group))
    plan = make_plan(op, size, shape, s.simulation.collective_algorithm, hw)
    return estimate(plan, hw)


def _stage_passes(s: Scenario, c: BlockCosts, t_tp: float, stage: int) -> dict[str, float]:
    """Seconds of one micro-batch through one stage (all chunks), by category:
    forward, backward_input, backward_weight, recompute and tp_transfer."""
    par = s.parallel
    layers = s.model.layers // par.pp
    tp_per_pass = t_tp * (4 if par.sequence_parallel else 2) if par.tp > 1 else 0.0
    passes = 3 if par.recompute == "full" else 2
    out = {"forward": layers * sum(c.fwd), "backward_input": layers * sum(c.bwd_input),
           "backward_weight": layers * sum(c.bwd_weight),
           "recompute": layers * sum(c.recompute) if par.recompute != "none" else 0.0,
           "tp_transfer": layers * tp_per_pass * passes}
    for end, present in ((c.embed, stage == 0), (c.head, stage == par.pp - 1)):
        if present:
            out["forward"] += end[0]
            out["backward_input"] += end[1]
            out["backward_weight"] += end[2]
    return out


def _stage_times(s: Scenario, c: BlockCosts, t_tp: float, stage: int) -> tuple[float, ...]:
    """(t_F, t_B_input, t_W) of one micro-batch through the whole stage (all chunks);
    TP communication and recompute count in the pass they sit in."""
    d = _stage_passes(s, c, t_tp, stage)
    tp_f = d["tp_transfer"] / (3 if s.parallel.recompute == "full" else 2)
    return (d["forward"] + tp_f, d["backward_input"] + d["recompute"] + d["tp_transfer"] - tp_f,
            d["backward_weight"])


def _zero3_exposed(s: Scenario, layout: Layout, t_f: float, t_b: float,
                   hw: HardwareProfile) -> float:
    """ZeRO-3 per micro-batch: each layer's gathers (before forward and, resharded,
    before backward) beyond what the previous layer's compute hides when prefetched."""
    par, spec, trn = s.parallel, s.model, s.training
    layers = spec.layers // par.pp
    size = mdl.layer_params(spec) / par.tp * mdl.dtype_bytes(trn.dtype)
    t_ag = _collective_time(s, layout, "all_gather", size, layout.dp_group(0), hw)
    prefetch = par.overlap.zero3_prefetch and par.fsdp_prefetch > 0 \
        and hw.gpu.comm_overlaps_compute
    fwd = layers * (max(0.0, t_ag - t_f / layers) if prefetch else t_ag)
    bwd = layers * (max(0.0, t_ag - t_b / layers) if prefetch else t_ag) \
        if par.reshard_after_forward else 0.0
    return fwd + bwd


def pipeline_time(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Closed-form pipeline phase for stage times (t_F, t_B, t_W) per micro-batch: the
    schedule registry's (:data:`simulator.schedules.SCHEDULES`)."""
    return schedule_spec(schedule).pipeline_time(p, m, v, f, b, w)


def analytic_estimate(s: Scenario, costs: BlockCosts | None = None,
                      cost: CostModel | None = None,
                      hw: HardwareProfile | None = None) -> dict[str, Any]:
    """The closed-form results. ``cost`` and ``hw`` replace the scenario's cost model and
    hardware profile (``--what-if`` prices the same step with one class faster)."""
    par, spec, trn = s.parallel, s.model, s.training
    hw = hw or s.hardware
    layout = Layout(par.tp, par.pp, par.dp, s.cluster.gpus_per_node or 1)
    cost = cost or CostModel(hw, trn.dtype)
    c = costs or block_costs(s, cost)
    rank0 = 0
    tp_op: CollectiveName = "all_gather" if par.sequence_parallel else "all_reduce"
    t_tp = _collective_time(s, layout, tp_op, mdl.tp_comm_bytes_per_layer(spec, trn.micro_batch,
                                                                          trn.dtype),
                            layout.tp_group(rank0), hw)
    stages = [_stage_times(s, c, t_tp, st) for st in range(par.pp)]
    f, b, w = max(stages, key=sum)
    m = s.microbatches
    t_pipe = pipeline_time(par.schedule, par.pp, m, par.virtual_stages, f, b, w)
    ideal = m * (f + b + w)
    # fill and drain transfers on the critical path
    t_p2p = 0.0
    if par.pp > 1:
        src, dst = layout.rank(0, 0, 0), layout.rank(1, 0, 0)
        same = layout.node(src) == layout.node(dst)
        link = hw.intra_node if same else hw.inter_node
        nbytes = mdl.pp_activation_bytes(spec, trn.micro_batch, trn.dtype)
        if par.sequence_parallel:
            nbytes /= par.tp
        t_p2p = 2 * (par.pp - 1) * par.virtual_stages * (nbytes / link.bytes_per_s + link.alpha_s)
    # the busiest stage's parameters: its layers plus the embedding (first stage) and,
    # on a single stage, the head too
    params = spec.layers // par.pp * mdl.layer_params(spec) + mdl.embedding_params(spec)
    if par.pp == 1:
        params += mdl.head_params(spec)
    grad_bytes = params / par.tp * mdl.dtype_bytes(trn.dtype)
    dp_group = layout.dp_group(rank0)
    dp_op: CollectiveName = "all_reduce" if par.zero == 0 else "reduce_scatter"
    t_dp = _collective_time(s, layout, dp_op, grad_bytes, dp_group, hw)
    overlaps = hw.gpu.comm_overlaps_compute
    hidden = (b + w) / par.virtual_stages if par.overlap.dp and overlaps else 0.0
    exposed_dp = max(0.0, t_dp - hidden)
    if not (par.overlap.pp and overlaps) and par.pp > 1:  # every send in line
        t_p2p *= m
    shard = params / par.tp / (par.dp if par.zero >= 1 else 1)
    if par.zero_offload:  # CPU Adam on the shard, then the shard back over PCIe
        host = hw.host
        t_opt = shard * layout.gpus_per_node / host.cpu_adam_params_per_s \
            + shard * mdl.dtype_bytes(trn.dtype) / (host.pcie_bandwidth_GBps * 1e9)
    else:
        t_opt = cost.memory_time(shard * OPTIMIZER_BYTES_PER_PARAM)
    t_zero = _zero3_exposed(s, layout, f, b, hw) * m if par.zero == 3 else 0.0
    gathered = grad_bytes if par.zero in (1, 2) else 0.0
    if par.zero == 3:  # the replicated embedding/head are gathered after the step
        gathered = grad_bytes - spec.layers // par.pp * mdl.layer_params(spec) / par.tp \
            * mdl.dtype_bytes(trn.dtype)
    t_gather = _collective_time(s, layout, "all_gather", gathered, dp_group, hw)
    step = t_pipe + t_p2p + exposed_dp + t_opt + t_gather + t_zero
    after = {"pp_transfer": t_p2p, "dp_transfer": exposed_dp + t_gather, "zero_transfer": t_zero}
    if par.zero_offload:
        host = hw.host
        after["optimizer"] = shard * layout.gpus_per_node / host.cpu_adam_params_per_s
        after["offload_transfer"] = t_opt - after["optimizer"]
    else:
        after["optimizer"] = t_opt
    entries, bubbles = [], []
    for st in range(par.pp):
        entry: dict[str, Any] = {"rank": layout.rank(st, 0, 0), "stage": st}
        entry.update(dict.fromkeys(acc.CATEGORIES, 0.0))
        passes = _stage_passes(s, c, t_tp, st)
        for category, seconds in passes.items():
            entry[category] = m * seconds
        for category, seconds in after.items():
            entry[category] += seconds
        own = stages[st]
        idle = t_pipe - m * sum(own)
        ideal = pipeline_time(par.schedule, par.pp, m, par.virtual_stages, *own) - m * sum(own)
        entry["pipeline_bubble"] = min(idle, max(ideal, 0.0))
        entry["imbalance_idle"] = idle - entry["pipeline_bubble"]
        entries.append(entry)
        bubbles.append(acc.schedule_bubble(ideal, idle))
    out = acc.metrics(entries, step, (0.0, t_pipe), bubbles)
    out["optimizer_s"] = t_opt
    return out
