"""ZeRO-3 under ``torch.distributed.pipelining``: FSDP2's reductions deferred to each
stage's last backward.

The pipelining stage runs every backward of an FSDP2 module with gradient sync and
resharding after backward off (torch/distributed/pipelining/stage.py
``backward_maybe_with_nosync``: ``set_is_last_backward(False)``,
``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``). After a
stage's last backward the schedule's ``REDUCE_GRAD`` action (schedules.py
``_add_reduce_grad``: "just after the last backward-like stage"; the single-stage
schedules call it at the end of their step) runs ``perform_reduce_grad``: every FSDP
parameter group's ``post_backward`` in the order the states were made (the stage
module's root unit, then its blocks), each reduce-scattering its gradients, then
``_root_post_backward_final_callback``, which makes the compute stream wait for them.
So on a stage:

- a unit is all-gathered when first used and stays gathered while no forward reshards
  it (``reshard_after_forward``, which torchtitan turns off under pipeline parallelism:
  ``fsdp_reshard_after_forward = "default"``); with it, each forward reshards and the
  next backward gathers again (:func:`gathers`);
- each backward leaves its unsharded gradients accumulated in the reduce dtype
  (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``to_accumulated_grad_if_needed``,
  a cast on the first backward, ``accumulate_unsharded_grad_if_needed``, an add, on the
  later ones; in the parameters' dtype, autograd's own accumulation, when the two agree);
- the stage's reduce-scatters run once a step, after its last backward, beside nothing
  of that stage's backward, and the compute stream waits for them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from simulator.model.inventory.ops import Op, dtype_bytes, mem
from simulator.model.inventory.sharding import fsdp_runtime, fsdp_task_name
from simulator.schedules.action import Action, stage_rank
from simulator.schedules.registry import build_schedule, schedule_spec
from simulator.spec.placement import rank_virtual_stages
from simulator.spec.scenario import ParallelSpec, Scenario

if TYPE_CHECKING:
    from simulator.builder.context import Context
    from simulator.builder.tasks import Task


def deferred(s: Scenario) -> bool:
    """Whether ``s`` runs FSDP2 (ZeRO-3 by layer units, the stack's FSDP runtime
    FSDP2's) under ``torch.distributed.pipelining``, which defers its reductions to each
    stage's last backward. FSDP1's module is not an ``FSDPModule``: the stage runs its
    backward as it is, reducing every micro-batch. DeepSeek's two-direction DualPipe is
    not one of torch's schedules (its ``ScheduleDualPipeV`` is the V placement: ``zbv``)."""
    par = s.parallel
    return par.zero == 3 and par.pp > 1 and par.dp * par.cp > 1 \
        and s.stack.pipeline_runtime == "torch" and s.stack.zero3_unit == "layer" \
        and fsdp_runtime(s.stack) == "fsdp2" and schedule_spec(par.schedule).directions == 1


def gathers(kinds: Iterable[str], reshard_after_forward: bool) -> tuple[int, int]:
    """(forward, backward) all-gathers of one unit of a stage whose actions run
    ``kinds`` (F, B, I, W) in order: a pass gathers the unit when it is not gathered;
    a forward leaves it gathered unless ``reshard_after_forward``; a backward always
    does (resharding after backward is off)."""
    held, fwd, bwd = False, 0, 0
    for kind in kinds:
        if kind == "W":  # the weight gradients read saved inputs, not the parameters
            continue
        if not held:
            fwd, bwd = fwd + (kind == "F"), bwd + (kind != "F")
        held = kind != "F" or not reshard_after_forward
    return fwd, bwd


def stage_actions(s: Scenario, stage: int) -> list[Action]:
    """Virtual ``stage``'s actions in its rank's order."""
    par = s.parallel
    return list(_stage_actions(par.schedule, par.pp, s.microbatches, par.virtual_stages,
                               stage))


@functools.lru_cache(maxsize=256)
def _stage_actions(schedule: str, p: int, m: int, v: int, stage: int) -> tuple[Action, ...]:
    sched = build_schedule(schedule, p, m, v)
    rank = stage_rank(sched.placement, p, v, stage)
    return tuple(a for a in sched.actions[rank] if a.stage == stage)


def first_stage(par: ParallelSpec, rank: int) -> int:
    """The first virtual stage pipeline ``rank`` holds."""
    return rank_virtual_stages(par, rank)[0]


def stage_gathers(s: Scenario, stage: int) -> tuple[int, int]:
    """(forward, backward) all-gathers per step of each layer unit of virtual
    ``stage`` (:func:`gathers` over its actions): one, before the stage's first action (a
    forward), where no forward reshards; else by the walk (the schedule built once)."""
    if not s.parallel.reshard_after_forward:
        return 1, 0
    return gathers([a.kind for a in stage_actions(s, stage)], True)


def accumulate_ops(s: Scenario, elements: float, first: bool) -> tuple[Op, ...]:
    """The kernels one backward adds to a unit's ``elements`` unsharded gradients when
    gradient sync is off: on the ``first`` backward a cast of the fresh 16-bit gradients
    into the reduce dtype where that differs; on the later ones an add of them into the
    accumulated ones (autograd's own, in the parameters' dtype, when the dtypes agree)."""
    dt = dtype_bytes(s.training.dtype)
    rdt = s.stack.reduce_bytes(dt)
    if first:
        return (mem("fsdp_grad_to_reduce_dtype", elements, dt + rdt, "copy"),) \
            if rdt != dt else ()
    return (mem("fsdp_grad_accumulate", elements, dt + 2 * rdt, "elementwise"),)


def accumulate_after(ctx: Context, rank: int, after: Task, elements: float, fresh: bool,
                     mb: int, unit: str = "", where: str = "") -> None:
    """One backward's accumulation of a unit's ``elements`` unsharded gradients
    (:func:`accumulate_ops`; the stage's ``fresh`` first backward casts), a task on the
    compute stream right after ``after``, the task that completes them, named
    ``fsdp.{unit}{kernel}{where} mb{mb}``; none where nothing runs."""
    ops = accumulate_ops(ctx.s, elements, fresh)
    if not ops or elements <= 0:
        return
    t = ctx.compute_after(rank, after, "Z", "backward",
                          f"fsdp.{unit}{fsdp_task_name(ops)}{where} mb{mb}",
                          ctx.cost_of(rank).ops_time(ops))
    t.weight_s = t.duration  # gradient work: the backward's weight share


def deferred_exposed(t_dp: float, backward: float, v: int, overlapped: bool) -> float:
    """Seconds a rank's deferred reductions (``t_dp``, all its ``v`` chunks', one stream)
    add to its step: its last chunk's share alone after the rank's last backward; the
    other chunks', issued earlier, beyond the one chunk's backward (``backward`` / v of
    the rank's micro-batch backward) that at least separates their issue from it. All
    of them where the reductions run in line with compute (not ``overlapped``)."""
    if not overlapped or v == 1:
        return t_dp
    last = t_dp / v
    return last + max(0.0, t_dp - last - backward / v)
