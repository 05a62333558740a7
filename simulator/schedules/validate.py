"""A schedule's consistency: placement, one F and one B (or I and W) per stage and
micro-batch, dependencies in order on each rank, and no deadlock.
"""

from __future__ import annotations

from collections import Counter

from simulator.schedules.action import Schedule, dependencies, execute


def _check_placement(schedule: Schedule) -> None:
    for rank, order in enumerate(schedule.actions):
        for action in order:
            if action.stage >= schedule.total_stages or schedule.rank_of(action.stage) != rank:
                raise ValueError(f"rank {rank} runs {action}, whose stage is not on that rank")
            if action.microbatch >= schedule.microbatches:
                raise ValueError(f"{action}: micro-batch outside 0..{schedule.microbatches - 1}")


def _check_counts(schedule: Schedule) -> None:
    counts = Counter((a.stage, a.kind, a.microbatch) for rank in schedule.actions for a in rank)
    for mb in range(schedule.microbatches):
        for stage in range(schedule.total_stages):
            if stage not in schedule.route(mb):
                if any(counts[stage, kind, mb] for kind in ("F", "B", "I", "W")):
                    raise ValueError(f"stage {stage} runs micro-batch {mb}, which does not "
                                     "pass through it")
                continue
            f, b, i, w = (counts[stage, kind, mb] for kind in ("F", "B", "I", "W"))
            if f != 1:
                raise ValueError(f"stage {stage} micro-batch {mb} has {f} F actions, expected 1")
            if (b, i, w) not in ((1, 0, 0), (0, 1, 1)):
                raise ValueError(
                    f"stage {stage} micro-batch {mb} has B={b}, I={i}, W={w}; "
                    "expected one B, or one I and one W"
                )


def _check_rank_order(schedule: Schedule) -> None:
    present = {a for rank in schedule.actions for a in rank}
    for rank, order in enumerate(schedule.actions):
        index = {action: i for i, action in enumerate(order)}
        for i, action in enumerate(order):
            for dep in dependencies(action, schedule.route(action.microbatch), present):
                if index.get(dep, -1) > i:
                    raise ValueError(f"rank {rank} runs {action} before its dependency {dep}")


def validate(schedule: Schedule) -> None:
    """Raise ValueError describing the first problem of ``schedule``, if any.

    Checks placement, exactly one F and one B (or one I and one W) per stage and
    micro-batch, dependencies on the same rank in order, and no deadlock.
    """
    _check_placement(schedule)
    _check_counts(schedule)
    _check_rank_order(schedule)
    execute(schedule)
