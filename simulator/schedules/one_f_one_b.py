"""1F1B (PipeDream-flush, Narayanan et al. 2021): p − rank − 1 warm-up forwards, then
one forward and one backward in turn, then the drain.
"""

from __future__ import annotations

from simulator.schedules.action import Action, Schedule, check_sizes
from simulator.schedules.spec import ScheduleSpec, flush_time, until_backward


def _one_f_one_b_rank(rank: int, p: int, m: int) -> tuple[Action, ...]:
    warmup = min(p - rank - 1, m)
    order = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    order += [Action(rank, "B", i) for i in range(m - warmup, m)]
    return tuple(order)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): p - rank - 1 warm-up forwards, then F/B pairs, then drain."""
    check_sizes(p, m)
    return Schedule("1f1b", p, m, 1, tuple(_one_f_one_b_rank(r, p, m) for r in range(p)))


ONE_F_ONE_B = ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), until_backward, flush_time,
                           flush=True)
