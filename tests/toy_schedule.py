"""A toy pipeline schedule in one file: GPipe with its backwards last in, first out.

Every rank runs all its forwards, then the backwards from the last micro-batch to the
first (the freshest activations first). Its traits: one chunk per rank, a fused
backward, a flush with p − 1 idle slots per stage (GPipe's bubble and closed form), m
micro-batches in flight and m micro-batches of logits held. Registering it is one
entry (``SCHEDULES``).
"""

from __future__ import annotations

from simulator.schedules.action import Action, Schedule, check_sizes
from simulator.schedules.spec import ScheduleSpec, flush_time


def gpipe_lifo(p: int, m: int) -> Schedule:
    check_sizes(p, m)
    ranks = tuple(
        tuple([Action(r, "F", i) for i in range(m)]
              + [Action(r, "B", i) for i in reversed(range(m))])
        for r in range(p))
    return Schedule("gpipe-lifo", p, m, 1, ranks)


GPIPE_LIFO = ScheduleSpec(lambda p, m, v: gpipe_lifo(p, m), lambda p, m, v, stage: float(m),
                          flush_time, logits_held=lambda m: m, flush=True)
