"""Accounting: where each rank's step goes, and the chain of events that sets its length.

This module is the vocabulary of every output: the summary, ``results.json``, the
PNGs, ``compare``, ``diff``, ``sweep`` and the analytic method all use its
category names and nothing else.

**The breakdown.** For every simulated rank, ``[0, step_time]`` is partitioned
into disjoint :data:`CATEGORIES` that sum to the step time exactly. The rank's
compute stream is its timeline: while it runs a task, the time goes to the
task's category (a fused backward ``B`` is split into its input- and
weight-gradient shares); a collective on the compute stream is *peer-wait* from
the rank's arrival until the last member arrives (``comm_start``) and
*transfer* after. An idle gap before a task is explained by walking back along
what the task waited for: the dependency that ended last, then what that one
waited for, and so on. A transfer in flight is ``<kind>_transfer``; a
collective waiting for its peers is ``<kind>_wait``; reaching compute on
another rank through a pipeline send is pipeline idle (the rank had nothing to
do until a neighbour stage produced its input); reaching the host's optimizer
(ZeRO-Offload's CPU Adam) is ``optimizer``. The idle after a rank's last task
is pipeline idle until its pipeline's last backward ends (the drain: peer-waits
there are the drain's too) and ``tail`` after it (waiting for other ranks'
optimizer or synchronisation).

**Bubble versus imbalance.** Pipeline idle is split with the schedule's closed
form: ``pipeline_bubble`` is at most the idle the schedule imposes on a rank
whose every stage ran at this rank's own speed (its busy time per micro-batch
in forward, backward-input and backward-weight, communication on the compute
stream included); what exceeds it is ``imbalance_idle``. With balanced stages
and free communication the bubble is exactly the closed form and
``bubble_fraction`` (the mean schedule bubble over ranks / pipeline phase, see
:func:`schedule_bubble`) equals (p − 1)/(m + p − 1) for GPipe and 1F1B, as in
the analytic method.

**The critical path.** From the event that ends last, walk back: a task's own
time is on the path; a collective's wait jumps to the member that arrived last;
otherwise the predecessor is whichever of its dependencies and its stream
predecessor ended last. The segments cover ``[0, step_time]`` and their
composition by category (``critical_path_s``) sums to the step time.

Everything here reads plain data: task records, their spans and the moments
collectives began to transfer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simulator.tasks import Task

COMPUTE_CATEGORIES = ("forward", "backward_input", "backward_weight", "recompute", "optimizer")
#: Communication kinds, each with a transfer and a peer-wait category.
COMM_KINDS = ("tp", "pp", "dp", "zero", "offload", "embedding_tie", "ep", "cp")
COMM_CATEGORIES = tuple(f"{k}_{part}" for k in COMM_KINDS for part in ("transfer", "wait"))
IDLE_CATEGORIES = ("pipeline_bubble", "imbalance_idle", "tail")
#: Every category, in display order. Each rank's entries sum to the step time.
CATEGORIES = COMPUTE_CATEGORIES + COMM_CATEGORIES + IDLE_CATEGORIES
#: Task kinds that are compute (the rest are communication kinds or the optimizer).
COMPUTE_KINDS = frozenset({"forward", "backward", "weight_grad", "recompute"})
_KIND_CATEGORY = {"forward": "forward", "weight_grad": "backward_weight",
                  "recompute": "recompute", "optimizer": "optimizer"}
_PIPELINE = "pipeline"  # pipeline idle before it is split into bubble and imbalance


def label(category: str) -> str:
    """Display name: ``tp_transfer`` → ``tp transfer``, ``embedding_tie_wait`` →
    ``embedding-tie wait``."""
    return category.replace("embedding_tie", "embedding-tie").replace("_", " ")


def is_comm(task: Task) -> bool:
    return task.kind in COMM_KINDS


def comm_category(task: Task, part: str) -> str:
    return f"{task.kind}_{part}"


def own_categories(task: Task, start: float, end: float, begin: float) -> list[tuple[str, float]]:
    """The categories of a task's own span; ``begin`` is when its transfer started."""
    if is_comm(task):
        wait = max(0.0, min(begin, end) - start)
        return [(comm_category(task, "wait"), wait), (comm_category(task, "transfer"), end - start
                                                      - wait)]
    if task.kind == "backward":
        w = min(task.weight_s, end - start)
        return [("backward_input", end - start - w), ("backward_weight", w)]
    return [(_KIND_CATEGORY.get(task.kind, "optimizer"), end - start)]


@dataclass(frozen=True)
class Timing:
    """Spans by task id, plus each collective's transfer start and last-arriving member."""

    tasks: Sequence[Task]
    start: Mapping[int, float]
    end: Mapping[int, float]
    comm_start: Mapping[int, float]
    last_arrival: Mapping[int, int]
    prev: Mapping[int, int]  # task id -> the previous task of its stream

    @classmethod
    def of(cls, tasks: Sequence[Task], spans: Iterable[tuple[int, float, float]],
           comm_start: Mapping[int, float], last_arrival: Mapping[int, int],
           streams: Iterable[Sequence[Task]]) -> Timing:
        start: dict[int, float] = {}
        end: dict[int, float] = {}
        for tid, a, b in spans:
            start[tid] = a
            end[tid] = b
        prev: dict[int, int] = {}
        for stream in streams:
            for before, after in itertools.pairwise(stream):
                prev[after.id] = before.id
        return cls(tasks, start, end, comm_start, last_arrival, prev)

    def begin(self, tid: int) -> float:
        return self.comm_start.get(tid, self.start[tid])

    def predecessor(self, tid: int) -> int | None:
        """Whichever of the task's dependencies and stream predecessor ended last."""
        best, best_end = None, -1.0
        p = self.prev.get(tid)
        if p is not None:
            best, best_end = p, self.end[p]
        for d in self.tasks[tid].deps:
            if self.end[d] > best_end:
                best, best_end = d, self.end[d]
        return best


def explain_gap(timing: Timing, rank: int, waited_on: int | None, lo: float, hi: float,
                out: dict[str, float]) -> None:
    """Attribute ``rank``'s idle gap ``[lo, hi]`` by walking back from the task waited on;
    past a pipeline transfer, another rank's work is the pipeline's (its stage was busy)."""
    tid, via_pipeline = waited_on, False
    while hi > lo and tid is not None:
        hi = min(hi, timing.end[tid])
        if hi <= lo:
            return
        task = timing.tasks[tid]
        if via_pipeline and task.rank != rank and task.kind != "pp":
            out[_PIPELINE] += hi - lo
            return
        if not is_comm(task):
            category = "optimizer" if task.stream == "host" else \
                _PIPELINE if via_pipeline else "imbalance_idle"
            out[category] += hi - lo
            return
        begin = max(lo, timing.begin(tid))
        if hi > begin:
            out[comm_category(task, "transfer")] += hi - begin
            hi = begin
        started = max(lo, timing.start[tid])
        if hi > started:
            out[comm_category(task, "wait")] += hi - started
            hi = started
        via_pipeline = via_pipeline or task.kind == "pp"
        tid = timing.predecessor(tid)
    if hi > lo:
        out["imbalance_idle"] += hi - lo


def rank_breakdown(timing: Timing, compute: Sequence[Task], step_time: float,
                   phase_end: float, ideal_idle: float) -> dict[str, float]:
    """Disjoint categories of one rank's step (see the module notes)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    out[_PIPELINE] = 0.0
    # after its last pipeline compute and until the pipeline phase ends, a rank is in
    # the drain: idle and peer-waits there are the schedule's, whatever it waits on
    drain = next((timing.end[t.id] for t in reversed(compute) if t.kind in COMPUTE_KINDS), 0.0)
    cursor = 0.0
    for task in compute:
        tid = task.id
        a, b = timing.start[tid], timing.end[tid]
        if a > cursor:
            in_drain = max(0.0, min(a, phase_end) - max(cursor, drain))
            out[_PIPELINE] += in_drain
            explain_gap(timing, task.rank, timing.predecessor(tid), cursor + in_drain, a, out)
        for category, seconds in own_categories(task, a, b, timing.begin(tid)):
            in_drain = 0.0
            if category.endswith("_wait"):
                in_drain = max(0.0, min(a + seconds, phase_end) - max(a, drain))
                out[_PIPELINE] += in_drain
            out[category] += seconds - in_drain
        cursor = max(cursor, b)
    if step_time > cursor:
        in_drain = max(0.0, min(step_time, phase_end) - max(cursor, drain))
        out[_PIPELINE] += in_drain
        out["tail"] += step_time - cursor - in_drain
    idle = out.pop(_PIPELINE)
    out["pipeline_bubble"] = min(idle, max(ideal_idle, 0.0))
    out["imbalance_idle"] += idle - out["pipeline_bubble"]
    return out


def pass_times(timing: Timing, compute: Sequence[Task]) -> tuple[float, float, float]:
    """Busy seconds of the forward, backward-input and backward-weight passes (recompute
    counts as backward); communication of a micro-batch on the compute stream goes to the
    pass it sits in."""
    f = bi = bw = 0.0
    current = "F"
    for task in compute:
        seconds = timing.end[task.id] - timing.start[task.id]
        if task.kind == "forward":
            current = "F"
        elif task.kind in ("backward", "recompute"):
            current = "B"
        elif task.kind == "weight_grad":
            current = "W"
        elif not is_comm(task) or task.microbatch < 0:
            continue  # the optimizer, and synchronisation outside the passes
        if task.kind == "backward":
            bw += task.weight_s
            bi += seconds - task.weight_s
        elif current == "F":
            f += seconds
        elif current == "B":
            bi += seconds
        else:
            bw += seconds
    return f, bi, bw


def _pipeline_ends(timing: Timing, programs: Mapping[int, Sequence[Task]],
                   pipeline_of: Mapping[int, Any]) -> dict[Any, float]:
    """When each pipeline's last forward or backward ends."""
    ends: dict[Any, float] = {}
    for rank, compute in programs.items():
        last = next((timing.end[t.id] for t in reversed(compute) if t.kind in COMPUTE_KINDS),
                    0.0)
        key = pipeline_of[rank]
        ends[key] = max(ends.get(key, 0.0), last)
    return ends


def breakdown(timing: Timing, programs: Mapping[int, Sequence[Task]], stage_of: Mapping[int, int],
              pipeline_of: Mapping[int, Any], step_time: float, phase: tuple[float, float],
              schedule: str, p: int, m: int, v: int) -> tuple[list[dict[str, Any]], list[float]]:
    """``time_breakdown_s`` (one entry per simulated rank; ``programs`` maps a rank to its
    compute stream) and each rank's schedule bubble (:func:`schedule_bubble`). Ranks with
    equal ``pipeline_of`` form one pipeline, whose drain ends with its last backward."""
    from simulator.analytic import pipeline_time  # the schedule's closed form

    ends = _pipeline_ends(timing, programs, pipeline_of)
    entries, bubbles = [], []
    for rank, compute in sorted(programs.items()):
        f, bi, bw = (x / m for x in pass_times(timing, compute))
        ideal = pipeline_time(schedule, p, m, v, f, bi, bw) - m * (f + bi + bw)
        entry: dict[str, Any] = {"rank": rank, "stage": stage_of[rank]}
        entry.update(rank_breakdown(timing, compute, step_time, ends[pipeline_of[rank]], ideal))
        entries.append(entry)
        bubbles.append(schedule_bubble(ideal, phase[1] - phase[0] - m * (f + bi + bw)))
    return entries, bubbles


def schedule_bubble(ideal: float, without_pipeline_work: float) -> float:
    """The bubble as the literature defines it, for one rank: the part of the pipeline
    phase in which the rank has no forward or backward work of its own, at most the
    closed form for its speed (the rest is imbalance). Unlike the ``pipeline_bubble``
    category it keeps the time that other work (an early optimizer step) filled."""
    return min(max(ideal, 0.0), max(without_pipeline_work, 0.0))


def critical_path(timing: Timing, last: int, step_time: float) -> list[tuple[int, float, float,
                                                                             str]]:
    """Segments ``(rank, start, end, category)`` from 0 to the step's end, latest first."""
    segments: list[tuple[int, float, float, str]] = []
    tid: int | None = last
    t = step_time
    if timing.end[last] < t:
        segments.append((timing.tasks[last].rank, timing.end[last], t, "tail"))
        t = timing.end[last]
    while tid is not None:
        task = timing.tasks[tid]
        a = timing.start[tid]
        begin = timing.begin(tid)
        arrived = timing.last_arrival.get(tid, tid)
        if is_comm(task) and arrived != tid and begin > a:
            # the transfer is on the path; before it, whoever arrived last
            segments.append((task.rank, begin, t, comm_category(task, "transfer")))
            tid, t = arrived, begin
            task, a = timing.tasks[tid], timing.start[tid]
        else:
            for category, seconds in reversed(own_categories(task, a, t, begin)):
                if seconds > 0:
                    segments.append((task.rank, t - seconds, t, category))
                    t -= seconds
        t = a
        pred = timing.predecessor(tid)
        if pred is not None and timing.end[pred] < t:
            segments.append((task.rank, timing.end[pred], t, "imbalance_idle"))
            t = timing.end[pred]
        tid = pred
    if t > 0:
        segments.append((segments[-1][0] if segments else 0, 0.0, t, "imbalance_idle"))
    return segments


def merge_segments(segments: Iterable[tuple[int, float, float, str]]) -> list[dict[str, Any]]:
    """Earliest first, neighbours of the same rank and category merged."""
    merged: list[dict[str, Any]] = []
    for rank, a, b, category in sorted(segments, key=lambda s: (s[1], s[2])):
        if b <= a:
            continue
        if merged and merged[-1]["rank"] == rank and merged[-1]["category"] == category:
            merged[-1]["end"] = b
        else:
            merged.append({"rank": rank, "start": a, "end": b, "category": category})
    return merged


def composition(segments: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for seg in segments:
        out[seg["category"]] += seg["end"] - seg["start"]
    return out


def mean_breakdown(entries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``step_breakdown_s``: each category's mean over the entries (ranks)."""
    n = max(len(entries), 1)
    return {c: sum(float(e.get(c, 0.0)) for e in entries) / n for c in CATEGORIES}


def stage_breakdown(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Each category's mean over the entries of each pipeline stage, by stage."""
    by_stage: dict[int, list[Mapping[str, Any]]] = {}
    for e in entries:
        by_stage.setdefault(int(e["stage"]), []).append(e)
    return [mean_breakdown(by_stage[s]) for s in sorted(by_stage)]


def exposed_comm(mean: Mapping[str, float]) -> dict[str, float]:
    """Seconds a rank is held back by each communication kind (transfer + peer-wait)."""
    return {k: mean.get(f"{k}_transfer", 0.0) + mean.get(f"{k}_wait", 0.0) for k in COMM_KINDS}


def metrics(entries: list[dict[str, Any]], step: float, phase: tuple[float, float],
            bubbles: Sequence[float]) -> dict[str, Any]:
    """The results.json keys every method derives from its per-rank breakdown and
    per-rank schedule bubbles (:func:`schedule_bubble`, in the order of ``entries``)."""
    duration = phase[1] - phase[0]
    stages = stage_breakdown(entries)
    mean = mean_breakdown(entries)
    per_stage: dict[int, list[float]] = {}
    for e, bubble in zip(entries, bubbles, strict=True):
        per_stage.setdefault(int(e["stage"]), []).append(bubble)
    return {
        "step_time_s": step,
        "time_breakdown_s": entries,
        "step_breakdown_s": mean,
        "bubble_fraction": sum(bubbles) / len(bubbles) / duration
        if bubbles and duration > 0 else 0.0,
        "bubble_fraction_per_stage": [sum(b) / len(b) / duration if duration > 0 else 0.0
                                      for _, b in sorted(per_stage.items())],
        "pipeline_phase_s": list(phase),
        "compute_s": [sum(st[c] for c in COMPUTE_CATEGORIES) for st in stages],
        "exposed_comm_s": exposed_comm(mean),
    }
