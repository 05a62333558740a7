"""Each rank's step as disjoint categories that sum to the step time (the package
notes): its compute stream's own time by kind, its collectives' peer-wait and transfer,
and every idle gap explained by walking back along what the task after it waited for;
pipeline idle split into the schedule's bubble and imbalance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from simulator.analysis.accounting.timing import Timing
from simulator.analysis.accounting.vocabulary import (
    KIND_CATEGORY,
    PIPELINE,
    Vocabulary,
    comm_category,
    is_comm,
    vocabulary,
)
from simulator.builder.columns import TaskColumns
from simulator.builder.tasks import Task
from simulator.schedules.registry import schedule_spec


def _kernel_category(task: Task) -> str:
    """The category of a kernel that runs off the compute stream, by its kind."""
    if task.kind == "backward":
        return "backward_weight" if task.weight_s else "backward_input"
    return KIND_CATEGORY.get(task.kind, "optimizer")


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
            out[PIPELINE] += hi - lo
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
                PIPELINE if via_pipeline else "imbalance_idle"
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
    kinds: int  # communication kinds, whose codes follow the five compute codes

    @classmethod
    def of(cls, timing: Timing, ids: np.ndarray, columns: TaskColumns,
           vocab: Vocabulary) -> _Stream:
        """The compute stream whose task ids, in program order, are ``ids``."""
        kind_codes = np.asarray([vocab.kind_code.get(k, 4) for k in columns.values["kind"]],
                                dtype=np.int64)
        code = kind_codes[columns.codes["kind"][ids]] if len(kind_codes) \
            else np.zeros(len(ids), np.int64)
        mb = columns.numbers["microbatch"][ids].astype(np.int64)
        return cls(ids, code, columns.numbers["weight_s"][ids], mb, timing.start_a[ids],
                   timing.end_a[ids], timing.begin_a[ids], len(vocab.kinds))

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
        passes = np.array([0, 1, 2, 1, -1, *([-1] * self.kinds)])[self.code]
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
                   phase_end: float, ideal_idle: float, vocab: Vocabulary) -> dict[str, float]:
    """Disjoint categories of one rank's step (see the module notes)."""
    cols = np.zeros(len(vocab.column))
    dur = stream.end - stream.start
    code = stream.code
    own = code < 5
    kind = np.maximum(code - 5, 0)
    # own time: compute by kind (a fused backward split), comm as wait then transfer
    weight = np.where(code == 1, stream.weight, 0.0)
    np.add.at(cols, vocab.own_column[np.minimum(code[own], 4)], (dur - weight)[own])
    cols[vocab.column["backward_weight"]] += weight.sum()
    comm = ~own
    wait = np.clip(np.minimum(stream.begin, stream.end) - stream.start, 0.0, None)[comm]
    # after its last pipeline compute and until its pipeline's last backward ends, a
    # rank is in the drain: idle and peer-waits there are the schedule's
    drain = stream.last_pipeline_end
    start = stream.start[comm]
    in_drain = np.clip(np.minimum(start + wait, phase_end) - np.maximum(start, drain), 0.0,
                       None)
    np.add.at(cols, vocab.transfer_column[kind[comm]], dur[comm] - wait)
    np.add.at(cols, vocab.wait_column[kind[comm]], wait - in_drain)
    cols[vocab.column[PIPELINE]] += in_drain.sum()
    # idle gaps: the drain's part, then the rest explained by what the task waited for
    cursor = np.concatenate(([0.0], np.maximum.accumulate(stream.end)[:-1])) \
        if len(dur) else np.zeros(0)
    gaps = np.flatnonzero(stream.start > cursor)
    lo, hi = cursor[gaps], stream.start[gaps]
    gap_drain = np.clip(np.minimum(hi, phase_end) - np.maximum(lo, drain), 0.0, None)
    cols[vocab.column[PIPELINE]] += gap_drain.sum()
    out = dict(zip((*vocab.categories, PIPELINE), cols.tolist(), strict=True))
    for i, a, b in zip(stream.ids[gaps].tolist(), (lo + gap_drain).tolist(), hi.tolist(),
                       strict=True):
        if b > a:
            explain_gap(timing, rank, timing.predecessor(i), a, b, out)
    last = float(stream.end.max()) if len(dur) else 0.0
    if step_time > last:
        tail_drain = max(0.0, min(step_time, phase_end) - max(last, drain))
        out[PIPELINE] += tail_drain
        out["tail"] += step_time - last - tail_drain
    idle = out.pop(PIPELINE)
    out["pipeline_bubble"] = min(idle, max(ideal_idle, 0.0))
    out["imbalance_idle"] += idle - out["pipeline_bubble"]
    return out


def _work_span(stream: _Stream) -> tuple[float, float] | None:
    """When the stream's pipeline work (forward, backward, weight gradient, recompute)
    starts and ends; None without any."""
    work = stream.code <= 3
    if not work.any():
        return None
    return float(stream.start[work].min()), float(stream.end[work].max())


def breakdown(timing: Timing, columns: TaskColumns, ranks: Sequence[int],
              stage_of: Mapping[int, int], pipeline_of: Mapping[int, Any], step_time: float,
              schedule: str, p: int, m: int, v: int,
              ) -> tuple[list[dict[str, Any]], list[float], tuple[float, float]]:
    """``time_breakdown_s`` (one entry per simulated rank of ``ranks``, whose compute
    streams ``columns`` gives), each rank's schedule bubble (:func:`schedule_bubble`) and
    the pipeline phase. Ranks with equal ``pipeline_of`` form one pipeline, whose drain
    ends with its last backward. A rank's stream is read twice (for the phase and the
    drains, then for its entry), never every rank's at once: they are as large as the
    spans (0.8 GB for GPT-3 on 1,024 GPUs at full fidelity)."""
    closed_form = schedule_spec(schedule).pipeline_time
    vocab = vocabulary()

    def stream_of(rank: int) -> _Stream:
        return _Stream.of(timing, columns.compute(rank), columns, vocab)

    work: list[tuple[float, float]] = []
    ends: dict[Any, float] = {}
    for r in ranks:
        stream = stream_of(r)
        if (span := _work_span(stream)) is not None:
            work.append(span)
        key = pipeline_of[r]
        ends[key] = max(ends.get(key, 0.0), stream.last_pipeline_end)
    phase = (min(a for a, _ in work), max(b for _, b in work)) if work else (0.0, 0.0)
    entries, bubbles = [], []
    for rank in sorted(ranks):
        stream = stream_of(rank)
        f, bi, bw = (x / m for x in stream.pass_times())
        ideal = closed_form(p, m, v, f, bi, bw) - m * (f + bi + bw)
        entry: dict[str, Any] = {"rank": rank, "stage": stage_of[rank]}
        entry.update(rank_breakdown(timing, rank, stream, step_time, ends[pipeline_of[rank]],
                                    ideal, vocab))
        entries.append(entry)
        bubbles.append(schedule_bubble(ideal, phase[1] - phase[0] - m * (f + bi + bw)))
    return entries, bubbles, phase


def schedule_bubble(ideal: float, without_pipeline_work: float) -> float:
    """The bubble as the literature defines it, for one rank: the part of the pipeline
    phase in which the rank has no forward or backward work of its own, at most the
    closed form for its speed (the rest is imbalance). Unlike the ``pipeline_bubble``
    category it keeps the time that other work (an early optimizer step) filled."""
    return min(max(ideal, 0.0), max(without_pipeline_work, 0.0))
