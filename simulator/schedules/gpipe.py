"""GPipe (Huang et al. 2019): every forward, then every backward, on every rank.
"""

from __future__ import annotations

from simulator.schedules.action import Action, Schedule, check_sizes
from simulator.schedules.spec import ScheduleSpec, flush_time


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all forwards, then all backwards, on every rank."""
    check_sizes(p, m)
    ranks = tuple(
        tuple([Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)])
        for r in range(p)
    )
    return Schedule("gpipe", p, m, 1, ranks)


GPIPE = ScheduleSpec(lambda p, m, v: gpipe(p, m), lambda p, m, v, stage: float(m), flush_time,
                     logits_held=lambda m: m, flush=True)
