"""Workload: per-rank programs of tasks for one training step, from a scenario.

A program is, per simulated rank, an ordered list of
:class:`~simulator.tasks.Task` per stream (``compute``, ``pp``, ``dp``,
``zero``, ``host``). A task is compute (a fixed duration priced by the cost
model), a collective over a group (a :class:`~simulator.collectives.Plan`), or
a point-to-point transfer. Cross-stream and cross-rank dependencies are task
ids. Everything here is plain data: the engine runs it, tests inspect it.

This module prices one layer's blocks (:func:`block_costs`, from
:mod:`simulator.model`'s per-layer ops and the cost model) and hands the
scenario to the passes of :mod:`simulator.passes`, one per strategy, which
follow Megatron-LM's execution:

- pipeline (:mod:`simulator.passes.pipeline`): the schedule's F/B/I/W actions
  as per-layer compute blocks (attention, MLP) with recomputation, p2p sends
  on the ``pp`` stream, the tied embedding's all-reduce;
- tensor (:mod:`simulator.passes.tensor`): TP collectives around blocks, the
  vocab-parallel ends and the loss, on the compute stream;
- data (:mod:`simulator.passes.data`): DDP buckets, ZeRO-1/2 reduce-scatters
  and parameter all-gathers, ZeRO-3 / FSDP unit gathers with prefetch, the
  optimizer step;
- offload (:mod:`simulator.passes.offload`): ZeRO-Offload's PCIe copies and
  CPU Adam on the ``host`` stream.

A profile whose device cannot overlap communication with compute
(``gpu.comm_overlaps_compute: false``, a CPU process) runs every transfer on
the compute stream, whatever ``parallel.overlap`` asks. Symmetry folding builds
programs for one representative per stage; its collectives carry their full
group's plan and its flows stand for every rank of its class on shared links
(``Workload.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simulator import model as mdl
from simulator.costs import CostModel
from simulator.layout import Layout
from simulator.passes import build_programs
from simulator.passes.context import Context
from simulator.passes.data import OPTIMIZER_BYTES_PER_PARAM
from simulator.scenario import Scenario
from simulator.schedules import build_schedule
from simulator.tasks import Workload

__all__ = ["OPTIMIZER_BYTES_PER_PARAM", "BlockCosts", "block_costs", "build_workload"]


@dataclass(frozen=True)
class BlockCosts:
    """Seconds for one layer's blocks on one TP rank, per micro-batch."""

    fwd: tuple[float, float]  # (attention block, MLP block)
    bwd_input: tuple[float, float]
    bwd_weight: tuple[float, float]
    recompute: tuple[float, float]
    embed: tuple[float, float, float]  # fwd, bwd_input, bwd_weight
    head: tuple[float, float, float]


def _split(ops: tuple[mdl.Op, ...], cost: CostModel, forward_order: bool) -> tuple[float, float]:
    names = [op.name for op in ops]
    cut = names.index("ln2") if forward_order else names.index("ln2") + 1
    first, second = cost.ops_time(ops[:cut]), cost.ops_time(ops[cut:])
    return (first, second) if forward_order else (second, first)


def block_costs(s: Scenario, cost: CostModel) -> BlockCosts:
    spec, b, tp, sp, dt = (s.model, s.training.micro_batch, s.parallel.tp,
                           s.parallel.sequence_parallel, s.training.dtype)
    fwd = mdl.layer_ops(spec, b, tp, sp, dt, "fwd")
    bwd_i = mdl.layer_ops(spec, b, tp, sp, dt, "bwd_input")
    bwd_w = mdl.layer_ops(spec, b, tp, sp, dt, "bwd_weight")
    w_names = [op.name for op in bwd_w]
    w_attn = cost.ops_time([op for op in bwd_w if op.name in ("qkv", "out_proj")])
    w_mlp = cost.ops_time([op for op in bwd_w if op.name not in ("qkv", "out_proj")])
    assert "qkv" in w_names
    rec = mdl.layer_recompute_ops(spec, b, tp, sp, dt, s.parallel.recompute)
    full = s.parallel.recompute == "full"
    rec_t = _split(rec, cost, True) if full else (cost.ops_time(rec), 0.0)

    def three(fn: Any) -> tuple[float, float, float]:
        return tuple(cost.ops_time(fn(spec, b, tp, sp, dt, p)) for p in mdl.PASSES)  # type: ignore[return-value]

    return BlockCosts(_split(fwd, cost, True), _split(bwd_i, cost, False), (w_attn, w_mlp),
                      rec_t, three(mdl.embedding_ops), three(mdl.head_ops))


def build_workload(s: Scenario, layout: Layout | None = None, cost: CostModel | None = None,
                   costs: BlockCosts | None = None, fidelity: str | None = None) -> Workload:
    """Per-rank programs for one training step. ``costs`` may be given to price blocks
    differently (tests make stages exactly balanced this way)."""
    layout = layout or Layout(s.parallel.tp, s.parallel.pp, s.parallel.dp,
                              s.cluster.gpus_per_node or 1)
    cost = cost or CostModel(s.hardware, s.training.dtype)
    costs = costs or block_costs(s, cost)
    fidelity = fidelity or s.simulation.fidelity
    schedule = build_schedule(s.parallel.schedule, s.parallel.pp, s.microbatches,
                              s.parallel.virtual_stages)
    ranks = layout.representatives() if fidelity == "folded" else tuple(range(layout.world))
    ctx = Context(s, layout, cost, costs, schedule, ranks)
    build_programs(ctx)
    weight = float(s.parallel.tp * s.parallel.dp) if fidelity == "folded" else 1.0
    return Workload(ctx.programs, ctx.tasks, layout, schedule, weight, fidelity)
