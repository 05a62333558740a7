"""ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241 §6; the V
shape of "Pipeline Parallelism with Controllable Memory", arXiv:2405.15362): two chunks
per rank in a V, rank r holding virtual stages r and 2p − 1 − r, so the first and the
last stage (the embedding and the output layer) sit on rank 0; the backward split into
I and W.

The order is the handcrafted one of PyTorch's ``ScheduleZBVZeroBubble``
(``torch/distributed/pipelining/schedules.py``, ``_calculate_single_rank_operations``),
re-expressed. With n = max(m, 2p − 1), rank r runs

1. 2(p − r) − 1 forwards of chunk 0;
2. r times: a forward of chunk 1, a forward of chunk 0;
3. p − r times: a forward of chunk 1, its I, its W;
4. while chunk 0 has forwards left (of n) or chunk 1 trails it: a forward of chunk 0 (if
   any left), I and W of chunk 0, a forward of chunk 1, I and W of chunk 1;
5. r times: I of chunk 0, I of chunk 1; then p − r times: I of chunk 0, a W of chunk 0;
   then the remaining W of chunk 1 and of chunk 0;

and drops the actions of micro-batches m..n − 1 (PyTorch leaves them as idle slots).
"""

from __future__ import annotations

from functools import lru_cache

from simulator.schedules.action import Action, Kind, Schedule, check_sizes, makespan
from simulator.schedules.spec import ScheduleSpec

_FIW: tuple[Kind, ...] = ("F", "I", "W")


class _Rank:
    """One rank's actions: counters of F, I and W per chunk."""

    def __init__(self, rank: int, p: int) -> None:
        self.stages = (rank, 2 * p - 1 - rank)
        self.count: dict[tuple[int, Kind], int] = {}
        self.order: list[Action] = []

    def add(self, chunk: int, kind: Kind) -> None:
        key = (chunk, kind)
        self.order.append(Action(self.stages[chunk], kind, self.count.get(key, 0)))
        self.count[key] = self.count.get(key, 0) + 1

    def run(self, chunk: int, kinds: tuple[Kind, ...]) -> None:
        for kind in kinds:
            self.add(chunk, kind)

    def n(self, chunk: int, kind: Kind) -> int:
        return self.count.get((chunk, kind), 0)


def _zbv_rank(rank: int, p: int, m: int) -> tuple[Action, ...]:
    n = max(m, 2 * p - 1)
    r = _Rank(rank, p)
    for _ in range(2 * (p - rank) - 1):
        r.add(0, "F")
    for _ in range(rank):
        r.add(1, "F")
        r.add(0, "F")
    for _ in range(p - rank):
        r.run(1, _FIW)
    while r.n(1, "F") < r.n(0, "F") or r.n(0, "F") < n:
        if r.n(0, "F") < n:
            r.add(0, "F")
        r.run(0, _FIW[1:])
        r.run(1, _FIW)
    for _ in range(rank):
        r.add(0, "I")
        r.add(1, "I")
    for _ in range(p - rank):
        r.add(0, "I")
        r.add(0, "W")
    for chunk in (1, 0):
        while r.n(chunk, "W") < r.n(chunk, "I"):
            r.add(chunk, "W")
    return tuple(a for a in r.order if a.microbatch < m)


def zbv(p: int, m: int) -> Schedule:
    """ZB-V's per-rank order for p ranks, 2p virtual stages in a V, m micro-batches."""
    check_sizes(p, m)
    return Schedule("zbv", p, m, 2, tuple(_zbv_rank(r, p, m) for r in range(p)),
                    placement="v")


def zbv_in_flight_chunks(p: int, m: int, rank: int) -> int:
    """Peak chunks whose activations ``rank`` holds (from F to I): min(2p, m + rank + 1,
    2m); from m ≥ 2p − 1 on every rank holds 2p half-stage chunks, 1F1B's rank-0 peak of p
    whole stages (the paper's "same peak memory as 1F1B")."""
    return min(2 * p, m + rank + 1, 2 * m)


def zbv_idle(p: int, f: float, b: float, w: float) -> float:
    """Idle time of every rank for m ≥ 2p − 1 and chunk times w ≤ f ≤ b (a chunk's
    forward, input-gradient and weight-gradient times): (p − 1) max(b, 2(b − w)).
    With f = b = w = t that is the p − 1 slots before the last rank's first forward,
    the paper's zero bubble beyond them."""
    return (p - 1) * max(b, 2 * (b - w))


def _zbv_time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Stage times f, b, w (a chunk takes half): m (f + b + w) plus :func:`zbv_idle` of
    the chunk times where that closed form holds (m ≥ 2p − 1, w ≤ f ≤ b). Elsewhere there
    is no closed form (PyTorch's note: bubble-free only for equal times) and the executor
    places the order, for m ≥ 2p − 1 that of 2p − 1 micro-batches only: the idle time
    no longer grows with m (``tests/test_schedules_zbv.py``)."""
    if m >= 2 * p - 1 and w <= f <= b:
        return m * (f + b + w) + zbv_idle(p, f / 2, b / 2, w / 2)
    placed = min(m, 2 * p - 1)
    return (m - placed) * (f + b + w) + _makespan(p, placed, f / 2, b / 2, w / 2)


@lru_cache(maxsize=4096)
def _makespan(p: int, m: int, f: float, b: float, w: float) -> float:
    """The executed makespan of ``zbv(p, m)`` at chunk times f, b, w (cached: the
    analytic method asks it once per stage, most stages alike)."""
    return makespan(zbv(p, m), f, b, w)


ZBV = ScheduleSpec(lambda p, m, v: zbv(p, m),
                   lambda p, m, v, stage: zbv_in_flight_chunks(p, m, stage) / 2, _zbv_time,
                   chunks=(2, 2), split_backward=True, placement="v")
