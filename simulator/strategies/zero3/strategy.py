"""ZeRO-3 / FSDP as a strategy: its pass and its closed-form terms (each unit's gathers
beyond what prefetching hides, the root unit's, FSDP2's copies); the buffers it holds are
:mod:`simulator.strategies.zero3.buffers`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from simulator.errors import Problem
from simulator.model import transformer as mdl
from simulator.model.inventory.layer import layer_tensors
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import (
    ROOT_TENSORS,
    fsdp_gather_parts,
    fsdp_reduce_parts,
    fsdp_runtime,
    zero3_blocks,
    zero3_collectives,
)
from simulator.spec.placement import head_rank
from simulator.spec.recompute import partial, recomputed_share
from simulator.spec.scenario import Scenario
from simulator.strategies.base import Strategy
from simulator.strategies.compression.arithmetic import effective_method
from simulator.strategies.timing import collective_time, interference, stretch
from simulator.strategies.zero3.buffers import zero3_root_bytes
from simulator.strategies.zero3.counts import root_units
from simulator.strategies.zero3.deferred import (
    accumulate_ops,
    deferred,
    first_stage,
    stage_gathers,
)
from simulator.strategies.zero3.experts import (
    expert_unit_tensors,
    expert_units_sharded,
    moe_dense_reduction,
    moe_exposed,
    stage_units,
)
from simulator.strategies.zero3.workload import Zero3Pass
from simulator.system.costs import CostModel
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout
from simulator.system.units import CollectiveName

if TYPE_CHECKING:
    from simulator.builder.context import Context, Pass
    from simulator.builder.workload import BlockCosts


def fsdp_copies(s: Scenario, cost: CostModel, stage: int, layers: int,
                 on_compute_only: bool) -> tuple[float, float]:
    """(forward, backward) seconds per step of the stack's FSDP kernels around a stage's
    ZeRO-3 collectives (:func:`simulator.model.inventory.sharding.fsdp_gather_parts`,
    :func:`~simulator.model.inventory.sharding.fsdp_reduce_parts`: FSDP2's copies,
    FSDP1's casts and divisions) as the engine places them: those after each gather and
    before each reduce-scatter on the compute stream (FSDP1's cast and pre-divide too,
    which take their SMs from it: :meth:`simulator.strategies.data.workload.DataPass.fsdp_copies`);
    those on the collectives' streams (before a gather, after a reduce-scatter) only
    where those run in line (``on_compute_only`` false). A stage's ``layers`` and its
    root unit."""
    par, spec, stack = s.parallel, s.model, s.stack
    if par.zero != 3 or par.dp * par.cp == 1 or fsdp_runtime(stack) is None:
        return 0.0, 0.0
    dt = dtype_bytes(s.training.dtype)
    rdt, dp, m = stack.reduce_bytes(dt), par.shard, s.microbatches
    replicas = par.dp * par.cp // par.shard
    tensors = layer_tensors(spec, stack)
    unit = mdl.layer_params(spec) / par.tp
    root = zero3_root_bytes(s, stage)[0] / dt
    defer = deferred(s)
    fc, bc = (stage_gathers(s, first_stage(par, stage)) if defer
              else (m, m if par.reshard_after_forward else 0))  # each unit's gathers a step

    def gather(elements: float, n: int, over: int = dp) -> float:
        before, after = fsdp_gather_parts(stack, elements, over, dt, n)
        return cost.ops_time(after if on_compute_only else (*before, *after))

    later = 0 if defer else m - 1  # reductions after the first (adding to .grad)

    def reduce(elements: float, n: int) -> float:  # a step's reductions and accumulations
        def kernels(accumulate: bool) -> float:
            parts = fsdp_reduce_parts(stack, elements, dp, dt, rdt, n, accumulate, replicas)
            return cost.ops_time(parts[0] + parts[1] if on_compute_only else sum(parts, ()))

        return kernels(False) + later * kernels(True) + accumulate(elements)

    def accumulate(elements: float) -> float:  # deferred: every backward accumulates
        return cost.ops_time(accumulate_ops(s, elements, True)) \
            + (m - 1) * cost.ops_time(accumulate_ops(s, elements, False)) if defer else 0.0

    if spec.is_moe:  # each layer's dense unit by its kind, and its experts' gather
        sharded = expert_units_sharded(s)
        units = [(u.count, gather(u.dense, tensors) + (gather(
            u.experts, expert_unit_tensors(s), par.edp) if u.experts and sharded else 0.0),
            reduce(u.dense, tensors) + (accumulate(u.experts) if sharded else 0.0))
            for u in stage_units(s, stage)]
        gathers = sum(n * g for n, g, _ in units)
        fwd = fc * gathers + (1 if defer else m) * gather(root, ROOT_TENSORS)
        bwd = bc * gathers + sum(n * r for n, _, r in units) + reduce(root, ROOT_TENSORS)
        return fwd, bwd
    fwd = fc * layers * gather(unit, tensors) + (1 if defer else m) * gather(root, ROOT_TENSORS)
    bwd = bc * layers * gather(unit, tensors) + layers * reduce(unit, tensors) \
        + reduce(root, ROOT_TENSORS)
    return fwd, bwd


def zero3_root(s: Scenario, layout: Layout, hw: HardwareProfile) -> float:
    """The largest root unit's gather, once per micro-batch on its stage: it waits for
    the compute issued before it, so no prefetch hides it."""
    sizes = [zero3_root_bytes(s, st)[0] for st in {0, head_rank(s.parallel)}]
    return max(collective_time(s, layout, "all_gather", size, layout.shard_group(0), hw)
               for size in sizes)


def zero3_exposed(s: Scenario, layout: Layout, t_f: float, t_b: float,
                   hw: HardwareProfile, layers: int, c: BlockCosts,
                   stage: int = 0) -> tuple[float, float]:
    """ZeRO-3 per micro-batch, (in the forward, in the backward): each of the stage's
    ``layers`` layers' gathers (before
    forward and, resharded, before backward) beyond what the previous unit's compute
    hides when prefetched: the previous layer's, or with module units
    (:func:`simulator.model.inventory.sharding.zero3_blocks`) the previous block's; a
    mixture of experts' by pipeline ``stage``'s kinds of layer
    (:func:`simulator.strategies.zero3.experts.moe_exposed`)."""
    par, spec, trn = s.parallel, s.model, s.training
    if not layers:
        return 0.0, 0.0
    if spec.is_moe:  # layer units by kind, each with its experts' (zero3.experts)
        return moe_exposed(s, layout, hw, stage, t_f, t_b)
    blocks = zero3_blocks(spec, s.stack, par.tp, mdl.layer_params(spec) / par.tp)
    group, dt = layout.shard_group(0), dtype_bytes(trn.dtype)
    t_ag = {b: sum(collective_time(s, layout, "all_gather", e * dt, group, hw) for e in es)
            for b, es in blocks.items()}
    prefetch = par.overlap.zero3_prefetch and par.fsdp_prefetch > 0 \
        and hw.gpu.comm_overlaps_compute
    if not prefetch:
        gathers = layers * sum(t_ag.values())
        return gathers, gathers if par.reshard_after_forward else 0.0
    if len(blocks) == 1:  # a layer unit, hidden behind the layer before
        f = interference(s, layout, "all_gather", sum(blocks["attn"]) * dt, group, hw)
        fwd, bwd = layer_unit_exposed(s, layout, hw, t_ag["attn"], f, t_f / layers,
                                      t_b / layers)
        return layers * fwd, layers * bwd if par.reshard_after_forward else 0.0
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
        shared = sum(collective_time(s, layout, "reduce_scatter", e * rdt, group, hw)
                     for es in blocks.values() for e in es)
    second = t_ag["mlp"] + min(t_ag["mlp"], shared)  # attention first, recomputed
    bwd_full = max(0.0, t_ag["attn"] - bwd_blocks[0]) + max(0.0, second - lc.recompute[0])
    second = t_ag["attn"] + min(t_ag["attn"], shared)  # MLP first, then attention
    bwd_none = max(0.0, t_ag["mlp"] - bwd_blocks[0]) + max(0.0, second - bwd_blocks[1])
    if partial(par):  # the layers' average (simulator.spec.recompute)
        share = recomputed_share(par, s.model.layers)
        bwd = share * bwd_full + (1.0 - share) * bwd_none
    else:
        bwd = bwd_full if par.recompute == "full" else bwd_none
    return layers * fwd, layers * bwd if par.reshard_after_forward else 0.0


def layer_unit_exposed(s: Scenario, layout: Layout, hw: HardwareProfile, t_ag: float,
                       f: float, fwd: float, bwd: float) -> tuple[float, float]:
    """A layer unit's gather of ``t_ag`` beyond the layer before, forward and backward
    (``fwd``, ``bwd``: a layer's compute), which runs ``f`` times slower while the gather
    is in flight (strategies.timing): a layer takes max(gather, compute + stretch). One
    communicator: each gather after the reduce-scatter issued before it
    (simulator.strategies.zero3.communicator), a layer's gather and reduce-scatter one
    after the other behind its backward; the reduce-scatters' own excess is the
    reduction's (zero3_reductions)."""
    out_f = max(t_ag - fwd, stretch(t_ag, fwd, f))
    out_b = max(t_ag - bwd, stretch(t_ag, bwd, f))
    r = serial_reductions(s, layout, hw)[0]
    if r:
        out_b = max(out_b, max(0.0, t_ag + r - bwd) - max(0.0, r - bwd))
    return out_f, out_b


class Reductions(NamedTuple):
    """A stage's ZeRO-3 reductions per micro-batch (:func:`zero3_reductions`), seconds."""

    last: float  # the last micro-batch's, every unit's and the root's
    early: float  # an earlier micro-batch's
    tail: float  # the last's issued at the backward's end: its last unit's and the root's
    tail_early: float  # an earlier micro-batch's
    root: float  # the root unit's alone


def zero3_reductions(s: Scenario, layout: Layout, hw: HardwareProfile, stage: int,
                     layers: int, dp_op: CollectiveName) -> Reductions:
    """The reduction of ``stage``'s gradients per micro-batch, unit by unit: each of its
    ``layers`` layers (one collective per module with module units) and its root unit,
    over the shard group; under hybrid sharding each then all-reduces its 1/shard of
    the gradients across the replicas (:func:`hybrid_all_reduce`), on a stream of its
    own where the reduction has one (:func:`two_streams`), else in line after it; not
    before the last micro-batch under ``stack.hsdp_all_reduce: last``. The tails are
    what the backward issues at its end, its last unit's and the root's: what the compute
    stream waits for after every backward however early the others ran
    (:meth:`simulator.strategies.data.workload.DataPass.reduce_wait`). Each collective's
    time is computed once."""
    par, spec, trn = s.parallel, s.model, s.training
    rdt = s.stack.reduce_bytes(dtype_bytes(trn.dtype))
    parts = zero3_collectives(spec, s.stack)
    units = layers * parts
    roots = root_units(par, stage)
    unit = mdl.layer_params(spec) / par.tp * rdt / parts
    root = zero3_root_bytes(s, stage)[0] / dtype_bytes(trn.dtype) * rdt
    group = layout.shard_group(0)
    rs = collective_time(s, layout, dp_op, unit, group, hw), \
        collective_time(s, layout, dp_op, root, group, hw)
    if spec.is_moe:  # each layer's dense unit by its kind (no hybrid sharding with experts)
        full = moe_dense_reduction(s, layout, hw, stage) + roots * rs[1]
        return Reductions(full, full, roots * rs[1], roots * rs[1], roots * rs[1])
    hybrid = len(layout.replicate_group(0)) > 1
    ar = (hybrid_all_reduce(s, layout, hw, unit), hybrid_all_reduce(s, layout, hw, root)) \
        if hybrid else (0.0, 0.0)
    side = s.stack.overlap(par.overlap).dp and hw.gpu.comm_overlaps_compute

    def chain(n: int, last: bool) -> float:
        if not hybrid or (not last and s.stack.hsdp_all_reduce == "last"):
            return n * rs[0] + roots * rs[1]
        if not side:
            return n * (rs[0] + ar[0]) + roots * (rs[1] + ar[1])
        return two_streams([(rs[0], ar[0])] * n + [(rs[1], ar[1])] * roots)

    end = min(units, 1)
    return Reductions(chain(units, True), chain(units, False), chain(end, True),
                      chain(end, False), chain(0, True))


def two_streams(steps: list[tuple[float, float]]) -> float:
    """When the last of ``steps`` (first, second) ends, each first on one stream back to
    back and each second on another after its first and the second before it: a
    reduce-scatter's all-reduce beside the next reduce-scatter."""
    first = second = 0.0
    for a, b in steps:
        first += a
        second = max(second, first) + b
    return max(first, second)


def hybrid_all_reduce(s: Scenario, layout: Layout, hw: HardwareProfile, size: float) -> float:
    """Hybrid sharding's all-reduce after a unit's reduce-scatter of ``size`` bytes: its
    1/shard output across the replicate group (FSDP1 ``_runtime_utils._reduce_grad``,
    FSDP2 ``foreach_reduce``); zero without hybrid sharding."""
    group = layout.replicate_group(0)
    if len(group) == 1:
        return 0.0
    return collective_time(s, layout, "all_reduce", size / s.parallel.shard, group, hw)


def serial_reductions(s: Scenario, layout: Layout, hw: HardwareProfile) -> tuple[float, float]:
    """(a layer unit's reduce-scatter, the largest root unit's) where a dense model's
    layer-unit gathers, prefetched, and reduce-scatters, overlapped, run in one
    communicator's order (:mod:`simulator.strategies.zero3.communicator`); (0, 0)
    elsewhere (module units, experts, either in line: as before; reductions deferred to
    the stage's last backward, after every gather)."""
    par, spec = s.parallel, s.model
    overlaps = hw.gpu.comm_overlaps_compute
    if spec.is_moe or len(zero3_blocks(spec, s.stack, par.tp, 1.0)) > 1 or deferred(s) \
            or not (par.overlap.zero3_prefetch and par.fsdp_prefetch > 0 and overlaps
                    and s.stack.overlap(par.overlap).dp):
        return 0.0, 0.0
    dt = dtype_bytes(s.training.dtype)
    rdt, group = s.stack.reduce_bytes(dt), layout.shard_group(0)
    unit = mdl.layer_params(spec) / par.tp * rdt
    root = max(zero3_root_bytes(s, st)[0] for st in {0, head_rank(par)}) / dt * rdt
    return (collective_time(s, layout, "reduce_scatter", unit, group, hw),
            collective_time(s, layout, "reduce_scatter", root, group, hw))


class Zero3Step(NamedTuple):
    """ZeRO-3's closed-form terms of a step (:func:`zero3_step`)."""

    total: float  # exposed seconds per step, the copies included
    fsdp_fwd: float  # FSDP2's copies in forward, per step
    fsdp_bwd: float  # and in backward
    # a micro-batch's exposed layer gathers in its backward: the backward as the step
    # sees it is longer by them, and the reductions issued in it run beside them too
    bwd: float
    fwd: float  # and in its forward


def zero3_step(s: Scenario, layout: Layout, cost: CostModel, hw: HardwareProfile,
               c: BlockCosts, t_f: float, t_b: float, layers_slowest: int, busiest: int,
               layers_busiest: int, slowest: int = 0) -> Zero3Step:
    """ZeRO-3's exposed time per step, each layer's gathers beyond what prefetching
    hides and the root's, per micro-batch, on the ``slowest`` stage, with FSDP2's
    copies (on the busiest) in forward and backward, and a micro-batch's exposed
    gathers by pass."""
    par, m = s.parallel, s.microbatches
    overlaps = hw.gpu.comm_overlaps_compute
    fwd, bwd = zero3_exposed(s, layout, t_f, t_b, hw, layers_slowest, c, slowest) \
        if par.zero == 3 else (0.0, 0.0)
    if deferred(s):  # each unit gathered when not held, the root once
        fc, bc = stage_gathers(s, first_stage(par, slowest))
        t_zero = fc * fwd + bc * bwd + zero3_root(s, layout, hw)
    elif par.zero == 3:  # and the next micro-batch's gathers wait for the backward's last
        t_zero = (fwd + bwd + zero3_root(s, layout, hw)) * m \
            + (m - 1) * sum(serial_reductions(s, layout, hw))  # reduce-scatters
    else:
        t_zero = 0.0
    fsdp_fwd, fsdp_bwd = fsdp_copies(s, cost, busiest, layers_busiest,
                                     par.overlap.zero3_prefetch and overlaps)
    t_zero += fsdp_fwd + fsdp_bwd
    return Zero3Step(t_zero, fsdp_fwd, fsdp_bwd, bwd, fwd)


class Zero3(Strategy):
    name = "zero3"
    kinds = ("zero",)

    def active(self, s: Scenario) -> bool:
        return s.parallel.zero == 3 and s.parallel.dp * s.parallel.cp > 1

    def make_pass(self, ctx: Context) -> Pass | None:
        return Zero3Pass(ctx)

    def tasks_per_layer(self, s: Scenario) -> int:
        """Hybrid sharding's all-reduce after each reduce-scatter of a layer, and a
        mixture of experts' expert-unit gathers, averaged over the layers (the dense
        gathers and reduce-scatters are counted in :mod:`simulator.builder.budget`)."""
        par = s.parallel
        hybrid = par.zero == 3 and par.shard < par.dp * par.cp
        n = zero3_collectives(s.model, s.stack) if hybrid else 0
        if expert_units_sharded(s):  # a MoE layer's experts: two gathers, their copies
            per = 2 * (3 if fsdp_runtime(s.stack) else 1)
            n += -(-per * s.model.moe_layers // s.model.layers)
        return n

    def problems(self, s: Scenario) -> list[Problem]:
        """Hybrid sharding's rules: ZeRO-3 only, a divisor of dp, a shard of more than
        one rank."""
        par = s.parallel
        n = par.dp_shard
        if n is None:
            return []
        if par.zero != 3:
            return [Problem("parallel.dp_shard", n, f"hybrid sharding shards ZeRO-3's "
                            f"parameters, not zero {par.zero}'s; set zero: 3 or remove "
                            "dp_shard")]
        if par.dp % n:
            fits = [d for d in range(1, par.dp + 1) if par.dp % d == 0 and d * par.cp > 1]
            return [Problem("parallel.dp_shard", n, f"must divide parallel.dp ({par.dp}): "
                            "dp / dp_shard replicas of one shard group; choose one of "
                            f"{fits}")]
        if par.shard == 1:
            return [Problem("parallel.dp_shard", n, "shards nothing (one rank per shard "
                            "group with cp 1): that is DDP; set zero: 0 and remove "
                            "dp_shard")]
        return []

    def unsupported(self, s: Scenario) -> list[Problem]:
        """Hybrid sharding is not yet built with experts, ZeRO-Offload or gradient
        compression (each shards or reduces over the whole dp group)."""
        par = s.parallel
        if par.dp_shard is None or par.dp_shard == par.dp:
            return []
        other = [name for name, on in (("model.experts", s.model.is_moe),
                                       ("parallel.zero_offload", par.zero_offload),
                                       ("training.gradient_compression",
                                        effective_method(s) != "none")) if on]
        return [Problem("parallel.dp_shard", par.dp_shard, f"not yet simulated with {name}; "
                        "remove dp_shard (full sharding) or the other option")
                for name in other]


ZERO3 = Zero3()
