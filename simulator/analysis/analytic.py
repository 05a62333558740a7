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
(:func:`simulator.schedules.schedule.execute`, exact with free communication: the slowest
stage sets the pace, e.g. 1F1B with the last stage slowest takes Σ_i (t_F,i + t_B,i)
+ (m − 1)(t_F + t_B) of the last stage). A mixture of experts adds, per MoE layer
and pass, its routed experts' compute and two all-to-alls (and the expert-TP all-
gather and reduce-scatter) to the pass they sit in, its experts' gradient reductions
over the expert data-parallel group to the DP reduction and their shard to the
optimizer step. Pipeline transfers on the fill and drain (2(p − 1) of them, each
with the profile's send sync cost ``gpu.send_sync_us``, as the engine's sends) are
exposed; DP gradient all-reduce is exposed beyond what the last backward hides (all
of it without overlap); then the optimizer step and, under ZeRO-1/2, the parameter
all-gather. ZeRO-3 adds each layer's gathers beyond what the neighbouring layer's
compute hides and, per micro-batch, the root unit's gather (embedding, head), which
waits for the compute before it (FSDP2's root pre-forward); ZeRO-Offload replaces
the optimizer step with CPU Adam and the copy back. Contention between concurrent
flows is ignored here — that is the engine's job, as are degraded links and jitter
(a slow GPU slows its stage's compute).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from simulator.analysis import accounting as acc
from simulator.builder.workload import (
    BlockCosts,
    block_costs,
    layout_of,
    local_scenario,
)
from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.model.inventory import (
    END_TENSORS,
    ROOT_TENSORS,
    ddp_copy_ops,
    fsdp_gather_ops,
    fsdp_reduce_ops,
    layer_tensors,
    tp_block_collectives,
    tp_end_collectives,
    tp_optimizer_collectives,
    zero3_blocks,
)
from simulator.model.memory import stage_params, zero3_root_bytes
from simulator.schedules.schedule import build_schedule, execute, schedule_spec
from simulator.spec.placement import chunk_layers, is_even, stage_layer_count, stage_layers
from simulator.spec.scenario import Scenario
from simulator.spec.variability import resolve
from simulator.strategies import compression as cmp
from simulator.strategies import expert_parallel as epar
from simulator.strategies.tp_overlap import exposed
from simulator.system.collectives import GroupShape, estimate, make_plan
from simulator.system.costs import CostModel
from simulator.system.hardware import CollectiveName, HardwareProfile
from simulator.system.layout import Layout

EXECUTED_ACTIONS = 1_000_000  # an uneven pipeline this large takes the closed form instead
Experts = tuple[float, float, float, float]
NO_EXPERTS: Experts = (0.0, 0.0, 0.0, 0.0)
#: Seconds per micro-batch of the TP collectives at the model's ends: the embedding's
#: forward and backward, the output layer's (with the loss's) forward and backward
Ends = tuple[float, float, float, float]
NO_ENDS: Ends = (0.0, 0.0, 0.0, 0.0)


def _collective_time(s: Scenario, layout: Layout, op: CollectiveName, size: float,
                     group: tuple[int, ...], hw: HardwareProfile) -> float:
    if len(group) <= 1 or size <= 0:
        return 0.0
    shape = GroupShape(len(group), len(group) // layout.nodes_spanned(group))
    plan = make_plan(op, size, shape, s.simulation.collective_algorithm, hw,
                     s.stack.nccl_version)
    return estimate(plan, hw)


def _interference(s: Scenario, layout: Layout, op: CollectiveName, size: float,
                  group: tuple[int, ...], hw: HardwareProfile) -> float:
    """How many times slower compute runs while this collective is in flight: the
    largest ``gpu.interference`` of the link classes its plan crosses (1 where
    transfers run in line with compute, as the engine has it)."""
    if len(group) <= 1 or size <= 0 or not hw.gpu.interference \
            or not hw.gpu.comm_overlaps_compute:
        return 1.0
    shape = GroupShape(len(group), len(group) // layout.nodes_spanned(group))
    plan = make_plan(op, size, shape, s.simulation.collective_algorithm, hw,
                     s.stack.nccl_version)
    return max((hw.gpu.interference_factor(leg.link_class) for phase in plan.phases
                for leg in phase.legs), default=1.0)


def _stretch(t_comm: float, window: float, factor: float) -> float:
    """What a transfer of ``t_comm`` adds to the ``window`` of compute it overlaps when
    that compute runs ``factor`` times slower while it is in flight: (f − 1) × the work
    done meanwhile, min(window, t_comm / f)."""
    if factor <= 1.0 or window <= 0 or t_comm <= 0:
        return 0.0
    return (factor - 1.0) * min(window, t_comm / factor)


def _kinds(s: Scenario, runs: list[range]) -> list[tuple[int, int]]:
    """(a representative layer, how many like it) over the layer ``runs``."""
    if not s.model.is_moe:
        return [(0, sum(len(r) for r in runs))]
    return [kind for r in runs for kind in moe.layer_kinds(s.model, r.start, r.stop)]


def _chunk_layers(s: Scenario, stage: int) -> list[tuple[int, int]]:
    """(a representative layer, how many like it) on pipeline rank ``stage``, all chunks."""
    return _kinds(s, stage_layers(s.model.layers, s.parallel, stage))


def _passes(s: Scenario, c: BlockCosts, t_tp: float, kinds: list[tuple[int, int]],
            first: bool, last: bool, experts: Experts = NO_EXPERTS,
            t_cp: float = 0.0, chunks: int = 1, ends: Ends = NO_ENDS) -> dict[str, float]:
    """Seconds of one micro-batch through the layers ``kinds`` (with the embedding when
    ``first``, the output layer when ``last``), by category: forward, backward_input,
    backward_weight, recompute, tp_transfer and ep_transfer. ``experts``: a MoE
    layer's routed experts forward and input-gradient seconds, one all-to-all's and
    one expert-TP collective's (:func:`_expert_times`). ``t_cp``: a layer's exposed
    context-parallel exchange, all passes (:func:`_cp_exposed`). ``ends``: the TP
    collectives at the embedding and the output layer (:func:`_tp_ends`)."""
    par, spec = s.parallel, s.model
    passes = 3 if par.recompute == "full" else 2
    # a layer's TP collectives: forward (again when fully recomputed) and backward
    gather = 1 if par.sequence_parallel else 0
    fwd_n, bwd_n = (sum(tp_block_collectives(spec, s.stack, par.tp, par.sequence_parallel,
                                             label, backward) + gather
                        for label in ("attn", "mlp")) for backward in (False, True))
    tp_layer = t_tp * (fwd_n * (passes - 1) + bwd_n)
    split_f = split_b = 0.0  # what TP overlap's chunked GEMMs add, forward and backward
    if c.tp_windows:  # TP overlap: each SP collective less what its GEMM hides
        comm_f, split_f = exposed(s.stack.tp_overlap, c.tp_windows, t_tp, False,
                                  issue=c.tp_issue)
        comm_b, split_b = exposed(s.stack.tp_overlap, c.tp_windows, t_tp, True,
                                  weights=par.schedule != "zb-h1", issue=c.tp_issue)
        tp_layer = comm_f * (passes - 1) + comm_b
    out = dict.fromkeys(("forward", "backward_input", "backward_weight", "recompute",
                         "tp_transfer", "ep_transfer", "cp_transfer"), 0.0)
    for layer, count in kinds:
        lc = c.layer(layer)
        out["forward"] += count * sum(lc.fwd)
        out["backward_input"] += count * sum(lc.bwd_input)
        out["backward_weight"] += count * sum(lc.bwd_weight)
        out["recompute"] += count * sum(lc.recompute) if par.recompute != "none" else 0.0
        out["tp_transfer"] += count * tp_layer
        out["forward"] += count * split_f
        out["recompute"] += count * split_f if par.recompute == "full" else 0.0
        out["backward_input"] += count * split_b
        out["cp_transfer"] += count * t_cp
        if spec.is_moe_layer(layer):
            fwd, bwd, a2a, etp = experts
            out["forward"] += count * fwd
            out["backward_input"] += count * bwd
            out["recompute"] += count * fwd if par.recompute == "full" else 0.0
            out["ep_transfer"] += count * 2 * a2a * passes
            out["tp_transfer"] += count * 2 * etp * passes
    for end, present, tp in ((c.embed, first, ends[:2]), (c.head, last, ends[2:])):
        if present:
            out["forward"] += end[0]
            out["backward_input"] += end[1]
            out["backward_weight"] += end[2]
            out["tp_transfer"] += sum(tp)
    out["forward"] += chunks * c.action  # the pipeline runtime's host time per action
    out["backward_input"] += chunks * c.action
    return out


def _stage_passes(s: Scenario, c: BlockCosts, t_tp: float, stage: int,
                  experts: Experts = NO_EXPERTS, t_cp: float = 0.0,
                  ends: Ends = NO_ENDS) -> dict[str, float]:
    """:func:`_passes` of one pipeline stage (all its chunks)."""
    return _slowed(s, _passes(s, c, t_tp, _chunk_layers(s, stage), stage == 0,
                              stage == s.parallel.pp - 1, experts, t_cp,
                              s.parallel.virtual_stages, ends), stage)


def _slowdown(s: Scenario) -> dict[int, float]:
    """Per pipeline stage, the largest compute factor of its ranks
    (``variability.slow_gpus``)."""
    layout = layout_of(s)
    out: dict[int, float] = {}
    for rank, f in resolve(s.variability, layout.world).compute.items():
        st = layout.coord(rank).pp
        out[st] = max(out.get(st, 1.0), f)
    return out


def _slowed(s: Scenario, d: dict[str, float], stage: int) -> dict[str, float]:
    """Passes ``d`` at the pace of the stage's slowest GPU: its TP and DP peers wait
    for it (communication keeps its time)."""
    slow = _slowdown(s).get(stage, 1.0) if s.variability.slow_gpus else 1.0
    if slow == 1.0:
        return d
    return {k: v if k.endswith("_transfer") else v * slow for k, v in d.items()}


def _times(s: Scenario, d: dict[str, float]) -> tuple[float, float, float]:
    """(t_F, t_B_input, t_W) of passes ``d``; TP and EP communication and recompute
    count in the pass they sit in."""
    comm = d["tp_transfer"] + d["ep_transfer"] + d["cp_transfer"]
    comm_f = comm / (3 if s.parallel.recompute == "full" else 2)
    return (d["forward"] + comm_f, d["backward_input"] + d["recompute"] + comm - comm_f,
            d["backward_weight"])


def _stage_times(s: Scenario, c: BlockCosts, t_tp: float, stage: int,
                 experts: Experts = NO_EXPERTS, t_cp: float = 0.0,
                 ends: Ends = NO_ENDS) -> tuple[float, ...]:
    """(t_F, t_B_input, t_W) of one micro-batch through the whole stage (all chunks)."""
    return _times(s, _stage_passes(s, c, t_tp, stage, experts, t_cp, ends))


def _tp_ends(s: Scenario, layout: Layout, cost: CostModel, hw: HardwareProfile) -> Ends:
    """Per micro-batch, the TP collectives at the embedding (forward, backward) and at
    the output layer with the loss (forward, backward), each with a functional
    collective's cost beyond a plain one where the stack issues it through DTensor, as
    the engine's tensor pass issues them (:func:`simulator.model.inventory.tp_end_collectives`).
    """
    par, spec, trn = s.parallel, s.model, s.training
    if par.tp == 1:
        return NO_ENDS
    group = layout.tp_group(0)
    link = layout.group_link(group)
    size = mdl.tp_end_bytes(spec, trn.micro_batch, trn.dtype)

    def t(where: Literal["embed", "head", "loss"], forward: bool) -> float:
        return sum(_collective_time(s, layout, op, size[payload], group, hw)
                   + (cost.funcol_s(s.stack.dtensor, link, op, size[payload])
                      if payload != "loss" else 0.0)
                   for op, payload in tp_end_collectives(s.stack, par.tp,
                                                         par.sequence_parallel, where,
                                                         forward))

    return (t("embed", True), t("embed", False), t("head", True) + t("loss", True),
            t("head", False))


def _tp_optimizer(s: Scenario, layout: Layout, cost: CostModel, hw: HardwareProfile,
                  layers: int, last: bool) -> float:
    """The optimizer step's TP all-reduces on a rank of ``layers`` layers (the final
    norm's too on the last stage): the norms' partial gradients under DTensor with
    sequence parallelism (:func:`simulator.model.inventory.tp_optimizer_collectives`)."""
    par, spec = s.parallel, s.model
    n = tp_optimizer_collectives(spec, s.stack, par.tp, par.sequence_parallel, layers, last)
    if not n:
        return 0.0
    group = layout.tp_group(0)
    nbytes = spec.hidden * s.stack.reduce_bytes(mdl.dtype_bytes(s.training.dtype))
    return n * (_collective_time(s, layout, "all_reduce", nbytes, group, hw)
                + cost.funcol_s(s.stack.dtensor, layout.group_link(group), "all_reduce",
                                nbytes))


def _cp_exposed(s: Scenario, layout: Layout, c: BlockCosts, hw: HardwareProfile) -> float:
    """One layer's exposed context-parallel exchange per micro-batch, all passes
    (:mod:`simulator.strategies.context`): a ring beyond what its attention block
    hides (twice the bytes in backward), or the blocking all-gathers and the
    gradients' reduce-scatter (and the backward's all-gather unless the stack keeps the
    gathered keys and values). ``s`` is the rank's local view (seq_len / cp)."""
    par, trn = s.parallel, s.training
    if par.cp == 1:
        return 0.0
    size = par.cp * mdl.cp_kv_bytes(s.model, trn.micro_batch, par.tp, trn.dtype)
    group = layout.cp_group(0)
    fwd_passes = 2 if par.recompute == "full" else 1
    if par.cp_comm_type == "allgather":
        ag = _collective_time(s, layout, "all_gather", size, group, hw)
        rs = _collective_time(s, layout, "reduce_scatter", size, group, hw)
        regather = 0 if s.cp_keeps_gathered_kv else 1  # the backward's all-gather
        return (fwd_passes + regather) * ag + rs
    ring_f = _collective_time(s, layout, "all_gather", size, group, hw)
    ring_b = _collective_time(s, layout, "all_gather", 2 * size, group, hw)
    lc = c.layer(0)
    return fwd_passes * max(0.0, ring_f - lc.fwd[0]) \
        + max(0.0, ring_b - lc.bwd_input[0] - lc.bwd_weight[0])


def _pipeline_phase(s: Scenario, c: BlockCosts, t_tp: float, experts: Experts, t_cp: float,
                    slowest: tuple[float, ...],
                    per_stage: dict[int, BlockCosts] | None = None,
                    ends: Ends = NO_ENDS) -> float:
    """The pipeline phase: the schedule's closed form at the slowest stage's times for an
    even placement; for an uneven one (:mod:`simulator.spec.placement`) the schedule's actions
    placed in time with each virtual stage's own times
    (:func:`simulator.schedules.schedule.execute`, exact with free communication), or the
    closed form, an upper bound, when the pipeline has more than :data:`EXECUTED_ACTIONS`
    actions."""
    par, m = s.parallel, s.microbatches
    closed = pipeline_time(par.schedule, par.pp, m, par.virtual_stages, *slowest)
    n = par.pp * par.virtual_stages
    if (is_even(par) and not per_stage) or 3 * n * m > EXECUTED_ACTIONS:
        return closed
    per_stage = per_stage or {}
    chunks = [_times(s, _slowed(s, _passes(s, per_stage.get(k % par.pp, c), t_tp,
                                            _kinds(s, [chunk_layers(s.model.layers, par, k)]),
                                            k == 0, k == n - 1, experts, t_cp, 1, ends),
                                    k % par.pp))
              for k in range(n)]
    sched = build_schedule(par.schedule, par.pp, m, par.virtual_stages)
    timed = execute(sched, [x[0] for x in chunks], [x[1] for x in chunks],
                    [x[2] for x in chunks])
    return max(x.end for x in timed) - min(x.start for x in timed)


def _expert_times(s: Scenario, layout: Layout, cost: CostModel,
                  hw: HardwareProfile) -> Experts:
    """A MoE layer's routed experts per micro-batch: forward and input-gradient compute,
    one all-to-all, one expert-TP all-gather (or reduce-scatter)."""
    if not s.model.is_moe:
        return NO_EXPERTS
    par, lay = s.parallel, epar.expert_layer(s)
    a2a = _collective_time(s, layout, "all_to_all", lay.a2a_bytes,
                           epar.ep_group(layout, 0, par.etp, par.ep), hw)
    etp = _collective_time(s, layout, "all_gather", lay.etp_bytes,
                           epar.etp_group(layout, 0, par.etp), hw)
    return (cost.ops_time(lay.fwd), cost.ops_time(lay.bwd_input), a2a, etp)


def _stage_params(s: Scenario, stage: int) -> tuple[float, list[float]]:
    """Pipeline rank ``stage``'s parameters on one rank: the dense ones (with the
    embedding on the first stage and, on a single stage, the head) and each MoE
    layer's routed experts (an edp gradient reduction each)."""
    spec, par = s.model, s.parallel
    dense = float(mdl.embedding_params(spec)) if stage == 0 else 0.0
    if par.pp == 1:
        dense += mdl.head_params(spec)
    experts: list[float] = []
    for layer, count in _chunk_layers(s, stage):
        e = moe.expert_params(spec, layer)
        dense += count * (mdl.layer_params(spec, layer) - e)
        experts += [e / (par.etp * par.ep)] * count if e else []
    return dense / par.tp, experts


def zero3_collective_counts(s: Scenario, stage: int) -> dict[str, int]:
    """ZeRO-3's collectives per step on one rank of pipeline ``stage``, as the engine's
    workload issues them: per micro-batch, each layer's gathers (before its forward
    and, with ``reshard_after_forward``, before its backward) and reduce-scatter, one
    per part (:func:`simulator.model.transformer.zero3_collectives`), and the root unit's gather
    and reduce-scatter on a stage holding the embedding or the head (FSDP2 keeps the
    root gathered from its forward to its backward). A step of FSDP2 with L layers on
    one stage: m(1 + 2L) all-gathers, m(1 + L) reduce-scatters."""
    par = s.parallel
    if par.zero != 3 or par.dp * par.cp == 1:
        return {"all_gather": 0, "reduce_scatter": 0}
    parts = mdl.zero3_collectives(s.model, s.stack)
    layers = stage_layer_count(s.model.layers, par, stage) * parts
    root = 1 if stage in (0, par.pp - 1) else 0
    gathers = (2 if par.reshard_after_forward else 1) * layers + root
    return {"all_gather": s.microbatches * gathers,
            "reduce_scatter": s.microbatches * (layers + root)}


def _fsdp_copies(s: Scenario, cost: CostModel, stage: int, layers: int,
                 on_compute_only: bool) -> tuple[float, float]:
    """(forward, backward) seconds per step of FSDP2's copies around a stage's ZeRO-3
    collectives (:func:`simulator.model.inventory.fsdp_gather_ops`,
    :func:`~simulator.model.inventory.fsdp_reduce_ops`) as the engine places them: the copy-out
    after each gather and the gradient pack before each reduce-scatter on the compute
    stream; the copy-in and the accumulate (micro-batches after the first) on the
    collectives' streams, so only where those run in line (``on_compute_only`` false).
    A stage's ``layers`` and its root unit."""
    par, spec, stack = s.parallel, s.model, s.stack
    if par.zero != 3 or par.dp * par.cp == 1 or not stack.fsdp_copies:
        return 0.0, 0.0
    dt = mdl.dtype_bytes(s.training.dtype)
    rdt, dp, m = stack.reduce_bytes(dt), par.dp * par.cp, s.microbatches
    tensors = layer_tensors(spec, stack)
    unit = mdl.layer_params(spec) / par.tp
    root = zero3_root_bytes(s, stage)[0] / dt

    def gather(elements: float, n: int) -> float:
        ops = fsdp_gather_ops(stack, elements, dp, dt, n)
        return cost.ops_time(ops[-1:] if on_compute_only else ops)

    def reduce(elements: float, n: int) -> float:  # a step's: m packs, m − 1 accumulates
        return sum(cost.ops_time(ops[:1] if on_compute_only else ops) * k for ops, k in (
            (fsdp_reduce_ops(stack, elements, dp, dt, rdt, n, False), 1),
            (fsdp_reduce_ops(stack, elements, dp, dt, rdt, n, True), m - 1)))

    fwd = m * (layers * gather(unit, tensors) + gather(root, ROOT_TENSORS))
    bwd = m * layers * (gather(unit, tensors) if par.reshard_after_forward else 0.0) \
        + layers * reduce(unit, tensors) + reduce(root, ROOT_TENSORS)
    return fwd, bwd


def _ddp_copies(s: Scenario, cost: CostModel, stage: int, layers: int) -> float:
    """Seconds per step of torch DDP's bucket copies on a stage
    (:func:`simulator.model.inventory.ddp_copy_ops`): each gradient into its bucket and, after
    the reductions, back, per entry of the stage's gradients as the engine lists them
    (:meth:`simulator.builder.context.Context.grad_units`: each layer, the head's norm with
    the first, the embedding's tables)."""
    par, spec, stack = s.parallel, s.model, s.stack
    if par.zero != 0 or par.dp * par.cp == 1 or not stack.ddp_copies \
            or cmp.effective_method(s) == "onebit_adam":
        return 0.0
    dt = stack.reduce_bytes(mdl.dtype_bytes(s.training.dtype))
    units = [(mdl.layer_params(spec) / par.tp, layer_tensors(spec, stack))] * layers
    if stage == par.pp - 1:
        tied = spec.vocab * spec.hidden if spec.tied_embeddings and par.pp > 1 else 0
        head = (mdl.head_params(spec) + tied) / par.tp
        units = [(units[0][0] + head, units[0][1] + END_TENSORS), *units[1:]] if units \
            else [(head, END_TENSORS)]
    if stage == 0:
        units.append((mdl.embedding_params(spec) / par.tp, END_TENSORS))
    return sum(cost.ops_time(ddp_copy_ops(stack, e, dt, n, back))
               for e, n in units for back in (False, True))


def _zero3_root(s: Scenario, layout: Layout, hw: HardwareProfile) -> float:
    """The largest root unit's gather, once per micro-batch on its stage: it waits for
    the compute issued before it, so no prefetch hides it."""
    sizes = [zero3_root_bytes(s, st)[0] for st in {0, s.parallel.pp - 1}]
    return max(_collective_time(s, layout, "all_gather", size, layout.dp_group(0), hw)
               for size in sizes)


def _zero3_exposed(s: Scenario, layout: Layout, t_f: float, t_b: float,
                   hw: HardwareProfile, layers: int, c: BlockCosts) -> float:
    """ZeRO-3 per micro-batch: each of the stage's ``layers`` layers' gathers (before
    forward and, resharded, before backward) beyond what the previous unit's compute
    hides when prefetched: the previous layer's, or with module units
    (:func:`simulator.model.inventory.zero3_blocks`) the previous block's."""
    par, spec, trn = s.parallel, s.model, s.training
    if not layers:
        return 0.0
    blocks = zero3_blocks(spec, s.stack, par.tp, mdl.layer_params(spec) / par.tp)
    group, dt = layout.dp_group(0), mdl.dtype_bytes(trn.dtype)
    t_ag = {b: sum(_collective_time(s, layout, "all_gather", e * dt, group, hw) for e in es)
            for b, es in blocks.items()}
    prefetch = par.overlap.zero3_prefetch and par.fsdp_prefetch > 0 \
        and hw.gpu.comm_overlaps_compute
    if not prefetch:
        gathers = sum(t_ag.values())
        return layers * gathers * (2 if par.reshard_after_forward else 1)
    if len(blocks) == 1:  # a layer unit, hidden behind the layer before
        fwd = layers * max(0.0, t_ag["attn"] - t_f / layers)
        bwd = layers * max(0.0, t_ag["attn"] - t_b / layers)
        return fwd + (bwd if par.reshard_after_forward else 0.0)
    # module units: each block's gathers behind the block that runs before it
    lc = c.layer(0)
    fwd = max(0.0, t_ag["attn"] - lc.fwd[1]) + max(0.0, t_ag["mlp"] - lc.fwd[0])
    bwd_blocks = tuple(lc.bwd_input[i] + lc.bwd_weight[i] for i in range(2))
    # In backward the block gathered second in a layer starts as the layer before's
    # gradients go out (its reduce-scatters, issued when its backward ends, overlapped):
    # sharing the links fairly, the gather takes up to twice its time.
    shared = 0.0
    if s.stack.overlap(par.overlap).dp and hw.gpu.comm_overlaps_compute:
        rdt = s.stack.reduce_bytes(dt)
        shared = sum(_collective_time(s, layout, "reduce_scatter", e * rdt, group, hw)
                     for es in blocks.values() for e in es)
    if par.recompute == "full":  # attention first (recomputed after the attention's backward)
        second = t_ag["mlp"] + min(t_ag["mlp"], shared)
        bwd = max(0.0, t_ag["attn"] - bwd_blocks[0]) + max(0.0, second - lc.recompute[0])
    else:  # MLP first (after the attention's backward), then attention (after the MLP's)
        second = t_ag["attn"] + min(t_ag["attn"], shared)
        bwd = max(0.0, t_ag["mlp"] - bwd_blocks[0]) + max(0.0, second - bwd_blocks[1])
    return layers * (fwd + (bwd if par.reshard_after_forward else 0.0))


def _compressed_reduction(s: Scenario, layout: Layout, hw: HardwareProfile,
                          cost: CostModel, window: float, stage: int) -> tuple[float, float]:
    """(exposed time, its compute) of ``stage``'s gradient buckets reduced one after the
    other by PowerSGD or a bf16/fp8 wire (:mod:`simulator.strategies.compression_pass`). A
    bucket's chain starts when its last layer's gradients are ready (the layers spread
    evenly over the last backward, ``window`` long; 0 without overlap) and the previous
    chain has ended; what runs after the backward is exposed."""
    par, spec, g = s.parallel, s.model, cmp.spec_of(s)
    method = cmp.effective_method(s)
    dt = s.stack.reduce_bytes(mdl.dtype_bytes(s.training.dtype))  # what the buckets hold
    if method == "onebit_adam":
        return 0.0, 0.0
    fp32 = replace(cost, hw=hw, dtype="fp32")
    group = layout.dp_group(0)
    op: CollectiveName = "all_reduce" if par.zero == 0 else "reduce_scatter"
    units = cmp.stage_units(s, stage)
    sizes = [sum(n * m for n, m in u) / par.tp * dt for u in units]
    per_unit = par.zero == 3
    groups = [[i] for i in range(len(sizes))] if per_unit \
        else cmp.buckets(sizes, cmp.bucket_caps(s))
    times = s.microbatches if par.zero >= 2 else 1
    layers = max(stage_layer_count(spec.layers, par, stage), 1)
    clock = exposed = compute = 0.0
    for bucket in groups:
        if method == "powersgd":
            b = cmp.powersgd_bucket([x for i in bucket for x in units[i]], cmp.rank_of(g),
                                    cmp.min_rate(g))
            comp = sum(fp32.ops_time(ops) for ops in cmp.powersgd_phases(b))
            comm = sum(_collective_time(s, layout, "all_reduce", cmp.HOOK_BYTES * x, group, hw)
                       for x in (b.uncompressed, b.p, b.q))
        else:
            size = sum(sizes[i] for i in bucket)
            wire = cmp.WIRE_BYTES[method]
            comp = sum(fp32.ops_time(ops) for ops in cmp.cast_ops(size / dt, dt, wire))
            comm = _collective_time(s, layout, op, size * wire / dt, group, hw)
        ready = window * min(bucket[-1] + 1, layers) / layers
        start = max(clock, ready)
        clock = start + times * (comp + comm)
        late = min(clock - window, clock - start) if clock > window else 0.0
        exposed += late
        compute += late * comp / (comp + comm) if comp + comm else 0.0
    return exposed, compute


def _momentum_exchange(s: Scenario, layout: Layout, hw: HardwareProfile,
                       cost: CostModel, stage: int) -> tuple[float, float]:
    """(all of it, its compute) of 1-bit Adam's compressed momentum all-reduce."""
    if cmp.effective_method(s) != "onebit_adam":
        return 0.0, 0.0
    par, n = s.parallel, s.parallel.dp
    fp32 = replace(cost, hw=hw, dtype="fp32")
    elements = cmp.stage_elements(s, stage)
    compute = sum(fp32.ops_time(ops) for ops in cmp.onebit_ops(elements, n))
    comm = sum(_collective_time(s, layout, op, size, layout.dp_group(0), hw)
               for _, op, size in cmp.onebit_collectives(elements, par.dp))
    return compute + comm, compute


def pipeline_time(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Closed-form pipeline phase for stage times (t_F, t_B, t_W) per micro-batch: the
    schedule registry's (:data:`simulator.schedules.schedule.SCHEDULES`)."""
    return schedule_spec(schedule).pipeline_time(p, m, v, f, b, w)


def analytic_estimate(s: Scenario, costs: BlockCosts | None = None,
                      cost: CostModel | None = None,
                      hw: HardwareProfile | None = None) -> dict[str, Any]:
    """The closed-form results. ``cost`` and ``hw`` replace the scenario's cost model and
    hardware profile (``--what-if`` prices the same step with one class faster)."""
    hw = hw or s.hardware
    cost = cost or CostModel(hw, s.training.dtype, host_us=s.stack.host_us,
                             ranks=s.parallel.world)
    c = costs or block_costs(s, cost)
    # a mixed-generation cluster: each stage's blocks on its own system
    stage_cost = {st: replace(cost, hw=h)
                  for st, h in s.stage_hardware.items()}
    per_stage = {st: block_costs(s, sc) for st, sc in stage_cost.items()}
    s = local_scenario(s)  # a context-parallel rank's view: seq_len / cp tokens
    par, spec, trn = s.parallel, s.model, s.training
    layout = layout_of(s)
    rank0 = 0
    # a layer's TP collective: an all-reduce, or under sequence parallelism one
    # all-gather before each block and one reduce-scatter after it (their mean)
    tp_ops: tuple[CollectiveName, ...] = ("all_gather", "reduce_scatter") \
        if par.sequence_parallel else ("all_reduce",)
    tp_bytes = mdl.tp_comm_bytes_per_layer(spec, trn.micro_batch, trn.dtype)
    group = layout.tp_group(rank0)
    t_tp = sum(_collective_time(s, layout, op, tp_bytes, group, hw)
               # DTensor's functional collectives: their host time beyond a plain one
               + (cost.funcol_s(s.stack.dtensor, layout.group_link(group), op, tp_bytes)
                  if par.tp > 1 else 0.0)
               for op in tp_ops) / len(tp_ops)
    experts = _expert_times(s, layout, cost, hw)
    t_cp = _cp_exposed(s, layout, c, hw)
    ends = _tp_ends(s, layout, cost, hw)
    stages = [_stage_times(s, per_stage.get(st, c), t_tp, st, experts, t_cp, ends)
              for st in range(par.pp)]
    slowest = max(range(par.pp), key=lambda st: sum(stages[st]))
    f, b, w = stages[slowest]
    m = s.microbatches
    t_pipe = _pipeline_phase(s, c, t_tp, experts, t_cp, stages[slowest], per_stage, ends)
    # fill and drain transfers on the critical path
    t_p2p = 0.0
    if par.pp > 1:
        src, dst = layout.rank(0, 0, 0), layout.rank(1, 0, 0)
        same = layout.node(src) == layout.node(dst)
        link = hw.intra_node if same else hw.inter_node
        nbytes = mdl.pp_activation_bytes(spec, trn.micro_batch, trn.dtype)
        if par.sequence_parallel:
            nbytes /= par.tp
        # each send also pays the sync cost after compute, as the engine's sends do
        sync = hw.gpu.send_sync_s("intra_node" if same else "inter_node")
        t_p2p = 2 * (par.pp - 1) * par.virtual_stages * (nbytes / link.bytes_per_s + link.alpha_s
                                                         + sync)
    # the busiest stage's parameters: its layers plus the embedding (first stage) and
    # the output layer (last stage, with a tied embedding's copy), as memory counts them
    layers = [stage_layer_count(spec.layers, par, st) for st in range(par.pp)]
    held = [stage_params(spec, par.pp, st, stage_layers(spec.layers, par, st))
            for st in range(par.pp)]
    busiest = max(range(par.pp), key=held.__getitem__)
    params: float = held[busiest]
    expert_params: list[float] = []
    if spec.is_moe:  # the stage with the most experts; experts reduce over edp
        by_stage = [_stage_params(s, st) for st in range(par.pp)]
        dense_tp, expert_params = max(by_stage, key=lambda d: sum(d[1]))
        params = dense_tp * par.tp
    rdt = s.stack.reduce_bytes(mdl.dtype_bytes(trn.dtype))  # the reduction's dtype
    grad_bytes = params / par.tp * rdt
    param_bytes = params / par.tp * mdl.dtype_bytes(trn.dtype)
    dp_group = layout.dp_group(rank0)
    dp_op: CollectiveName = "all_reduce" if par.zero == 0 else "reduce_scatter"
    t_dp = _collective_time(s, layout, dp_op, grad_bytes, dp_group, hw)
    if par.zero == 3 and par.dp * par.cp > 1 and not spec.is_moe:  # per layer (module), root
        parts = mdl.zero3_collectives(spec, s.stack)
        units = layers[busiest] * parts
        roots = zero3_collective_counts(s, busiest)["reduce_scatter"] // m - units
        unit = mdl.layer_params(spec) / par.tp * rdt / parts
        root = zero3_root_bytes(s, busiest)[0] / mdl.dtype_bytes(trn.dtype) * rdt
        t_dp = units * _collective_time(s, layout, dp_op, unit, dp_group, hw) \
            + roots * _collective_time(s, layout, dp_op, root, dp_group, hw)
    edp_group = epar.edp_group(layout, rank0, par.etp, par.ep)
    t_dp += sum(_collective_time(s, layout, dp_op, e * rdt, edp_group, hw)
                for e in expert_params)
    overlaps = hw.gpu.comm_overlaps_compute
    overlap = s.stack.overlap(par.overlap)  # blocking sends, after-backward reduce
    hidden = (b + w) / par.virtual_stages if overlap.dp and overlaps else 0.0
    t_comp = 0.0  # compression compute on the exposed path (counted as optimizer)
    # the backward the reduction overlaps runs 1/f as fast while it is in flight
    stretch = _stretch(t_dp, hidden, _interference(s, layout, dp_op, grad_bytes, dp_group, hw))
    exposed_dp = max(0.0, t_dp - hidden - stretch)
    if par.zero >= 2 and par.dp * par.cp > 1 and m > 1:
        # sharded gradients reduce after every micro-batch (the engine's data pass, FSDP2,
        # DeepSpeed's stage 2): the earlier micro-batches' reductions in line where
        # communication does not overlap compute, else beside the next micro-batch's work
        window = sum(stages[slowest]) if hidden else 0.0  # a micro-batch on the stage
        exposed_dp += (m - 1) * max(0.0, t_dp - window)
    if cmp.effective_method(s) != "none":
        stretch = 0.0
        exposed_dp, t_comp = _compressed_reduction(s, layout, hw, cost, hidden, busiest)
    t_exch, t_exch_comp = _momentum_exchange(s, layout, hw, cost, busiest)
    if not (overlap.pp and overlaps) and par.pp > 1:  # every send in line: in the steady
        # state a forward's send and the next backward's receive are one batched exchange
        # (Megatron's send_forward_recv_backward), so each stage waits for v·m transfers
        t_p2p += t_p2p / (par.pp - 1) * m / 2
    shard = params / par.tp / (par.dp * par.cp if par.zero >= 1 else 1)
    if expert_params:
        shard += sum(expert_params) / (par.edp if par.zero >= 1 else 1)
    if par.zero_offload:  # CPU Adam on the shard, then the shard back over PCIe
        host = hw.host
        t_opt = shard * layout.gpus_per_node / host.cpu_adam_params_per_s \
            + shard * mdl.dtype_bytes(trn.dtype) / (host.pcie_bandwidth_GBps * 1e9)
    else:
        runs = stage_layers(spec.layers, par, busiest)
        opt = mdl.optimizer_op_of(s, shard, runs, "all" if expert_params else "dense")
        t_opt = max(sc.op_time(opt) for sc in (cost, *stage_cost.values())) \
            + _tp_optimizer(s, layout, cost, hw, layers[busiest], busiest == par.pp - 1)
        if s.variability.slow_gpus:  # the slowest GPU's optimizer step ends the step
            t_opt *= max(_slowdown(s).values(), default=1.0)
    t_zero = (_zero3_exposed(s, layout, f, b, hw, layers[slowest], c)
              + _zero3_root(s, layout, hw)) * m if par.zero == 3 else 0.0
    fsdp_fwd, fsdp_bwd = _fsdp_copies(s, cost, busiest, layers[busiest],
                                      par.overlap.zero3_prefetch and overlaps)
    t_zero += fsdp_fwd + fsdp_bwd
    t_ddp = _ddp_copies(s, cost, busiest, layers[busiest])
    gathered = param_bytes if par.zero in (1, 2) else 0.0  # ZeRO-3 gathers at use
    t_gather = _collective_time(s, layout, "all_gather", gathered, dp_group, hw)
    if expert_params and par.zero in (1, 2):
        t_gather += _collective_time(s, layout, "all_gather",
                                     sum(expert_params) * mdl.dtype_bytes(trn.dtype), edp_group, hw)
    step = t_pipe + t_p2p + exposed_dp + stretch + t_opt + t_gather + t_zero + t_exch + t_ddp
    after = {"pp_transfer": t_p2p, "zero_transfer": t_zero - fsdp_fwd - fsdp_bwd,
             "forward": fsdp_fwd, "backward_weight": fsdp_bwd + t_ddp, "backward_input": stretch,
             "dp_transfer": exposed_dp - t_comp + t_gather + t_exch - t_exch_comp}
    if par.zero_offload:
        host = hw.host
        after["optimizer"] = shard * layout.gpus_per_node / host.cpu_adam_params_per_s \
            + t_comp + t_exch_comp
        after["offload_transfer"] = t_opt + t_comp + t_exch_comp - after["optimizer"]
    else:
        after["optimizer"] = t_opt + t_comp + t_exch_comp
    entries, bubbles = [], []
    for st in range(par.pp):
        entry: dict[str, Any] = {"rank": layout.rank(st, 0, 0), "stage": st}
        entry.update(dict.fromkeys(acc.CATEGORIES, 0.0))
        passes = _stage_passes(s, per_stage.get(st, c), t_tp, st, experts, t_cp, ends)
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
