"""Workload: per-rank programs of tasks for one training step, from a scenario.

A program is, per simulated rank, an ordered list of
:class:`~simulator.builder.tasks.Task` per stream (``compute``, ``pp``, ``dp``,
``zero``, ``host``). A task is compute (a fixed duration priced by the cost
model), a collective over a group (a :class:`~simulator.system.collectives.plan.Plan`), or
a point-to-point transfer. Cross-stream and cross-rank dependencies are task
ids. Everything here is plain data: the engine runs it, tests inspect it.

This module prices one layer's blocks (:func:`block_costs`, from
:mod:`simulator.model.transformer`'s per-layer ops and the cost model) and hands the
scenario to the passes of :mod:`simulator.builder.programs`, one per strategy, which
follow Megatron-LM's execution:

- pipeline (:mod:`simulator.strategies.pipeline.workload`): the schedule's F/B/I/W actions
  as per-layer compute blocks (attention, MLP) with recomputation, p2p sends
  on the ``pp`` stream, the tied embedding's all-reduce;
- tensor (:mod:`simulator.strategies.tensor.workload`): TP collectives around blocks, the
  vocab-parallel ends and the loss, on the compute stream;
- data (:mod:`simulator.strategies.data.workload`): DDP buckets, ZeRO-1/2 reduce-scatters
  and parameter all-gathers, ZeRO-3 / FSDP unit gathers with prefetch, the
  optimizer step;
- offload (:mod:`simulator.strategies.offload`): ZeRO-Offload's PCIe copies and
  CPU Adam on the ``host`` stream.

A profile whose device cannot overlap communication with compute
(``gpu.comm_overlaps_compute: false``, a CPU process) runs every transfer on
the compute stream, whatever ``parallel.overlap`` asks. Symmetry folding builds
programs for one representative per stage; its collectives carry their full
group's plan and its flows stand for every rank of its class on shared links
(``Workload.weight``). Full fidelity builds the same prototypes (one rank per
stage) and lets every rank of a stage share its stage's
(:mod:`simulator.builder.program`), where that is exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from simulator.builder.context import Context
from simulator.builder.lazy import Copies, LazyPrograms, LazyTasks, eligible
from simulator.builder.program import ProgramView, SharedPrograms, TaskView, is_work, share
from simulator.builder.programs import build_programs
from simulator.builder.tasks import Program, Task, Workload
from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.model.inventory.attention import context_parallel_ops
from simulator.model.inventory.mtp import mtp_in_ops
from simulator.model.inventory.ops import Op, Pass
from simulator.model.inventory.recompute_comm import reissued
from simulator.schedules.action import Schedule
from simulator.schedules.registry import build_schedule
from simulator.spec.recompute import policy
from simulator.spec.scenario import Scenario
from simulator.spec.variability import Attributes, classes, clean_tp_index, jitter_factors, resolve
from simulator.strategies.expert.layer import (
    SHARED_FC1,
    SHARED_FC2,
    expert_layer,
    shared_overlapped,
)
from simulator.strategies.tensor.overlap import (
    Windows,
    backward_resyncs,
    overlap_windows,
    price_tails,
)
from simulator.strategies.timing import collective_time
from simulator.system.costs import CostModel
from simulator.system.layout import Layout

if TYPE_CHECKING:
    import numpy as np

__all__ = ["BlockCosts", "block_costs", "build_workload"]


@dataclass(frozen=True)
class BlockCosts:
    """Seconds for one layer's blocks on one TP rank, per micro-batch. A mixture of
    experts prices its MoE layers apart (``moe``, :meth:`layer`): their MLP block is the
    router, permutations and shared experts; the routed experts' forward and input
    gradients are the expert pass's tasks, their weight gradients are in
    ``bwd_weight``."""

    fwd: tuple[float, float]  # (attention block, MLP block)
    bwd_input: tuple[float, float]
    bwd_weight: tuple[float, float]
    recompute: tuple[float, float]
    embed: tuple[float, float, float]  # fwd, bwd_input, bwd_weight
    head: tuple[float, float, float]
    moe: BlockCosts | None = None  # the MoE layers' blocks, when they differ
    moe_first: int = 0  # first MoE layer (model.first_dense_layers)
    moe_freq: int = 1  # then every moe_freq-th layer
    #: one multi-token prediction module's ops outside its layer, on the last stage
    #: (:func:`simulator.model.transformer.mtp_end_ops`): fwd, bwd_input, bwd_weight
    mtp: tuple[float, float, float] = (0.0, 0.0, 0.0)
    #: its input side's forward again before the backward under full recomputation
    mtp_recompute: float = 0.0
    #: the trainer's metric updates on a micro-batch's logits after its backward, on the
    #: last stage (:func:`simulator.model.transformer.train_metric_ops`)
    metrics: float = 0.0
    #: host seconds the pipeline runtime adds to each F and each B action of a stage
    #: (:meth:`simulator.system.costs.CostModel.pipeline_action_s`; 0 without pipelining)
    action: float = 0.0
    #: under TP communication overlap, the GEMM each SP collective of a block meets
    #: (:func:`simulator.strategies.tp_overlap.overlap_windows`; empty without)
    tp_windows: Windows = field(default_factory=dict)
    #: with them, the host seconds of issuing one functional collective (DTensor; the mean
    #: of an all-gather's and a reduce-scatter's), which stay on the compute stream
    #: (:meth:`simulator.system.costs.CostModel.funcol_s`)
    tp_issue: float = 0.0

    def layer(self, index: int) -> BlockCosts:
        """The blocks of layer ``index``."""
        if self.moe is None or index < self.moe_first or (index - self.moe_first) % self.moe_freq:
            return self
        return self.moe


def _split(ops: tuple[Op, ...], cost: CostModel, forward_order: bool) -> tuple[float, float]:
    names = [op.name for op in ops]
    cut = names.index("ln2") if forward_order else names.index("ln2") + 1
    first, second = cost.ops_time(ops[:cut]), cost.ops_time(ops[cut:])
    return (first, second) if forward_order else (second, first)


def _layer_costs(s: Scenario, cost: CostModel, layer: int, embed: tuple[float, float, float],
                 head: tuple[float, float, float]) -> BlockCosts:
    """One layer's blocks; in a MoE layer without the routed experts' forward and input
    gradients (:func:`simulator.strategies.expert_parallel.expert_layer` prices them)."""
    spec, b, tp, sp, dt = (s.model, s.training.micro_batch, s.parallel.tp,
                           s.parallel.sequence_parallel, s.training.dtype)
    routed = spec.is_moe_layer(layer)

    cp, gathered = s.parallel.cp, s.parallel.cp_comm_type == "allgather"
    kept, a2a = s.cp_keeps_gathered_kv, s.parallel.cp_a2a_degree

    # under shared-expert overlap the expert pass runs the shared experts' forward and
    # input gradients beside the dispatch and combine
    apart = moe.ROUTED_OPS + tuple(SHARED_FC1 | SHARED_FC2) \
        if routed and shared_overlapped(s) else moe.ROUTED_OPS

    def ops(p: Pass) -> tuple[Op, ...]:
        out = context_parallel_ops(mdl.layer_ops(spec, b, tp, sp, dt, p, layer, s.stack),
                                       spec, b, tp, dt, p, cp, gathered, kept, a2a)
        gone = moe.ROUTED_OPS if p == "bwd_weight" else apart
        return tuple(op for op in out if op.name not in gone) if routed else out

    fwd, bwd_i, bwd_w = ops("fwd"), ops("bwd_input"), ops("bwd_weight")
    attn = {op.name for op in fwd[:[op.name for op in fwd].index("ln2")]}
    w_attn = cost.ops_time([op for op in bwd_w if op.name in attn])
    w_mlp = cost.ops_time([op for op in bwd_w if op.name not in attn])
    if routed:
        w_mlp += cost.ops_time(expert_layer(s).bwd_weight)
    mode = policy(s.parallel)
    if mode == "full":
        rec_t = _split(fwd, cost, True)
    else:
        rec = context_parallel_ops(
            mdl.layer_recompute_ops(spec, b, tp, sp, dt, mode, layer, s.stack),
            spec, b, tp, dt, "fwd", cp, gathered, a2a=a2a)
        again = reissued(mode, routed, sp)
        rec_t = (cost.ops_time(rec), 0.0) if mode == "selective" else \
            _recompute_blocks(s, cost, rec, attn, apart if "mlp" in again.blocks else None)
    return BlockCosts(_split(fwd, cost, True), _split(bwd_i, cost, False), (w_attn, w_mlp),
                      rec_t, embed, head)


def _recompute_blocks(s: Scenario, cost: CostModel, rec: tuple[Op, ...], attn: set[str],
                      apart: tuple[str, ...] | None) -> tuple[float, float]:
    """(attention block, MLP block) seconds a finer policy re-runs
    (:mod:`simulator.model.inventory.recompute_policy`). In a MoE layer whose MoE block
    is re-run whole (``apart``: the ops the expert pass runs again with its exchanges,
    :func:`simulator.model.inventory.recompute_comm.reissued`) the block leaves them out,
    as full recomputation's; otherwise (``apart`` None) the routed experts it re-runs
    are priced as the expert pass prices them (its ranks' tokens and experts)."""
    names = {op.name for op in rec}
    gone = moe.ROUTED_OPS if apart is None else apart
    mlp = [op for op in rec if op.name not in attn and op.name not in gone]
    if apart is None and any(op.name in moe.ROUTED_OPS for op in rec):
        mlp += [op for op in expert_layer(s).fwd if op.name in names]
    return cost.ops_time([op for op in rec if op.name in attn]), cost.ops_time(mlp)


def local_scenario(s: Scenario) -> Scenario:
    """The scenario as one context-parallel rank sees it: seq_len / cp tokens per
    sequence (every op but the attention core's keys, :func:`block_costs`)."""
    cp = s.parallel.cp
    if cp == 1:
        return s
    local = s.model.model_copy(update={"seq_len": s.model.seq_len // cp})
    return s.model_copy(update={"model": local})


def block_costs(s: Scenario, cost: CostModel) -> BlockCosts:
    """Block costs on one rank; with context parallelism on its chunk of every
    sequence, the attention core against all of it."""
    s = local_scenario(s)
    spec, b, tp, sp, dt = (s.model, s.training.micro_batch, s.parallel.tp,
                           s.parallel.sequence_parallel, s.training.dtype)

    def three(fn: Any) -> tuple[float, float, float]:
        return tuple(cost.ops_time(fn(spec, b, tp, sp, dt, p, s.stack))  # type: ignore[return-value]
                     for p in mdl.PASSES)

    embed, head = three(mdl.embedding_ops), three(mdl.head_ops)
    kinds = moe.layer_kinds(spec)
    base = replace(_layer_costs(s, cost, kinds[0][0], embed, head), metrics=cost.ops_time(
        mdl.train_metric_ops(spec, b, tp, sp, dt, s.stack)))
    if spec.mtp_layers:
        again = mtp_in_ops(spec, b, tp, sp, dt, "fwd", s.stack) \
            if s.parallel.recompute == "full" else ()
        base = replace(base, mtp=three(mdl.mtp_end_ops), mtp_recompute=cost.ops_time(again))
    if s.parallel.pp > 1:
        base = replace(base, action=cost.pipeline_action_s(s.stack.pipeline_runtime))
    windows = overlap_windows(s, cost)
    if windows:
        layout = layout_of(s)
        group = layout.tp_group(0)
        link = layout.group_link(group)
        nbytes = mdl.tp_comm_bytes_per_layer(spec, b, dt)
        windows = price_tails(windows, lambda share: collective_time(
            s, layout, "reduce_scatter", nbytes * share, group, s.hardware))
        base = replace(base, tp_windows=windows,  # an all-gather's and a reduce-scatter's
                       tp_issue=sum(cost.funcol_s(s.stack.dtensor, link, op, nbytes)
                                    for op in ("all_gather", "reduce_scatter")) / 2)
    if not spec.is_moe:
        return base
    first_moe = next(i for i, _ in kinds if spec.is_moe_layer(i))
    moe_costs = _layer_costs(s, cost, first_moe, embed, head)
    return replace(base, moe=moe_costs, moe_first=spec.first_dense_layers,
                   moe_freq=spec.moe_layer_freq)


def layout_of(s: Scenario) -> Layout:
    par = s.parallel
    return Layout(par.tp, par.pp, par.dp, s.cluster.gpus_per_node or 1, par.cp,
                  s.hardware.domain_gpus, par.dp_shard or 0, par.cp_a2a_degree)


def _regridded(s: Scenario) -> bool:
    """Whether the experts regroup a stage with a TP degree of their own."""
    ep = s.parallel.ep if s.model.is_moe else 1
    return ep > 1 and (s.parallel.expert_tp or s.parallel.tp) != s.parallel.tp


def _folds(s: Scenario, fidelity: str) -> bool:
    """Whether a run of this fidelity folds (see :func:`simulated_ranks`)."""
    if fidelity != "folded":
        return False
    return not ((_regridded(s) or s.parallel.cp > 1) and s.variability.active)


def simulated_ranks(s: Scenario, fidelity: str) -> dict[int, int]:
    """The ranks a run of this fidelity simulates and how many ranks each stands for:
    every rank once (full), else one per class of :func:`simulator.spec.variability.classes`
    (one per stage when the cluster is symmetric). Expert parallelism regroups a
    stage's ranks; when its expert TP differs from the dense TP that grid does not
    factor into (replica, TP index), and a run with variability simulates every rank."""
    par = s.parallel
    layout = layout_of(s)
    if not _folds(s, fidelity):
        return dict.fromkeys(range(layout.world), 1)
    # a regridded stage (ep need not divide dp) folds only when symmetric: one class
    split = par.ep if s.model.is_moe and not _regridded(s) else 1
    return classes(layout, resolve(s.variability, layout.world), split, backward_resyncs(s))


def simulated_count(s: Scenario, fidelity: str) -> int:
    """``len(simulated_ranks(s, fidelity))`` without listing a full run's ranks."""
    return len(simulated_ranks(s, fidelity)) if _folds(s, fidelity) else s.parallel.world


def build_workload(s: Scenario, layout: Layout | None = None, cost: CostModel | None = None,
                   costs: BlockCosts | None = None, fidelity: str | None = None,
                   step: int = 0, share_stages: bool = True, stamp: bool = True) -> Workload:
    """Per-rank programs for one training step (``step`` indexes the jitter draws).
    ``costs`` may be given to price blocks differently (tests make stages exactly
    balanced this way). At full fidelity the ranks of a stage share one prototype
    program (:mod:`simulator.builder.program`) where that is exact; ``share_stages=False``
    builds every rank's (what tests compare it with); ``stamp=False`` builds every
    action with the passes instead of copying each (rank, kind, stage)'s first
    (:mod:`simulator.builder.stamp`; what tests compare it with)."""
    layout = layout or layout_of(s)
    cost = cost or CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us,
                             ranks=s.parallel.world)
    costs = costs or block_costs(s, cost)
    fidelity = fidelity or s.simulation.fidelity
    schedule = build_schedule(s.parallel.schedule, s.parallel.pp, s.microbatches,
                              s.parallel.virtual_stages)
    attrs = resolve(s.variability, layout.world)
    weights = simulated_ranks(s, fidelity)
    folded = _folds(s, fidelity)
    shared = None
    if share_stages and not folded and not s.model.is_moe and layout.per_stage > 1:
        ctx = _build(s, layout, cost, costs, schedule, layout.representatives(), attrs, False,
                     stamp)
        shared = share(layout, ctx.tasks, ctx.programs)
    if shared is None:
        ctx = _build(s, layout, cost, costs, schedule, tuple(weights), attrs, folded, stamp)
        _vary_compute(ctx.programs, attrs, s, step)
        programs: Mapping[int, Program] = ctx.programs
        tasks: Sequence[Task] = ctx.tasks
        if ctx.lazy is not None:  # copies' tasks made when read (builder.lazy)
            programs, tasks = LazyPrograms(ctx.lazy), LazyTasks(ctx.lazy)
    else:
        shared.factors = _shared_factors(shared, attrs, s, step)
        tasks = TaskView(shared)
        programs = ProgramView(tasks)
    weight = float(layout.per_stage) if folded else 1.0
    symmetric = not attrs.asymmetric or not folded
    return Workload(programs, tasks, layout, schedule, weight, fidelity,
                    None if symmetric else {r: float(n) for r, n in weights.items()},
                    _link_factors(s, layout, attrs, weights), shared, ctx.holds_sms,
                    ctx.lazy)


def _build(s: Scenario, layout: Layout, cost: CostModel, costs: BlockCosts,
           schedule: Schedule, ranks: tuple[int, ...], attrs: Attributes,
           folded: bool, stamp: bool = True) -> Context:
    """Run the builder passes for ``ranks``."""
    ctx = Context(local_scenario(s), layout, cost, costs, schedule, ranks)
    ctx.stamp = stamp
    if stamp and folded and eligible(ctx):
        ctx.lazy = Copies(ctx.tasks, ctx.programs)
    if folded and attrs.asymmetric:
        ctx.clean_tp = clean_tp_index(layout, attrs, backward_resyncs(s))
    for stage, hw in s.stage_hardware.items():  # a mixed-generation cluster
        ctx.stage_cost[stage] = replace(cost, hw=hw)
        ctx.stage_c[stage] = block_costs(s, ctx.stage_cost[stage])
    build_programs(ctx)
    return ctx


def _link_factors(s: Scenario, layout: Layout, attrs: Attributes,
                  simulated: dict[int, int]) -> dict[tuple[int, str], float]:
    """Per (rank, link class), its port's rate over the base system's: a degraded port's
    factor, times its stage system's rate ratio on a mixed-generation cluster."""
    out = dict(attrs.links)
    base = s.hardware
    for rank in simulated:
        hw = s.stage_hardware.get(layout.coord(rank).pp)
        if hw is None:
            continue
        for cls, mine, theirs in (("intra_node", hw.intra_node, base.intra_node),
                                  ("inter_node", hw.inter_node, base.inter_node)):
            ratio = mine.bytes_per_s / theirs.bytes_per_s
            if ratio != 1.0:
                out[(rank, cls)] = out.get((rank, cls), 1.0) * ratio
    return out


def _shared_factors(shared: SharedPrograms, attrs: Attributes, s: Scenario,
                    step: int) -> dict[int, np.ndarray]:
    """Per rank, the factors :func:`_vary_compute` would multiply its work tasks'
    durations by (ranks without any are left out)."""
    jitter = s.variability.jitter
    if not attrs.compute and jitter is None:
        return {}
    import numpy as np

    per = shared.layout.per_stage
    work = {q: sum(1 for t in protos if is_work(t)) for q, protos in shared.protos.items()}
    out = {}
    for rank in range(shared.world):
        factor = attrs.compute.get(rank, 1.0)
        n = work[rank // per]
        if jitter is not None:
            draws = jitter_factors(jitter, s.variability.seed, step, rank, n)
            out[rank] = factor * np.asarray(draws, np.float64)
        elif factor != 1.0:
            out[rank] = np.full(n, factor)
    return out


def _vary_compute(programs: Mapping[int, Any], attrs: Attributes, s: Scenario,
                  step: int) -> None:
    """A slow rank's compute durations times its factor, then every simulated rank's
    times its jitter draws (in program order; host-stream work is the CPU's)."""
    jitter = s.variability.jitter
    if not attrs.compute and jitter is None:
        return
    for rank, prog in programs.items():
        work: list[Task] = [t for t in prog.streams["compute"] if t.plan is None and t.dst < 0]
        factor = attrs.compute.get(rank, 1.0)
        draws = jitter_factors(jitter, s.variability.seed, step, rank, len(work)) \
            if jitter is not None else None
        for i, t in enumerate(work):
            f = factor if draws is None else factor * float(draws[i])
            t.duration *= f
            t.weight_s *= f
