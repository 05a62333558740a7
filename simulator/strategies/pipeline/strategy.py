"""Pipeline parallelism as a strategy: the layer placement and the schedule's
requirements, the bubble warning, the fill and drain sends of the closed form, and the
search over stage counts and schedules.

Its workload is the walk itself (:class:`~simulator.strategies.pipeline.workload.PipelinePass`),
which the builder drives and every other strategy's pass hooks into, so it installs no
pass of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from simulator.errors import Problem
from simulator.model import transformer as mdl
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.memory import stage_expert_params, stage_params
from simulator.schedules import registry
from simulator.schedules.registry import requirements, schedule_spec
from simulator.spec.base import divisor_list
from simulator.spec.placement import (
    embedding_copy_params,
    head_rank,
    placement_problems,
    stage_ends,
    stage_layers,
)
from simulator.spec.scenario import Scenario
from simulator.strategies.base import AnalyticView, Dimension, Strategy
from simulator.strategies.timing import collective_time
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout


def tie_seconds(s: Scenario, layout: Layout, hw: HardwareProfile) -> float:
    """The all-reduce of the word embedding's gradient between the first stage and the
    last stage's copy (Megatron-LM ``_allreduce_word_embedding_grads``), where the last
    stage keeps one (:func:`simulator.spec.placement.embedding_copy_params`), as the pipeline pass
    issues it at the step's end; 0 elsewhere."""
    par = s.parallel
    copy = embedding_copy_params(s.model, par)
    if not copy:
        return 0.0
    size = copy / par.tp * dtype_bytes(s.training.dtype)
    group = (layout.rank(0, 0, 0, 0), layout.rank(head_rank(par), 0, 0, 0))
    return collective_time(s, layout, "all_reduce", size, group, hw)


def schedule_problems(s: Scenario, per_step: int) -> list[Problem]:
    """What the schedule's registry entry requires of pp, micro-batches and chunks."""
    par, trn = s.parallel, s.training
    m = trn.global_batch // per_step
    out = []
    for req in requirements(par.schedule, par.pp, m, par.virtual_stages):
        if req.field in ("virtual_stages", "pp"):
            out.append(Problem(f"parallel.{req.field}", getattr(par, req.field), req.text))
        elif not trn.global_batch % per_step:  # m is only meaningful when it is whole
            least = f", at least {per_step * req.least}" if req.least else ""
            out.append(Problem("training.global_batch", trn.global_batch,
                               f"{req.text}; use global_batch a multiple of "
                               f"{per_step * req.multiple}{least}"))
    return out


def pipeline_sends(s: Scenario, layout: Layout, hw: HardwareProfile, in_line: bool) -> float:
    """The pipeline's transfers on the critical path: the fill and drain, 2(p − 1)·v sends
    of a micro-batch's activations (b·s·h, /t with sequence parallelism), each with the
    profile's send sync cost as the engine's sends pay it; with every send ``in_line``
    (no overlap), also the steady state's: a forward's send and the next backward's
    receive are one batched exchange (Megatron's send_forward_recv_backward), so each
    stage waits for v·m transfers."""
    par, spec, trn = s.parallel, s.model, s.training
    if par.pp == 1:
        return 0.0
    src, dst = layout.rank(0, 0, 0), layout.rank(1, 0, 0)
    link_class = layout.link_class(src, dst)
    link = hw.link(link_class)
    nbytes = mdl.pp_activation_bytes(spec, trn.micro_batch, trn.dtype)
    if par.sequence_parallel:
        nbytes /= par.tp
    # each send also pays the sync cost after compute, as the engine's sends do
    sync = hw.gpu.send_sync_s(link_class)
    t_p2p = 2 * (par.pp - 1) * par.virtual_stages * (nbytes / link.bytes_per_s + link.alpha_s
                                                     + sync)
    if in_line:
        t_p2p += t_p2p / (par.pp - 1) * s.microbatches / 2
    return t_p2p


def copies_bytes(s: Scenario, rank: int) -> float:
    """DualPipe: the gradient bytes pipeline ``rank`` all-reduces with the other copy of
    its two model stages (on rank pp − 1 − r) before the step: its dense gradients per TP
    rank and its routed experts' per expert-parallel rank, 1/shard and 1/edp of them
    under ZeRO (the reduced shard)."""
    par = s.parallel
    runs = stage_layers(s.model.layers, par, rank)
    total = stage_params(s.model, par.pp, rank, runs, head_rank(par), stage_ends(par, rank))
    experts = stage_expert_params(s.model, par.pp, rank, runs)
    dense, routed = (total - experts) / par.tp, experts / (par.etp * par.ep)
    if par.zero >= 1:
        dense, routed = dense / par.shard, routed / par.edp
    return (dense + routed) * s.stack.reduce_bytes(dtype_bytes(s.training.dtype))


class PipelineParallel(Strategy):
    name = "pipeline"
    kinds = ("pp", "embedding_tie")

    def active(self, s: Scenario) -> bool:
        return True  # one stage is a pipeline of one: the walk runs every step

    def problems(self, s: Scenario) -> list[Problem]:
        per_step = s.training.micro_batch * s.parallel.dp
        return placement_problems(s.model.layers, s.parallel) + schedule_problems(s, per_step)

    def warnings(self, s: Scenario) -> list[str]:
        par, m = s.parallel, s.microbatches
        if par.pp == 1 or not schedule_spec(par.schedule).flush or m >= 4 * par.pp:
            return []
        bubble = (par.pp - 1) / (m + par.pp - 1)
        return [f"warning: m = {m} micro-batches for pp = {par.pp}: the bubble is "
                f"{bubble:.0%} of the step (m >= {4 * par.pp} keeps it under ~20%)"]

    def analytic_terms(self, view: AnalyticView) -> dict[str, float]:
        """DualPipe's sum of the two copies' gradients (:func:`copies_bytes`), an
        all-reduce between rank r and pp − 1 − r after the data-parallel reductions, at
        the busiest rank's size; and the tied word embedding's gradient all-reduced
        between the first and the last stage before the optimizer step, on the compute
        stream (:func:`tie_seconds`)."""
        s, lay = view.s, view.layout
        pp = s.parallel.pp
        tie = tie_seconds(s, lay, view.hw)
        if schedule_spec(s.parallel.schedule).directions != 2:
            return {"embedding_tie_transfer": tie} if tie else {}
        rank = max(range(pp), key=lambda r: copies_bytes(s, r))
        group = (lay.rank(min(rank, pp - 1 - rank), 0, 0, 0),
                 lay.rank(max(rank, pp - 1 - rank), 0, 0, 0))
        out = {"dp_transfer": collective_time(s, lay, "all_reduce", copies_bytes(s, rank),
                                              group, view.hw)}
        return {**out, "embedding_tie_transfer": tie} if tie else out

    def dimensions(self) -> tuple[Dimension, ...]:
        return (Dimension(("pp",), ("parallel.pp",), 30, _stage_counts),
                Dimension(("schedule", "virtual_stages"),
                          ("parallel.schedule", "parallel.virtual_stages"), 60, _schedules))


def _stage_counts(req: Any, base: Scenario, chosen: Mapping[str, Any]) -> Iterator[tuple[int]]:
    """PP dividing the layers, with tp · cp · pp dividing the GPUs."""
    for pp in divisor_list(base.model.layers):
        if req.gpus % (chosen["tp"] * chosen["cp"] * pp) == 0:
            yield (pp,)


def _schedules(req: Any, base: Scenario, chosen: Mapping[str, Any]) -> Iterator[tuple[str, int]]:
    """Each requested schedule; one with chunks at every virtual-stage count that gives
    each chunk whole layers; with one stage only the default (every schedule is then the
    same step)."""
    pp, layers = chosen["pp"], base.model.layers
    if pp == 1:
        if req.schedules:
            yield registry.DEFAULT_SCHEDULE, 1
        return
    for schedule in req.schedules:
        spec = schedule_spec(schedule)
        if not spec.chunked:
            yield schedule, 1
            continue
        lo, hi = spec.chunks
        k = spec.directions  # DualPipe: its two chunks are whole model stages
        for v in divisor_list(layers // pp * k):  # chunks of whole layers
            if v % k == 0 and v >= lo and (hi is None or v <= hi):
                yield schedule, v


PIPELINE = PipelineParallel()
