"""Pipeline-parallel schedules as plain data.

A schedule is, for every pipeline rank, the ordered list of compute actions the
rank runs: ``F`` (forward), ``B`` (full backward), or the zero-bubble split of
the backward into ``I`` (input gradient, the paper's "B") and ``W`` (weight
gradient). Actions name *virtual* stages as ``torch.distributed.pipelining``
does and print like its ``_Action`` (``"2F0"``). With Megatron interleaving,
virtual stage ``s`` is model chunk ``s // p`` on rank ``s % p``; with one chunk
per rank the stage is the rank. A ``"v"`` placement (ZB-V, DualPipe) folds two
chunks into a V: virtual stage ``s < p`` is chunk 0 on rank ``s``, ``s >= p`` is
chunk 1 on rank ``2p - 1 - s``, so rank r holds stages r and 2p − 1 − r. Every
micro-batch runs through every virtual stage, except with two ``directions``
(DualPipe): the first half of the micro-batches then runs through stages
0..p-1 and the second half through p..2p-1, from the other end of the ranks.
Sends and receives are implicit: every
cross-rank dependency is a transfer that the workload builder (or
:func:`execute`, as a fixed ``comm`` delay) adds.

Dependencies, along the micro-batch's route of stages: F(s, mb) after F(s-1, mb);
the backward of (s, mb), B or I, after F(s, mb) and after the backward-input (B or
I) of (s+1, mb); W(s, mb) after I(s, mb).

:func:`execute` is a list-scheduling executor over fixed durations: a rank runs
its actions strictly in order, and an action starts when its rank is free and
its dependencies have ended (plus ``comm`` if a dependency ran on another
rank). It is the oracle for the closed-form bubbles in the tests, the engine's
tests compare against it, and :func:`simulator.schedules.validate.validate` uses it to find
deadlocks.

Activation accounting (:meth:`Schedule.peak_in_flight`): a micro-batch chunk is
in flight from its F until the backward that frees its activations, i.e. B, or
I for the split backward. After I only the inputs of the weight-gradient GEMMs
remain (M_W in Qi et al.'s notation, a fraction of M_B); ``until="W"`` counts
those as well. Under this choice ZB-H1 holds ``min(p - rank, m)`` chunks like
1F1B, and ``min(p, m)`` weight-gradient inputs on every rank: the paper's "same
peak memory as 1F1B" is about the peak over ranks, reached at rank 0.
"""

from __future__ import annotations

import re
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, cast

Kind = Literal["F", "B", "I", "W"]
Placement = Literal["loop", "v"]
_ACTION_TEXT = re.compile(r"([0-9]+)([FBIW])([0-9]+)")


@dataclass(frozen=True, order=True)
class Action:
    """One compute step: ``kind`` of ``microbatch`` on virtual ``stage``."""

    stage: int  # virtual stage index, 0..p*v-1 (the rank when v == 1)
    kind: Kind  # F forward, B full backward, I backward-input, W backward-weight
    microbatch: int  # 0..m-1

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0 or self.kind not in ("F", "B", "I", "W"):
            raise ValueError(f"invalid action {self.stage!r} {self.kind!r} {self.microbatch!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"2F0"`` is stage 2, forward, micro-batch 0."""
        match = _ACTION_TEXT.fullmatch(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> "
                "with kind one of F, B, I, W, e.g. '2F0'"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), cast(Kind, kind), int(microbatch))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions for ``microbatches`` over ``stages`` ranks."""

    name: str  # "gpipe" | "1f1b" | "interleaved" | "zb-h1" (or anything hand-made)
    stages: int  # p, pipeline ranks
    microbatches: int  # m, micro-batches per step
    virtual_stages: int  # v, model chunks per rank (1 unless interleaved)
    actions: tuple[tuple[Action, ...], ...]  # per rank, in execution order
    # "loop": stage s on rank s % p (Megatron); "v": stage s < p on rank s, else 2p-1-s
    # (out of the repr, as is the next, so the workload hashes of the schedules before
    # them stay as they were)
    placement: Placement = field(default="loop", repr=False)
    # 2: micro-batches < m/2 run stages 0..p-1, the others p..2p-1 (DualPipe)
    directions: int = field(default=1, repr=False)

    def __post_init__(self) -> None:
        if min(self.stages, self.microbatches, self.virtual_stages) < 1:
            raise ValueError(
                f"schedule needs p, m, v >= 1; got p={self.stages}, "
                f"m={self.microbatches}, v={self.virtual_stages}"
            )
        if len(self.actions) != self.stages:
            raise ValueError(f"{len(self.actions)} action lists for p={self.stages} ranks")
        if (self.placement == "v" or self.directions != 1) and self.virtual_stages != 2:
            raise ValueError(f"a V placement or two directions needs v = 2 chunks per rank; "
                             f"got v={self.virtual_stages}")
        if self.directions not in (1, 2) or (self.directions == 2 and self.microbatches % 2):
            raise ValueError(f"directions must be 1, or 2 with an even m; got "
                             f"directions={self.directions}, m={self.microbatches}")

    @property
    def total_stages(self) -> int:
        """Number of virtual stages, p * v."""
        return self.stages * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """Rank holding virtual ``stage`` (Megatron: stage = chunk * p + rank; V: stage r
        and 2p − 1 − r on rank r)."""
        self._check_stage(stage)
        return stage_rank(self.placement, self.stages, self.virtual_stages, stage)

    def chunk_of(self, stage: int) -> int:
        """Model chunk of virtual ``stage`` on its rank."""
        self._check_stage(stage)
        return stage // self.stages

    def route(self, microbatch: int) -> range:
        """The virtual stages ``microbatch`` runs through, in forward order."""
        if self.directions == 1:
            return range(self.total_stages)
        if microbatch < self.microbatches // 2:
            return range(self.stages)
        return range(self.stages, self.total_stages)

    def is_first(self, stage: int) -> bool:
        """Whether virtual ``stage`` starts a route (it runs the embedding): stage 0, and
        with two directions stage p as well."""
        return stage % self.stages == 0 if self.directions == 2 else stage == 0

    def is_last(self, stage: int) -> bool:
        """Whether virtual ``stage`` ends a route (it runs the output layer and the loss):
        the last stage, and with two directions stage p − 1 as well."""
        if self.directions == 2:
            return stage % self.stages == self.stages - 1
        return stage == self.total_stages - 1

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.total_stages:
            raise ValueError(f"stage {stage} outside 0..{self.total_stages - 1}")

    def peak_in_flight(self, rank: int, *, until: Literal["I", "W"] = "I") -> int:
        """Most micro-batch chunks whose F ran on ``rank`` and whose activations are held.

        Activations are released by B, or by I for the split backward; with
        ``until="W"`` a split chunk counts until its W (the weight-gradient inputs).
        """
        releases = {"B", until}
        held = peak = 0
        for action in self.actions[rank]:
            if action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif action.kind in releases:
                held -= 1
        return peak

    def grid(self) -> str:
        """Step x rank text grid, one unit step per action, blank cells for idle.

        Timing comes from :func:`execute` with every F, B, I and W one step long
        (a B in a schedule that also has W takes two steps; only its start shows).
        """
        split = any(a.kind == "W" for rank in self.actions for a in rank)
        timed = execute(self, t_f=1.0, t_b=1.0, t_w=1.0 if split else 0.0)
        steps = round(max((t.end for t in timed), default=0.0))
        cells = [[""] * self.stages for _ in range(steps)]
        for item in timed:
            cells[round(item.start)][item.rank] = str(item.action)
        header = [f"rank {r}" for r in range(self.stages)]
        width = max(len(text) for text in header + [c for row in cells for c in row])
        step_width = max(len("step"), len(str(steps - 1)))
        lines = ["step".rjust(step_width) + "".join(f"  {h:<{width}}" for h in header)]
        for step, row in enumerate(cells):
            lines.append(str(step).rjust(step_width) + "".join(f"  {c:<{width}}" for c in row))
        return "\n".join(line.rstrip() for line in lines)


def stage_rank(placement: Placement, p: int, v: int, stage: int) -> int:
    """The rank holding virtual ``stage`` of p · v under ``placement``."""
    if placement == "v" and stage >= p:
        return p * v - 1 - stage
    return stage % p


def rank_stages(placement: Placement, p: int, v: int, rank: int) -> list[int]:
    """The virtual stages ``rank`` holds under ``placement``, in chunk order."""
    if placement == "v":
        return [rank, p * v - 1 - rank]
    return [chunk * p + rank for chunk in range(v)]


def check_sizes(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"need pipeline ranks p >= 1 and micro-batches m >= 1; got p={p}, m={m}")


# ---------------------------------------------------------------- the registry


# ---------------------------------------------------------------- placed in time


@dataclass(frozen=True)
class TimedAction:
    """An action placed in time by :func:`execute`."""

    action: Action
    rank: int
    start: float
    end: float


def dependencies(action: Action, route: range, present: set[Action]) -> tuple[Action, ...]:
    """What ``action`` waits for, its micro-batch running through stages ``route``."""
    stage, microbatch = action.stage, action.microbatch
    if action.kind == "F":
        return (Action(stage - 1, "F", microbatch),) if stage > route.start else ()
    if action.kind == "W":
        return (Action(stage, "I", microbatch),)
    own_forward = Action(stage, "F", microbatch)
    if stage == route.stop - 1:
        return (own_forward,)
    grad = Action(stage + 1, "I", microbatch)
    return own_forward, grad if grad in present else Action(stage + 1, "B", microbatch)


def _deadlock(schedule: Schedule, position: list[int], done: Container[Action]) -> ValueError:
    present = {a for rank in schedule.actions for a in rank}
    stuck = []
    for rank, order in enumerate(schedule.actions):
        if position[rank] < len(order):
            action = order[position[rank]]
            deps = dependencies(action, schedule.route(action.microbatch), present)
            waits = ", ".join(str(d) for d in deps if d not in done)
            stuck.append(f"rank {rank} waits at {action} for {waits}")
    return ValueError("deadlock: " + "; ".join(stuck))


Times = float | Sequence[float]  # one duration for every virtual stage, or one per stage


def _per_stage(value: Times, stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * stages
    if len(value) != stages:
        raise ValueError(f"{len(value)} stage times for {stages} virtual stages")
    return [float(x) for x in value]


def execute(
    schedule: Schedule, t_f: Times = 1.0, t_b: Times = 2.0, t_w: Times = 0.0,
    comm: float = 0.0,
) -> list[TimedAction]:
    """Place every action in time; durations F=t_f, B=t_b+t_w, I=t_b, W=t_w.

    Times are per virtual stage (per chunk when interleaved): one number for all,
    or one per virtual stage (an uneven layer placement). ``comm`` delays a
    dependency that ran on another rank. Returns actions sorted by (start, rank).
    """
    n = schedule.total_stages
    f, b, w = _per_stage(t_f, n), _per_stage(t_b, n), _per_stage(t_w, n)
    duration = {"F": f, "B": [x + y for x, y in zip(b, w, strict=True)], "I": b, "W": w}
    order = _placed_order(schedule)
    free = [0.0] * schedule.stages
    ends: list[float] = []
    timed: list[TimedAction] = []
    for action, rank, deps in order:
        start = free[rank]
        for dep in deps:
            hop = comm if schedule.rank_of(order[dep][0].stage) != rank else 0.0
            start = max(start, ends[dep] + hop)
        end = start + duration[action.kind][action.stage]
        ends.append(end)
        free[rank] = end
        timed.append(TimedAction(action, rank, start, end))
    return sorted(timed, key=lambda t: (t.start, t.rank))


#: :func:`execute`'s visiting order of a schedule: per action, the action, its rank and
#: the positions of its dependencies in that order (which actions are done when depends on
#: the order alone, never on the times)
Order = tuple[tuple[Action, int, tuple[int, ...]], ...]


def _walk(schedule: Schedule) -> tuple[list[tuple[Action, int, tuple[int, ...]]], list[int],
                                       dict[Action, int]]:
    """Visit ``schedule``'s ranks in turn, each as far as its next action's dependencies
    are placed: the actions in that order (each with its rank and its dependencies'
    positions), and where every rank stopped (all placed, or a deadlock)."""
    present = {a for rank in schedule.actions for a in rank}
    index: dict[Action, int] = {}
    position = [0] * schedule.stages
    out: list[tuple[Action, int, tuple[int, ...]]] = []
    progress = True
    while progress:
        progress = False
        for rank, order in enumerate(schedule.actions):
            while position[rank] < len(order):
                action = order[position[rank]]
                deps = dependencies(action, schedule.route(action.microbatch), present)
                if any(d not in index for d in deps):
                    break
                index[action] = len(out)
                out.append((action, rank, tuple(index[d] for d in deps)))
                position[rank] += 1
                progress = True
    return out, position, index


@lru_cache(maxsize=64)
def _order(schedule: Schedule) -> Order | None:
    """The order :func:`execute` places ``schedule``'s actions in (None: a deadlock)."""
    out, _, index = _walk(schedule)
    return tuple(out) if len(index) == sum(len(o) for o in schedule.actions) else None


def _placed_order(schedule: Schedule) -> Order:
    """:func:`_order`, or the ValueError that names where each rank is stuck."""
    order = _order(schedule)
    if order is None:
        _, position, placed = _walk(schedule)
        raise _deadlock(schedule, position, placed)
    return order


def makespan(schedule: Schedule, t_f: float, t_b: float, t_w: float) -> float:
    """First start to last end of :func:`execute` (no ``comm``) at one time per kind for
    every virtual stage: the same sums in the same order, bit for bit, from the
    schedule's order worked out once (a planner prices one schedule at many times)."""
    order = _placed_order(schedule)
    duration = {"F": float(t_f), "B": float(t_b) + float(t_w), "I": float(t_b),
                "W": float(t_w)}
    free = [0.0] * schedule.stages
    done: list[float] = []
    first, last = float("inf"), float("-inf")
    for action, rank, deps in order:
        start = free[rank]
        for dep in deps:
            start = max(start, done[dep] + 0.0)
        end = start + duration[action.kind]
        done.append(end)
        free[rank] = end
        first, last = min(first, start), max(last, end)
    return last - first


def bubble_fraction(timed: list[TimedAction], p: int) -> float:
    """1 - busy time over all ranks / (p * makespan), makespan first start to last end."""
    if not timed:
        raise ValueError("bubble_fraction needs at least one timed action")
    makespan = max(t.end for t in timed) - min(t.start for t in timed)
    if makespan <= 0:
        raise ValueError("bubble_fraction needs a positive makespan")
    busy = sum(t.end - t.start for t in timed)
    return 1.0 - busy / (p * makespan)
