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
(ZeRO-Offload's CPU Adam) is ``optimizer``, and so is gradient compression's work on
the ``dp`` stream; FSDP2's copies on the ``zero`` and ``dp`` streams are their pass's
(forward, backward) or ``optimizer`` (the gradient accumulate); the walk continues
past such kernels to what they waited for. The idle after a
rank's last task is pipeline idle until its pipeline's last backward ends (the drain: peer-waits
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

import numpy as np

from simulator.builder.tasks import Task
from simulator.schedules.schedule import schedule_spec

COMPUTE_CATEGORIES = ("forward", "backward_input", "backward_weight", "recompute", "optimizer")
#: Communication kinds, each with a transfer and a peer-wait category.
COMM_KINDS = ("tp", "pp", "dp", "zero", "offload", "embedding_tie", "ep", "cp")
COMM_CATEGORIES = tuple(f"{k}_{part}" for k in COMM_KINDS for part in ("transfer", "wait"))
#: Peer-wait: at a collective until its last member arrives (waiting for the slowest rank).
WAIT_CATEGORIES = tuple(f"{k}_wait" for k in COMM_KINDS)
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
    """Spans by task id (arrays, and lists for the walks), each collective's transfer
    start (``begin``; a task's start otherwise) and last-arriving member, and each
    task's stream predecessor (-1 for none)."""

    tasks: Sequence[Task]
    start_a: np.ndarray
    end_a: np.ndarray
    begin_a: np.ndarray
    last_arrival: Mapping[int, int]
    prev: list[int]
    start: list[float]
    end: list[float]
    begins: list[float]

    @classmethod
    def of(cls, tasks: Sequence[Task], spans: Sequence[tuple[int, float, float]],
           comm_start: Mapping[int, float], last_arrival: Mapping[int, int],
           streams: Iterable[Sequence[Task]]) -> Timing:
        n = len(tasks)
        flat = np.fromiter(itertools.chain.from_iterable(spans), float, 3 * len(spans))
        flat = flat.reshape(-1, 3)
        ids = flat[:, 0].astype(np.int64)
        start, end = np.zeros(n), np.zeros(n)
        start[ids] = flat[:, 1]
        end[ids] = flat[:, 2]
        begin = start.copy()
        if comm_start:
            keys = np.fromiter(comm_start.keys(), np.int64, len(comm_start))
            begin[keys] = np.fromiter(comm_start.values(), float, len(comm_start))
        prev = np.full(n, -1, dtype=np.int64)
        for stream in streams:
            if len(stream) > 1:
                sid = np.fromiter((t.id for t in stream), np.int64, len(stream))
                prev[sid[1:]] = sid[:-1]
        return cls(tasks, start, end, begin, last_arrival, prev.tolist(), start.tolist(),
                   end.tolist(), begin.tolist())

    def begin(self, tid: int) -> float:
        return self.begins[tid]

    def predecessor(self, tid: int) -> int | None:
        """Whichever of the task's dependencies and stream predecessor ended last."""
        end = self.end
        best: int | None = None
        best_end = -1.0
        p = self.prev[tid]
        if p >= 0:
            best, best_end = p, end[p]
        for d in self.tasks[tid].deps:
            if end[d] > best_end:
                best, best_end = d, end[d]
        return best


def _kernel_category(task: Task) -> str:
    """The category of a kernel that runs off the compute stream, by its kind."""
    if task.kind == "backward":
        return "backward_weight" if task.weight_s else "backward_input"
    return _KIND_CATEGORY.get(task.kind, "optimizer")


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
        if not is_comm(task) and task.stream in ("dp", "zero"):  # kernels on a comm stream:
            # gradient compression's (optimizer), FSDP2's copies (their pass's)
            began = max(lo, timing.start[tid])
            out[_kernel_category(task)] += hi - began
            hi = began
            tid = timing.predecessor(tid)
            continue
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


_KIND_CODE = {"forward": 0, "backward": 1, "weight_grad": 2, "recompute": 3, "optimizer": 4,
              **{k: 5 + i for i, k in enumerate(COMM_KINDS)}}
_COLUMN = {c: i for i, c in enumerate((*CATEGORIES, _PIPELINE))}
_OWN_COLUMN = np.array([_COLUMN[c] for c in ("forward", "backward_input", "backward_weight",
                                             "recompute", "optimizer")], dtype=np.int64)
_TRANSFER_COLUMN = np.array([_COLUMN[f"{k}_transfer"] for k in COMM_KINDS], dtype=np.int64)
_WAIT_COLUMN = np.array([_COLUMN[f"{k}_wait"] for k in COMM_KINDS], dtype=np.int64)


@dataclass
class _Stream:
    """One rank's compute stream as arrays, in program order."""

    ids: np.ndarray
    code: np.ndarray  # _KIND_CODE (other kinds count as the optimizer)
    weight: np.ndarray  # the weight-gradient share of a fused backward
    mb: np.ndarray  # micro-batch, -1 outside the passes
    start: np.ndarray
    end: np.ndarray
    begin: np.ndarray

    @classmethod
    def of(cls, timing: Timing, compute: Sequence[Task]) -> _Stream:
        n = len(compute)
        ids = np.fromiter((t.id for t in compute), np.int64, n)
        code = np.fromiter((_KIND_CODE.get(t.kind, 4) for t in compute), np.int64, n)
        weight = np.fromiter((t.weight_s for t in compute), float, n)
        mb = np.fromiter((t.microbatch for t in compute), np.int64, n)
        return cls(ids, code, weight, mb, timing.start_a[ids], timing.end_a[ids],
                   timing.begin_a[ids])

    @property
    def last_pipeline_end(self) -> float:
        """When its last forward, backward or recompute ends (0 if it has none)."""
        ends = self.end[self.code <= 3]
        return float(ends[-1]) if len(ends) else 0.0

    def pass_times(self) -> tuple[float, float, float]:
        """Busy seconds of the forward, backward-input and backward-weight passes
        (recompute counts as backward); communication of a micro-batch on the compute
        stream goes to the pass it sits in, the optimizer and synchronisation to none."""
        dur = self.end - self.start
        passes = np.array([0, 1, 2, 1, -1, *([-1] * len(COMM_KINDS))])[self.code]
        at = np.where(passes >= 0, np.arange(len(passes)), -1)
        last = np.maximum.accumulate(at) if len(at) else at
        current = np.where(last >= 0, passes[np.maximum(last, 0)], 0)
        comm = (self.code >= 5) & (self.mb >= 0)
        fused = self.code == 1
        f = dur[self.code == 0].sum() + dur[comm & (current == 0)].sum()
        bi = (dur - self.weight)[fused].sum() + dur[self.code == 3].sum() \
            + dur[comm & (current == 1)].sum()
        bw = self.weight[fused].sum() + dur[self.code == 2].sum() \
            + dur[comm & (current == 2)].sum()
        return float(f), float(bi), float(bw)


def rank_breakdown(timing: Timing, rank: int, stream: _Stream, step_time: float,
                   phase_end: float, ideal_idle: float) -> dict[str, float]:
    """Disjoint categories of one rank's step (see the module notes)."""
    cols = np.zeros(len(_COLUMN))
    dur = stream.end - stream.start
    code = stream.code
    own = code < 5
    kind = np.maximum(code - 5, 0)
    # own time: compute by kind (a fused backward split), comm as wait then transfer
    weight = np.where(code == 1, stream.weight, 0.0)
    np.add.at(cols, _OWN_COLUMN[np.minimum(code[own], 4)], (dur - weight)[own])
    cols[_COLUMN["backward_weight"]] += weight.sum()
    comm = ~own
    wait = np.clip(np.minimum(stream.begin, stream.end) - stream.start, 0.0, None)[comm]
    # after its last pipeline compute and until its pipeline's last backward ends, a
    # rank is in the drain: idle and peer-waits there are the schedule's
    drain = stream.last_pipeline_end
    start = stream.start[comm]
    in_drain = np.clip(np.minimum(start + wait, phase_end) - np.maximum(start, drain), 0.0,
                       None)
    np.add.at(cols, _TRANSFER_COLUMN[kind[comm]], dur[comm] - wait)
    np.add.at(cols, _WAIT_COLUMN[kind[comm]], wait - in_drain)
    cols[_COLUMN[_PIPELINE]] += in_drain.sum()
    # idle gaps: the drain's part, then the rest explained by what the task waited for
    cursor = np.concatenate(([0.0], np.maximum.accumulate(stream.end)[:-1])) \
        if len(dur) else np.zeros(0)
    gaps = np.flatnonzero(stream.start > cursor)
    lo, hi = cursor[gaps], stream.start[gaps]
    gap_drain = np.clip(np.minimum(hi, phase_end) - np.maximum(lo, drain), 0.0, None)
    cols[_COLUMN[_PIPELINE]] += gap_drain.sum()
    out = dict(zip((*CATEGORIES, _PIPELINE), cols.tolist(), strict=True))
    for i, a, b in zip(stream.ids[gaps].tolist(), (lo + gap_drain).tolist(), hi.tolist(),
                       strict=True):
        if b > a:
            explain_gap(timing, rank, timing.predecessor(i), a, b, out)
    last = float(stream.end.max()) if len(dur) else 0.0
    if step_time > last:
        tail_drain = max(0.0, min(step_time, phase_end) - max(last, drain))
        out[_PIPELINE] += tail_drain
        out["tail"] += step_time - last - tail_drain
    idle = out.pop(_PIPELINE)
    out["pipeline_bubble"] = min(idle, max(ideal_idle, 0.0))
    out["imbalance_idle"] += idle - out["pipeline_bubble"]
    return out


def _phase(streams: Iterable[_Stream]) -> tuple[float, float]:
    """The pipeline phase: the first forward's start to the last backward's end."""
    starts, ends = [], []
    for stream in streams:
        work = stream.code <= 3  # forward, backward, weight gradient, recompute
        if work.any():
            starts.append(float(stream.start[work].min()))
            ends.append(float(stream.end[work].max()))
    return (min(starts), max(ends)) if starts else (0.0, 0.0)


def breakdown(timing: Timing, programs: Mapping[int, Sequence[Task]], stage_of: Mapping[int, int],
              pipeline_of: Mapping[int, Any], step_time: float, schedule: str, p: int, m: int,
              v: int) -> tuple[list[dict[str, Any]], list[float], tuple[float, float]]:
    """``time_breakdown_s`` (one entry per simulated rank; ``programs`` maps a rank to its
    compute stream), each rank's schedule bubble (:func:`schedule_bubble`) and the
    pipeline phase. Ranks with equal ``pipeline_of`` form one pipeline, whose drain ends
    with its last backward."""
    closed_form = schedule_spec(schedule).pipeline_time
    streams = {r: _Stream.of(timing, compute) for r, compute in programs.items()}
    phase = _phase(streams.values())
    ends: dict[Any, float] = {}
    for r, stream in streams.items():
        key = pipeline_of[r]
        ends[key] = max(ends.get(key, 0.0), stream.last_pipeline_end)
    entries, bubbles = [], []
    for rank in sorted(programs):
        stream = streams[rank]
        f, bi, bw = (x / m for x in stream.pass_times())
        ideal = closed_form(p, m, v, f, bi, bw) - m * (f + bi + bw)
        entry: dict[str, Any] = {"rank": rank, "stage": stage_of[rank]}
        entry.update(rank_breakdown(timing, rank, stream, step_time, ends[pipeline_of[rank]],
                                    ideal))
        entries.append(entry)
        bubbles.append(schedule_bubble(ideal, phase[1] - phase[0] - m * (f + bi + bw)))
    return entries, bubbles, phase


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
    """Earliest first (from :func:`critical_path`'s latest-first order), neighbours of the
    same rank and category merged."""
    merged: list[dict[str, Any]] = []
    ordered = list(segments)
    if any(x[1] > y[1] for x, y in itertools.pairwise(ordered)):
        ordered.reverse()  # critical_path gives them latest first
    for rank, a, b, category in ordered:
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
    """``step_breakdown_s``: each category's mean over the entries (ranks); an entry
    that stands for several ranks (asymmetric folding's ``ranks``) counts that often."""
    weights = [float(e.get("ranks", 1)) for e in entries]
    n = sum(weights) or 1.0
    return {c: sum(w * float(e.get(c, 0.0)) for w, e in zip(weights, entries, strict=True)) / n
            for c in CATEGORIES}


def stage_breakdown(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Each category's mean over the entries of each pipeline stage, by stage."""
    by_stage: dict[int, list[Mapping[str, Any]]] = {}
    for e in entries:
        by_stage.setdefault(int(e["stage"]), []).append(e)
    return [mean_breakdown(by_stage[s]) for s in sorted(by_stage)]


def exposed_comm(mean: Mapping[str, float]) -> dict[str, float]:
    """Seconds a rank is held back by each communication kind (transfer + peer-wait)."""
    return {k: mean.get(f"{k}_transfer", 0.0) + mean.get(f"{k}_wait", 0.0) for k in COMM_KINDS}


def _weighted_mean(pairs: Sequence[tuple[float, float]]) -> float:
    total = sum(w for w, _ in pairs)
    return sum(w * x for w, x in pairs) / total if total else 0.0


def metrics(entries: list[dict[str, Any]], step: float, phase: tuple[float, float],
            bubbles: Sequence[float]) -> dict[str, Any]:
    """The results.json keys every method derives from its per-rank breakdown and
    per-rank schedule bubbles (:func:`schedule_bubble`, in the order of ``entries``)."""
    duration = phase[1] - phase[0]
    stages = stage_breakdown(entries)
    mean = mean_breakdown(entries)
    per_stage: dict[int, list[tuple[float, float]]] = {}
    for e, bubble in zip(entries, bubbles, strict=True):
        per_stage.setdefault(int(e["stage"]), []).append((float(e.get("ranks", 1)), bubble))
    every = [(float(e.get("ranks", 1)), b) for e, b in zip(entries, bubbles, strict=True)]
    return {
        "step_time_s": step,
        "time_breakdown_s": entries,
        "step_breakdown_s": mean,
        "bubble_fraction": _weighted_mean(every) / duration if bubbles and duration > 0
        else 0.0,
        "bubble_fraction_per_stage": [_weighted_mean(b) / duration if duration > 0 else 0.0
                                      for _, b in sorted(per_stage.items())],
        "pipeline_phase_s": list(phase),
        "compute_s": [sum(st[c] for c in COMPUTE_CATEGORIES) for st in stages],
        "exposed_comm_s": exposed_comm(mean),
    }
