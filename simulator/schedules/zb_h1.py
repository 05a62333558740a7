"""ZB-H1 (Qi et al., ICLR'24): 1F1B with the backward split into the input gradient
(I) and the weight gradient (W), W trailing to fill the drain bubble at 1F1B's memory.
"""

from __future__ import annotations

from typing import cast

from simulator.schedules.action import Action, Kind, Schedule, check_sizes
from simulator.schedules.spec import ScheduleSpec, until_backward


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR'24): 1F1B with the backward split into I and W.

    In step x rank r runs F(x), I(x - (p - 1 - r)) and W(x - (p - 1)), skipping
    indices outside 0..m-1: I keeps 1F1B's place and W trails by p - 1
    micro-batches, filling the drain bubble.
    """
    check_sizes(p, m)
    ranks = []
    for r in range(p):
        order = []
        for x in range(m + p - 1):
            for kind, microbatch in (("F", x), ("I", x - (p - 1 - r)), ("W", x - (p - 1))):
                if 0 <= microbatch < m:
                    order.append(Action(r, cast(Kind, kind), microbatch))
        ranks.append(tuple(order))
    return Schedule("zb-h1", p, m, 1, tuple(ranks))


def _zb_h1_time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """ZB-H1 (Qi et al. 2024, m ≥ p): W fills the drain, (p − 1)(t_F + t_B − t_W) idle."""
    return m * (f + b + w) + (p - 1) * (f + b - min(w, f + b))


ZB_H1 = ScheduleSpec(lambda p, m, v: zb_h1(p, m), until_backward, _zb_h1_time,
                     split_backward=True)
