"""How many collectives ZeRO-3 / FSDP issues per step on one rank of a pipeline stage, as
the engine's workload issues them (:mod:`simulator.strategies.zero3.workload`,
:mod:`simulator.strategies.data.workload`).
"""

from __future__ import annotations

from simulator.model import moe
from simulator.model.inventory.sharding import zero3_collectives
from simulator.schedules.registry import schedule_spec
from simulator.spec.placement import (
    chunk_layers,
    holds_embedding,
    holds_head,
    rank_virtual_stages,
    stage_layer_count,
)
from simulator.spec.scenario import ParallelSpec, Scenario
from simulator.strategies.data.grad_norm import grad_norm_reduced
from simulator.strategies.zero3.deferred import deferred, stage_gathers
from simulator.strategies.zero3.experts import expert_units_sharded, stage_expert_units


def zero3_collective_counts(s: Scenario, stage: int) -> dict[str, int]:
    """ZeRO-3's collectives per step on one rank of pipeline ``stage``, as the engine's
    workload issues them: per micro-batch, each layer's gathers (before its forward
    and, with ``reshard_after_forward``, before its backward) and reduce-scatter, one
    per part (:func:`simulator.model.inventory.sharding.zero3_collectives`), and the root unit's
    gather
    and reduce-scatter on a stage holding the embedding or the head (FSDP2 keeps the
    root gathered from its forward to its backward). A step of FSDP2 with L layers on
    one stage: m(1 + 2L) all-gathers, m(1 + L) reduce-scatters; a DualPipe rank runs
    each micro-batch through one of its two stages (half its layers a micro-batch).
    Under hybrid sharding
    (:attr:`~simulator.spec.scenario.ParallelSpec.dp_shard`) each reduce-scatter is
    followed by an all-reduce of its shard across the replicas. A mixture of experts
    adds each MoE layer's experts unit (:mod:`simulator.strategies.zero3.experts`),
    gathered like its layer and reduce-scattered over edp every micro-batch. With
    ``stack.grad_clip`` the step all-reduces the clipping norm over the shard group once
    (:mod:`simulator.strategies.data.grad_norm`)."""
    par = s.parallel
    if par.zero != 3 or par.dp * par.cp == 1:
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    parts = zero3_collectives(s.model, s.stack)
    layers = stage_layer_count(s.model.layers, par, stage, s.model.mtp_layers) * parts
    experts = stage_expert_units(s, stage)
    root = root_units(par, stage)
    norm = 1 if grad_norm_reduced(s) and par.shard > 1 else 0  # the clipping norm's
    if deferred(s):  # once a step: gathered at first use, reduced after the last backward
        return {"all_gather": deferred_gathers(s, stage, parts) + root,
                "reduce_scatter": layers + root + experts,
                "all_reduce": norm + (layers + root if par.shard < par.dp * par.cp else 0)}
    m = s.microbatches
    # each micro-batch runs one of a DualPipe rank's two stages (one a direction)
    share = schedule_spec(par.schedule).directions
    gathers = (2 if par.reshard_after_forward else 1) * m * (layers + experts) // share \
        + m * root
    reduces = m * layers // share + m * root
    once = s.stack.hsdp_all_reduce == "last"  # the last micro-batch's reduce-scatters only
    return {"all_gather": gathers,
            "reduce_scatter": reduces + m * experts // share,
            "all_reduce": norm + ((layers + root if once else reduces)
                                  if par.shard < par.dp * par.cp else 0)}


def deferred_gathers(s: Scenario, rank: int, parts: int) -> int:
    """All-gathers per step of pipeline ``rank``'s layer units (``parts`` collectives a
    layer) and MoE expert units where its reductions are deferred
    (:func:`simulator.strategies.zero3.deferred.stage_gathers`, by virtual stage)."""
    spec, par = s.model, s.parallel
    total = 0
    for vs in rank_virtual_stages(par, rank):
        run = chunk_layers(spec.layers, par, vs, spec.mtp_layers)
        experts = sum(1 for i in run if moe.expert_params(spec, i)) \
            if expert_units_sharded(s) else 0
        total += sum(stage_gathers(s, vs)) * (len(run) * parts + experts)
    return total


def root_units(par: ParallelSpec, rank: int) -> int:
    """FSDP2 root units on pipeline ``rank``: its virtual stages holding the embedding
    (the first) or the output layer (the last), each stage module its own root; two on
    the first rank under a V placement (ZBV), one where a single stage holds both. With
    two directions (DualPipe) one, on the end ranks."""
    if schedule_spec(par.schedule).directions == 2:
        return 1 if holds_embedding(par, rank) or holds_head(par, rank) else 0
    ends = ({0} if holds_embedding(par, rank) else set()) \
        | ({par.pp * par.virtual_stages - 1} if holds_head(par, rank) else set())
    return len(ends)
