"""DualPipe (DeepSeek-V3 technical report, arXiv:2412.19437 §3.2.1): a bidirectional
pipeline. The model is cut into p stages and every rank holds two of them: stage r for
the micro-batches fed at rank 0 and stage p − 1 − r for those fed at rank p − 1 (the
parameters twice over). As schedule data that is a V placement with two directions:
virtual stage r (direction 0) and 2p − 1 − r (direction 1, model stage p − 1 − r) on rank
r; micro-batches 0..m/2 − 1 run direction 0, m/2..m − 1 direction 1.

The order is that of ``DualPipe.step`` in github.com/deepseek-ai/DualPipe
(``dualpipe/dualpipe.py``), re-expressed: with h = min(r, p − 1 − r) and "near" the
direction whose input is at the rank's end of the pipeline (direction 0 on the first
half of the ranks, 1 on the second), rank r runs

1. 2 (p/2 − h − 1) forwards of the near direction;
2. h + 1 pairs: a forward of near, a forward of far;
3. p/2 − h − 1 times: input-gradient of far (its W queued), a W, a forward of far;
4. m/2 − p + h + 1 times: forward near + backward far, forward far + backward near (the
   overlapped F&B pairs, ``_forward_backward_chunk``);
5. p/2 − h − 1 times: backward far, then forward far + backward near;
6. h + 1 times: backward far, backward near; from the middle of this step on the
   backwards split into I with their W queued (the step's ``enable_zb`` switch);
7. p/2 − h − 1 times: a W, input-gradient of near;
8. the remaining h + 1 W, first queued first run (``WeightGradStore``, FIFO).

Each direction runs its micro-batches in order. ``DualPipe.step`` asserts an even p and
an even m ≥ 2p. In a scenario (``parallel.schedule: dualpipe``) the rank's two chunks are
``virtual_stages: 2`` and ``layers_per_stage`` lists pp model stages (each held twice).
The executor runs each F&B pair's two actions back to back; the engine overlaps one
chunk's compute with the other's all-to-alls (:mod:`simulator.strategies.pipeline.pairs`).
"""

from __future__ import annotations

from functools import lru_cache

from simulator.schedules.action import Action, Schedule, check_sizes, makespan
from simulator.schedules.spec import Requirement, ScheduleSpec


def dualpipe_problem(p: int, m: int) -> str | None:
    """Why ``DualPipe.step`` refuses (p, m), or None."""
    if p % 2:
        return f"DualPipe needs an even number of pipeline ranks; got p={p}"
    if m % 2 or m < 2 * p:
        return f"DualPipe needs an even number of micro-batches m >= 2p = {2 * p}; got m={m}"
    return None


class _Rank:
    """One rank's actions as ``DualPipe.step`` issues them."""

    def __init__(self, rank: int, p: int, m: int) -> None:
        self.stages = (rank, 2 * p - 1 - rank)  # virtual stage of direction 0 and 1
        self.first_mb = (0, m // 2)
        self.near = int(rank >= p // 2)  # the direction fed at this rank's end
        self.forwards, self.backwards = [0, 0], [0, 0]
        self.queued: list[Action] = []  # weight gradients waiting, first in first out
        self.order: list[Action] = []

    def _next(self, far: bool, counts: list[int]) -> tuple[int, int]:
        d = self.near ^ int(far)
        counts[d] += 1
        return self.stages[d], self.first_mb[d] + counts[d] - 1

    def f(self, far: bool) -> None:
        stage, mb = self._next(far, self.forwards)
        self.order.append(Action(stage, "F", mb))

    def b(self, far: bool, split: bool = False) -> None:
        stage, mb = self._next(far, self.backwards)
        if split:
            self.order.append(Action(stage, "I", mb))
            self.queued.append(Action(stage, "W", mb))
        else:
            self.order.append(Action(stage, "B", mb))

    def w(self) -> None:
        self.order.append(self.queued.pop(0))


def _dualpipe_rank(rank: int, p: int, m: int) -> tuple[Action, ...]:
    half, h = p // 2, min(rank, p - 1 - rank)
    r = _Rank(rank, p, m)
    for _ in range(2 * (half - h - 1)):
        r.f(far=False)
    for _ in range(h + 1):
        r.f(far=False)
        r.f(far=True)
    for _ in range(half - h - 1):
        r.b(far=True, split=True)
        r.w()
        r.f(far=True)
    for _ in range(m // 2 - p + h + 1):
        r.f(far=False)
        r.b(far=True)
        r.f(far=True)
        r.b(far=False)
    for _ in range(half - h - 1):
        r.b(far=True)
        r.f(far=True)
        r.b(far=False)
    split = False
    for i in range(h + 1):
        split = split or (i == (h + 1) // 2 and h % 2 == 1)
        r.b(far=True, split=split)
        split = split or (i == (h + 1) // 2 and h % 2 == 0)
        r.b(far=False, split=split)
    for _ in range(half - h - 1):
        r.w()
        r.b(far=False, split=True)
    while r.queued:
        r.w()
    return tuple(r.order)


def dualpipe(p: int, m: int) -> Schedule:
    """DualPipe's per-rank order for p ranks (even) and m micro-batches (even, >= 2p)."""
    check_sizes(p, m)
    problem = dualpipe_problem(p, m)
    if problem is not None:
        raise ValueError(problem)
    ranks = tuple(_dualpipe_rank(r, p, m) for r in range(p))
    return Schedule("dualpipe", p, m, 2, ranks, placement="v", directions=2)


def dualpipe_in_flight(p: int) -> int:
    """Peak chunks (each a whole model stage) whose activations a rank holds: p + 1 on
    every rank (the report's Table 2: 'PP + 1')."""
    return p + 1


def overlapped_pairs(schedule: Schedule, rank: int) -> list[int]:
    """Positions i in ``rank``'s order where actions i and i + 1 are an overlapped F&B
    pair: a forward followed at once by a full backward of the other direction (steps 4
    and 5 of ``DualPipe.step``, its ``_forward_backward_chunk``)."""
    order, p = schedule.actions[rank], schedule.stages
    return [i for i in range(len(order) - 1)
            if order[i].kind == "F" and order[i + 1].kind == "B"
            and (order[i].stage < p) != (order[i + 1].stage < p)]


def _requirements(p: int, m: int, v: int) -> list[Requirement]:
    out = []
    if p % 2:
        out.append(Requirement("pp", f"DualPipe needs an even number of pipeline ranks; "
                                     f"got pp={p}; use an even pp such as {p + 1}"))
    if m % 2 or m < 2 * p:
        out.append(Requirement("microbatches", f"DualPipe needs an even number of "
                                               f"micro-batches m >= 2 * pp = {2 * p} "
                                               f"(m = {m})", 2, 2 * p))
    return out


def _in_flight(p: int, m: int, v: int, stage: int) -> float:
    """p + 1 chunks (:func:`dualpipe_in_flight`), each one model stage, half of what a
    rank holds (its two chunks)."""
    return dualpipe_in_flight(p) / 2


def _time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Stage times f, b, w: a micro-batch passes one chunk (one model stage) per rank, so
    they are the chunk's. No closed form beyond equal times ((p/2 − 1) t idle; the
    report's (PP/2 − 1)(F&B + B − 3W) counts the pair as overlapped, the executor does
    not): the executed makespan of the order for m = 2p, plus the other micro-batches at
    full rate, as every rank's idle time does not grow with m
    (``tests/test_schedules_dualpipe.py``)."""
    problem = dualpipe_problem(p, m)
    if problem is not None:
        raise ValueError(problem)
    return (m - 2 * p) * (f + b + w) + _makespan(p, 2 * p, f, b, w)


@lru_cache(maxsize=4096)
def _makespan(p: int, m: int, f: float, b: float, w: float) -> float:
    return makespan(dualpipe(p, m), f, b, w)


DUALPIPE = ScheduleSpec(lambda p, m, v: dualpipe(p, m), _in_flight, _time, chunks=(2, 2),
                        requirements=_requirements, split_backward=True, placement="v",
                        directions=2)
