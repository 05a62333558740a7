"""One micro-batch through a pipeline stage in closed form, and the pipeline phase.

Per micro-batch and stage, compute comes from the same block costs the engine uses
(roofline × efficiency); TP collectives add their uncontended α-β time on the critical
path, a mixture of experts its routed experts and all-to-alls, context parallelism its
exposed key/value exchange. The pipeline then takes the schedule's closed form at the
slowest stage's times (the schedule registry's ``pipeline_time``); an uneven layer
placement gives every virtual stage its own times and the schedule's actions are placed
in time with them (:func:`simulator.schedules.action.execute`).
"""

from __future__ import annotations

from simulator.builder.workload import BlockCosts, layout_of
from simulator.model import moe
from simulator.model.inventory.recompute_comm import BLOCKS, Reissue, reissued
from simulator.model.inventory.tensor_parallel import tp_block_collectives
from simulator.schedules.action import execute
from simulator.schedules.registry import build_schedule, schedule_spec
from simulator.spec.placement import (
    chunk_layers,
    holds_embedding,
    holds_head,
    is_even,
    stage_layers,
)
from simulator.spec.recompute import Policy, chunks_alike, mode_runs
from simulator.spec.scenario import Scenario
from simulator.spec.variability import resolve
from simulator.strategies.expert.strategy import NO_EXPERTS, Experts
from simulator.strategies.tensor.overlap import exposed
from simulator.strategies.tensor.strategy import NO_ENDS, Ends

EXECUTED_ACTIONS = 1_000_000  # an uneven pipeline this large takes the closed form instead
Kinds = list[tuple[int, int, Policy]]  # (a layer, how many like it, their recompute)

#: of :func:`passes`' transfer seconds, those the recomputation issues again (full
#: recomputation's whole forward, or what a finer policy's recomputed blocks hold): they run
#: inside the backward (:func:`times` leaves them out of the forward's share; not a category)
AGAIN = "reissued_transfer"


def layer_kinds_of(s: Scenario, runs: list[range]) -> Kinds:
    """(a representative layer, how many like it, their recompute mode) over the layer
    ``runs`` (:func:`simulator.spec.recompute.mode_runs`)."""
    out: Kinds = []
    for mode, rs in mode_runs(s.parallel, s.model.layers, runs):
        if not s.model.is_moe:
            out.append((0, sum(len(r) for r in rs), mode))
        else:
            out += [(i, n, mode) for r in rs for i, n in moe.run_kinds(s.model, r)]
    return out


def chunk_kinds(s: Scenario, stage: int) -> Kinds:
    """(a representative layer, how many like it) on pipeline rank ``stage``, all chunks."""
    return layer_kinds_of(s, stage_layers(s.model.layers, s.parallel, stage,
                                             s.model.mtp_layers))


def passes(s: Scenario, c: BlockCosts, t_tp: float, kinds: Kinds,
            first: bool, last: bool, experts: Experts = NO_EXPERTS,
            t_cp: float = 0.0, chunks: int = 1, ends: Ends = NO_ENDS,
            t_cp_again: float = 0.0) -> dict[str, float]:
    """Seconds of one micro-batch through the layers ``kinds`` (with the embedding when
    ``first``, the output layer when ``last``), by category: forward, backward_input,
    backward_weight, recompute, tp_transfer and ep_transfer, and under :data:`AGAIN`
    the part of the transfers the recomputation issues again. ``experts``: a MoE
    layer's routed experts forward and input-gradient seconds, one ep exchange's and
    one expert-TP collective's, and under shared-expert overlap the shared experts'
    compute and the exchange seconds it hides
    (:func:`simulator.strategies.expert.strategy.expert_times`). ``t_cp``: a layer's exposed
    context-parallel exchange, all passes, and ``t_cp_again`` of it what a finer policy's
    recomputed core exchanges again
    (:func:`simulator.strategies.context.strategy.cp_exposed`). ``ends``: the TP
    collectives at the embedding and the output layer (:func:`_tp_ends`)."""
    par, spec = s.parallel, s.model
    out = dict.fromkeys(("forward", "backward_input", "backward_weight", "recompute",
                         "tp_transfer", "ep_transfer", "cp_transfer", AGAIN), 0.0)
    for layer, count, mode in kinds:
        lc = c.layer(layer)
        again = reissued(mode, spec.is_moe_layer(layer), par.sequence_parallel)
        tp, split = _tp_layer(s, c, t_tp, again)
        out["forward"] += count * sum(lc.fwd)
        out["backward_input"] += count * sum(lc.bwd_input)
        out["backward_weight"] += count * sum(lc.bwd_weight)
        out["recompute"] += count * sum(lc.recompute) if mode != "none" else 0.0
        out["tp_transfer"] += count * tp[0]
        out["forward"] += count * split[0]
        out["recompute"] += count * split[1]
        out["backward_input"] += count * split[2]
        out["cp_transfer"] += count * t_cp
        # what the recomputation issues again sits in the backward (the CP share, like
        # t_cp, is the layers' mean under partial recomputation)
        out[AGAIN] += count * (tp[1] + t_cp_again)
        if spec.is_moe_layer(layer):
            _experts(out, count, experts, "mlp" in again.blocks)
    _ends(s, c, first, last, ends, out)
    out["forward"] += chunks * c.action  # the pipeline runtime's host time per action
    out["backward_input"] += chunks * c.action
    return out


def _tp_layer(s: Scenario, c: BlockCosts, t_tp: float, again: Reissue
              ) -> tuple[tuple[float, float], tuple[float, float, float]]:
    """One layer's TP seconds (all passes, and of them what the recomputation issues
    again) and what TP overlap's chunked GEMMs add to the forward, the recomputation and
    the backward (:func:`exposed`). ``again``
    (:func:`simulator.model.inventory.recompute_comm.reissued`): its whole blocks'
    collectives as the forward's, a lone gather or all-reduce in line."""
    par, spec = s.parallel, s.model
    sp = par.sequence_parallel

    def count(labels: tuple[str, ...], backward: bool) -> int:
        return sum(tp_block_collectives(spec, s.stack, par.tp, sp, label, backward)
                   + (1 if sp else 0) for label in labels)

    alone = len(again.gathers) if sp else sum(
        tp_block_collectives(spec, s.stack, par.tp, sp, label, False)
        for label in again.reduces)
    n_again = count(again.blocks, False) + alone
    if not c.tp_windows:
        return ((t_tp * (count(BLOCKS, False) + n_again + count(BLOCKS, True)),
                 t_tp * n_again), (0.0, 0.0, 0.0))
    mode, issue = s.stack.tp_overlap, c.tp_issue
    comm_f, split_f = exposed(mode, c.tp_windows, t_tp, False, issue=issue, sp=sp)
    comm_r, split_r = exposed(mode, c.tp_windows, t_tp, False, issue=issue,
                              labels=again.blocks, sp=sp)
    comm_b, split_b = exposed(mode, c.tp_windows, t_tp, True,
                              weights=not schedule_spec(par.schedule).split_backward,
                              issue=issue, sp=sp)
    comm_r += t_tp * alone
    return (comm_f + comm_r + comm_b, comm_r), (split_f, split_r, split_b)


def _experts(out: dict[str, float], count: int, x: Experts, again: bool) -> None:
    """A MoE layer's routed experts, exchanges and expert-TP collectives, forward and
    backward, and again before the backward when the layer's MoE block is recomputed
    whole (``again``: full recomputation or Megatron's ``moe``)."""
    fwd = x.fwd + x.shared_fwd + x.stretch_fwd
    bwd = x.bwd + x.shared_bwd + x.stretch_bwd
    passes = 3 if again else 2
    out["forward"] += count * fwd
    out["backward_input"] += count * bwd
    out["recompute"] += count * fwd if again else 0.0
    ep = count * (2 * x.a2a * passes - x.hidden_fwd * (passes - 1) - x.hidden_bwd)
    etp = count * 2 * x.etp * passes
    out["ep_transfer"] += ep
    out["tp_transfer"] += etp
    if again:
        out[AGAIN] += count * (2 * x.a2a - x.hidden_fwd + 2 * x.etp)


def _ends(s: Scenario, c: BlockCosts, first: bool, last: bool, ends: Ends,
          out: dict[str, float]) -> None:
    """Add the embedding's (when ``first``) and the output layer's (when ``last``) passes
    and TP collectives to ``out``, and each multi-token prediction module's ends."""
    for end, present, tp in ((c.embed, first, ends[:2]), (c.head, last, ends[2:4])):
        if present:
            out["forward"] += end[0]
            out["backward_input"] += end[1]
            out["backward_weight"] += end[2]
            out["tp_transfer"] += sum(tp)
    if last:  # the trainer's metric updates after the backward: forward work on the logits
        out["forward"] += c.metrics
    spec, par = s.model, s.parallel
    if last and spec.mtp_layers:  # each MTP module's ends: an embedding and a head again
        n = spec.mtp_layers
        out["forward"] += n * c.mtp[0]
        out["backward_input"] += n * c.mtp[1]
        out["backward_weight"] += n * c.mtp[2]
        out["tp_transfer"] += n * sum(ends)  # the ends' again and the projection's
        if par.recompute == "full":  # the input side again, its projection's gathers too
            out["recompute"] += n * c.mtp_recompute
            out["tp_transfer"] += n * ends[4]
            out[AGAIN] += n * ends[4]


def stage_passes(s: Scenario, c: BlockCosts, t_tp: float, stage: int,
                  experts: Experts = NO_EXPERTS, t_cp: float = 0.0,
                  ends: Ends = NO_ENDS, t_cp_again: float = 0.0) -> dict[str, float]:
    """:func:`passes` of one micro-batch through pipeline ``stage``: all its chunks, or
    with two directions (DualPipe, each micro-batch through one of the rank's two model
    stages) their mean."""
    d = slowed(s, passes(s, c, t_tp, chunk_kinds(s, stage),
                         holds_embedding(s.parallel, stage),
                         holds_head(s.parallel, stage), experts, t_cp,
                         s.parallel.virtual_stages, ends, t_cp_again), stage)
    directions = schedule_spec(s.parallel.schedule).directions
    return d if directions == 1 else {k: v / directions for k, v in d.items()}


def slowdown(s: Scenario) -> dict[int, float]:
    """Per pipeline stage, the largest compute factor of its ranks
    (``variability.slow_gpus``)."""
    layout = layout_of(s)
    out: dict[int, float] = {}
    for rank, f in resolve(s.variability, layout.world).compute.items():
        st = layout.coord(rank).pp
        out[st] = max(out.get(st, 1.0), f)
    return out


def slowed(s: Scenario, d: dict[str, float], stage: int) -> dict[str, float]:
    """Passes ``d`` at the pace of the stage's slowest GPU: its TP and DP peers wait
    for it (communication keeps its time)."""
    slow = slowdown(s).get(stage, 1.0) if s.variability.slow_gpus else 1.0
    if slow == 1.0:
        return d
    return {k: v if k.endswith("_transfer") else v * slow for k, v in d.items()}


def times(d: dict[str, float]) -> tuple[float, float, float]:
    """(t_F, t_B_input, t_W) of passes ``d``; TP, EP and CP communication and recompute
    count in the pass they sit in: the forward's share is half of what a step without
    recomputation exchanges, and what the recomputed forwards add
    (:data:`AGAIN`) runs with them inside the backward, so recomputing adds to the
    backward alone and never moves the forward's own work into it."""
    comm = d["tp_transfer"] + d["ep_transfer"] + d["cp_transfer"]
    comm_f = (comm - d.get(AGAIN, 0.0)) / 2
    return (d["forward"] + comm_f, d["backward_input"] + d["recompute"] + comm - comm_f,
            d["backward_weight"])


def stage_times(s: Scenario, c: BlockCosts, t_tp: float, stage: int,
                 experts: Experts = NO_EXPERTS, t_cp: float = 0.0,
                 ends: Ends = NO_ENDS, t_cp_again: float = 0.0) -> tuple[float, ...]:
    """(t_F, t_B_input, t_W) of one micro-batch through the whole stage (all chunks)."""
    return times(stage_passes(s, c, t_tp, stage, experts, t_cp, ends, t_cp_again))


def every_stage_times(s: Scenario, c: BlockCosts, t_tp: float, experts: Experts,
                      t_cp: float, ends: Ends, per_stage: dict[int, BlockCosts],
                      t_cp_again: float = 0.0) -> list[tuple[float, ...]]:
    """:func:`stage_times` of every pipeline rank, each computed once per distinct rank:
    a rank's times read only its layers' kinds (:func:`chunk_kinds`), whether it holds
    the embedding and the output layer, its blocks (``per_stage``, a mixed-generation
    cluster) and its pace (``variability.slow_gpus``), so the middle ranks of a deep
    pipeline share theirs."""
    par = s.parallel
    if per_stage or s.variability.slow_gpus:
        return [stage_times(s, per_stage.get(st, c), t_tp, st, experts, t_cp, ends,
                            t_cp_again) for st in range(par.pp)]
    alike: dict[tuple[object, ...], tuple[float, ...]] = {}
    out = []
    for st in range(par.pp):
        key = (*chunk_kinds(s, st), holds_embedding(par, st), holds_head(par, st))
        if key not in alike:
            alike[key] = stage_times(s, c, t_tp, st, experts, t_cp, ends, t_cp_again)
        out.append(alike[key])
    return out


def pipeline_phase(s: Scenario, c: BlockCosts, t_tp: float, experts: Experts, t_cp: float,
                    slowest: tuple[float, ...],
                    per_stage: dict[int, BlockCosts] | None = None,
                    ends: Ends = NO_ENDS, t_cp_again: float = 0.0) -> float:
    """The pipeline phase: the schedule's closed form at the slowest stage's times for an
    even placement; for an uneven one (:mod:`simulator.spec.placement`), or layers recomputed
    in some chunks only, the schedule's actions placed in time with each virtual stage's own
    times
    (:func:`simulator.schedules.action.execute`, exact with free communication), or the
    closed form, an upper bound, when the pipeline has more than :data:`EXECUTED_ACTIONS`
    actions."""
    par, m = s.parallel, s.microbatches
    closed = pipeline_time(par.schedule, par.pp, m, par.virtual_stages, *slowest)
    n = par.pp * par.virtual_stages
    # multi-token prediction layers make the last stage's chunk longer than the others
    alike = is_even(par) and chunks_alike(par, s.model.layers) and not s.model.mtp_layers
    if (alike and not per_stage) or 3 * n * m > EXECUTED_ACTIONS:
        return closed
    per_stage = per_stage or {}
    runs = [[chunk_layers(s.model.layers, par, k, s.model.mtp_layers)] for k in range(n)]
    sched = build_schedule(par.schedule, par.pp, m, par.virtual_stages)
    kinds = [layer_kinds_of(s, runs[k]) for k in range(n)]
    chunks = [times(slowed(s, passes(s, per_stage.get(sched.rank_of(k), c), t_tp,
                                        kinds[k], sched.is_first(k), sched.is_last(k),
                                        experts, t_cp, 1, ends, t_cp_again),
                                 sched.rank_of(k)))
              for k in range(n)]
    timed = execute(sched, [x[0] for x in chunks], [x[1] for x in chunks],
                    [x[2] for x in chunks])
    return max(x.end for x in timed) - min(x.start for x in timed)


def pipeline_time(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Closed-form pipeline phase for stage times (t_F, t_B, t_W) per micro-batch: the
    schedule registry's (:data:`simulator.schedules.registry.SCHEDULES`)."""
    return schedule_spec(schedule).pipeline_time(p, m, v, f, b, w)
