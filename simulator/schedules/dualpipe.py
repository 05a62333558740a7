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
an even m ≥ 2p. The overlap of each F&B pair's compute with the other's MoE all-to-all
is not modelled: the executor and the engine run the pair's two actions back to back.
"""

from __future__ import annotations

from simulator.schedules.action import Action, Schedule, check_sizes


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
