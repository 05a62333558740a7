"""Pipeline-parallel schedules as plain data.

A schedule is, for every pipeline rank, the ordered list of compute actions the
rank runs: ``F`` (forward), ``B`` (full backward), or the zero-bubble split of
the backward into ``I`` (input gradient, the paper's "B") and ``W`` (weight
gradient). Actions name *virtual* stages as ``torch.distributed.pipelining``
does and print like its ``_Action`` (``"2F0"``). With Megatron interleaving,
virtual stage ``s`` is model chunk ``s // p`` on rank ``s % p``; with one chunk
per rank the stage is the rank. Sends and receives are implicit: every
cross-rank dependency is a transfer that the workload builder (or
:func:`execute`, as a fixed ``comm`` delay) adds.

Dependencies: F(s, mb) after F(s-1, mb); the backward of (s, mb), B or I, after
F(s, mb) and after the backward-input (B or I) of (s+1, mb); W(s, mb) after
I(s, mb).

:func:`execute` is a list-scheduling executor over fixed durations: a rank runs
its actions strictly in order, and an action starts when its rank is free and
its dependencies have ended (plus ``comm`` if a dependency ran on another
rank). It is the oracle for the closed-form bubbles in the tests, the engine's
tests compare against it, and :func:`validate` uses it to find deadlocks.

The registry (:data:`SCHEDULES`) is the one place that knows each schedule:
how to build it, what it requires of (p, m, v) (:func:`requirements`, which the
scenario validation reports), its peak in-flight micro-batches per stage
(memory), the micro-batches whose logits the last stage holds, and its
closed-form pipeline time (the analytic method). A new schedule is one
:class:`ScheduleSpec` entry.

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
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, cast

Kind = Literal["F", "B", "I", "W"]
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

    def __post_init__(self) -> None:
        if min(self.stages, self.microbatches, self.virtual_stages) < 1:
            raise ValueError(
                f"schedule needs p, m, v >= 1; got p={self.stages}, "
                f"m={self.microbatches}, v={self.virtual_stages}"
            )
        if len(self.actions) != self.stages:
            raise ValueError(f"{len(self.actions)} action lists for p={self.stages} ranks")

    @property
    def total_stages(self) -> int:
        """Number of virtual stages, p * v."""
        return self.stages * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """Rank holding virtual ``stage`` (Megatron: stage = chunk * p + rank)."""
        self._check_stage(stage)
        return stage % self.stages

    def chunk_of(self, stage: int) -> int:
        """Model chunk of virtual ``stage`` on its rank."""
        self._check_stage(stage)
        return stage // self.stages

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


def _check_sizes(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"need pipeline ranks p >= 1 and micro-batches m >= 1; got p={p}, m={m}")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all forwards, then all backwards, on every rank."""
    _check_sizes(p, m)
    ranks = tuple(
        tuple([Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)])
        for r in range(p)
    )
    return Schedule("gpipe", p, m, 1, ranks)


def _one_f_one_b_rank(rank: int, p: int, m: int) -> tuple[Action, ...]:
    warmup = min(p - rank - 1, m)
    order = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    order += [Action(rank, "B", i) for i in range(m - warmup, m)]
    return tuple(order)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): p - rank - 1 warm-up forwards, then F/B pairs, then drain."""
    _check_sizes(p, m)
    return Schedule("1f1b", p, m, 1, tuple(_one_f_one_b_rank(r, p, m) for r in range(p)))


def _chunk_and_microbatch(k: int, p: int, v: int, *, forward: bool) -> tuple[int, int]:
    """The k-th forward (or backward) of a rank: groups of p micro-batches per chunk."""
    group, offset = divmod(k, p * v)
    chunk = offset // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk, group * p + offset % p


def _interleaved_rank(rank: int, p: int, m: int, v: int) -> tuple[Action, ...]:
    total = m * v

    def action(k: int, kind: Kind) -> Action:
        chunk, microbatch = _chunk_and_microbatch(k, p, v, forward=kind == "F")
        return Action(chunk * p + rank, kind, microbatch)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [action(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(warmup + k, "F"), action(k, "B")]
    order += [action(k, "B") for k in range(total - warmup, total)]
    return tuple(order)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B with v model chunks per rank.

    Rank r warms up with 2 (p - r - 1) + (v - 1) p forwards (at most m v), then
    alternates one forward and one backward. Megatron runs everything as warm-up
    when m == p; this keeps the formula, which yields the same bubble.
    """
    _check_sizes(p, m)
    if v < 2:
        raise ValueError(f"interleaved 1F1B needs v >= 2 chunks per rank; got v={v}")
    if m % p != 0:
        raise ValueError(
            f"interleaved 1F1B needs micro-batches m={m} to be a multiple of ranks p={p}"
        )
    ranks = tuple(_interleaved_rank(r, p, m, v) for r in range(p))
    return Schedule("interleaved", p, m, v, ranks)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR'24): 1F1B with the backward split into I and W.

    In step x rank r runs F(x), I(x - (p - 1 - r)) and W(x - (p - 1)), skipping
    indices outside 0..m-1: I keeps 1F1B's place and W trails by p - 1
    micro-batches, filling the drain bubble.
    """
    _check_sizes(p, m)
    ranks = []
    for r in range(p):
        order = []
        for x in range(m + p - 1):
            for kind, microbatch in (("F", x), ("I", x - (p - 1 - r)), ("W", x - (p - 1))):
                if 0 <= microbatch < m:
                    order.append(Action(r, cast(Kind, kind), microbatch))
        ranks.append(tuple(order))
    return Schedule("zb-h1", p, m, 1, tuple(ranks))


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Requirement:
    """A condition a schedule puts on (p, m, v) that is not met; ``field`` says
    which input must change. For ``microbatches``, m must be a multiple of
    ``multiple``."""

    field: Literal["virtual_stages", "microbatches"]
    text: str
    multiple: int = 1


def _none(p: int, m: int, v: int) -> list[Requirement]:
    return []


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything the simulator knows of one schedule; adding a schedule is one entry.

    Stage times ``f``, ``b``, ``w`` are one micro-batch's forward, backward-input
    and backward-weight through a whole stage (all its chunks).
    """

    build: Callable[[int, int, int], Schedule]  # (p, m, v) -> per-rank actions
    # (p, m, v, stage) -> peak micro-batches whose activations the stage holds, in
    # whole-stage units (a chunk is 1/v of the stage)
    in_flight: Callable[[int, int, int, int], float]
    # (p, m, v, f, b, w) -> the pipeline phase, first forward to last backward, in
    # closed form for balanced stages and free communication
    pipeline_time: Callable[[int, int, int, float, float, float], float]
    # m -> micro-batches whose logits the last stage holds at once: 1 where it runs each
    # micro-batch's backward right after its forward (GPipe runs all m forwards first)
    logits_held: Callable[[int], int] = lambda m: 1
    chunks: tuple[int, int | None] = (1, 1)  # virtual stages per rank: (min, max or None)
    requirements: Callable[[int, int, int], list[Requirement]] = _none  # beyond ``chunks``


def _flush_time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """GPipe and 1F1B: (m + p − 1) × t_stage (each idles p − 1 slots per stage)."""
    return (m + p - 1) * (f + b + w)


def _interleaved_time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Megatron interleaving (Narayanan et al. 2021): the bubble shrinks by v."""
    return (m + (p - 1) / v) * (f + b + w)


def _zb_h1_time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """ZB-H1 (Qi et al. 2024, m ≥ p): W fills the drain, (p − 1)(t_F + t_B − t_W) idle."""
    return m * (f + b + w) + (p - 1) * (f + b - min(w, f + b))


def _until_backward(p: int, m: int, v: int, stage: int) -> float:
    """1F1B and ZB-H1 (whose I frees what 1F1B's B frees): min(p − stage, m)."""
    return float(min(p - stage, m))


def _interleaved_in_flight(p: int, m: int, v: int, stage: int) -> float:
    """Rank r warms up with 2(p − r − 1) + (v − 1)p chunk forwards and holds one more
    at its first backward, each chunk 1/v of the stage (at rank 0: p(1 + (p − 1)/(pv)))."""
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v) / v


def _interleaved_requirements(p: int, m: int, v: int) -> list[Requirement]:
    if m % p:
        return [Requirement("microbatches", f"interleaving needs micro-batches per pipeline "
                                            f"(m = {m}) to be a multiple of pp({p})", p)]
    return []


SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType({
    "gpipe": ScheduleSpec(lambda p, m, v: gpipe(p, m), lambda p, m, v, stage: float(m),
                          _flush_time, logits_held=lambda m: m),
    "1f1b": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), _until_backward, _flush_time),
    "interleaved": ScheduleSpec(interleaved_1f1b, _interleaved_in_flight, _interleaved_time,
                                chunks=(2, None), requirements=_interleaved_requirements),
    "zb-h1": ScheduleSpec(lambda p, m, v: zb_h1(p, m), _until_backward, _zb_h1_time),
})


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule ``name``, or ValueError naming the valid ones."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}")
    return spec


def requirements(name: str, p: int, m: int, v: int) -> list[Requirement]:
    """What (p, m, v) must change for schedule ``name``; empty when it can run."""
    spec = schedule_spec(name)
    lo, hi = spec.chunks
    if v > 1 and hi == 1:
        chunked = " or ".join(n for n, other in SCHEDULES.items() if other.chunks[1] != 1)
        out = [Requirement("virtual_stages", f"> 1 only with schedule: {chunked} (schedule is "
                                             f"{name}); set virtual_stages: 1 or schedule: "
                                             f"{chunked}")]
    elif v < lo or (hi is not None and v > hi):
        most = "" if hi is None else f" and <= {hi}"
        out = [Requirement("virtual_stages", f"{name} needs virtual_stages >= {lo}{most}")]
    else:
        out = []
    return out + spec.requirements(p, m, v)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build the schedule registered as ``name``; only one with chunks takes v > 1."""
    spec = schedule_spec(name)
    if spec.chunks[1] == 1 and v != 1:
        raise ValueError(f"schedule {name!r} has one chunk per rank; got v={v}")
    return spec.build(p, m, v)


@dataclass(frozen=True)
class TimedAction:
    """An action placed in time by :func:`execute`."""

    action: Action
    rank: int
    start: float
    end: float


def _dependencies(action: Action, last_stage: int, present: set[Action]) -> tuple[Action, ...]:
    stage, microbatch = action.stage, action.microbatch
    if action.kind == "F":
        return (Action(stage - 1, "F", microbatch),) if stage > 0 else ()
    if action.kind == "W":
        return (Action(stage, "I", microbatch),)
    own_forward = Action(stage, "F", microbatch)
    if stage == last_stage:
        return (own_forward,)
    grad = Action(stage + 1, "I", microbatch)
    return own_forward, grad if grad in present else Action(stage + 1, "B", microbatch)


def _deadlock(schedule: Schedule, position: list[int], done: dict[Action, float]) -> ValueError:
    present = {a for rank in schedule.actions for a in rank}
    stuck = []
    for rank, order in enumerate(schedule.actions):
        if position[rank] < len(order):
            action = order[position[rank]]
            deps = _dependencies(action, schedule.total_stages - 1, present)
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
    present = {a for rank in schedule.actions for a in rank}
    last_stage = schedule.total_stages - 1
    done: dict[Action, float] = {}
    position = [0] * schedule.stages
    free = [0.0] * schedule.stages
    timed: list[TimedAction] = []
    progress = True
    while progress:
        progress = False
        for rank, order in enumerate(schedule.actions):
            while position[rank] < len(order):
                action = order[position[rank]]
                deps = _dependencies(action, last_stage, present)
                if any(d not in done for d in deps):
                    break
                start = free[rank]
                for dep in deps:
                    hop = comm if schedule.rank_of(dep.stage) != rank else 0.0
                    start = max(start, done[dep] + hop)
                end = start + duration[action.kind][action.stage]
                done[action] = free[rank] = end
                timed.append(TimedAction(action, rank, start, end))
                position[rank] += 1
                progress = True
    if len(timed) < sum(len(order) for order in schedule.actions):
        raise _deadlock(schedule, position, done)
    return sorted(timed, key=lambda t: (t.start, t.rank))


def _check_placement(schedule: Schedule) -> None:
    for rank, order in enumerate(schedule.actions):
        for action in order:
            if action.stage >= schedule.total_stages or schedule.rank_of(action.stage) != rank:
                raise ValueError(f"rank {rank} runs {action}, whose stage is not on that rank")
            if action.microbatch >= schedule.microbatches:
                raise ValueError(f"{action}: micro-batch outside 0..{schedule.microbatches - 1}")


def _check_counts(schedule: Schedule) -> None:
    counts = Counter((a.stage, a.kind, a.microbatch) for rank in schedule.actions for a in rank)
    for stage in range(schedule.total_stages):
        for mb in range(schedule.microbatches):
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
    last_stage = schedule.total_stages - 1
    for rank, order in enumerate(schedule.actions):
        index = {action: i for i, action in enumerate(order)}
        for i, action in enumerate(order):
            for dep in _dependencies(action, last_stage, present):
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


def bubble_fraction(timed: list[TimedAction], p: int) -> float:
    """1 - busy time over all ranks / (p * makespan), makespan first start to last end."""
    if not timed:
        raise ValueError("bubble_fraction needs at least one timed action")
    makespan = max(t.end for t in timed) - min(t.start for t in timed)
    if makespan <= 0:
        raise ValueError("bubble_fraction needs a positive makespan")
    busy = sum(t.end - t.start for t in timed)
    return 1.0 - busy / (p * makespan)
