"""The critical path: from the event that ends last, walk back. A task's own time is
on the path; a collective's wait jumps to the member that arrived last; otherwise the
predecessor is whichever of its dependencies and its stream predecessor ended last. The
segments cover ``[0, step_time]`` and their composition by category sums to the step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from simulator.analysis.accounting.timing import Timing
from simulator.analysis.accounting.vocabulary import (
    categories,
    comm_category,
    is_comm,
    own_categories,
)


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
        arrived = timing.arrived(tid)
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
    out = dict.fromkeys(categories(), 0.0)
    for seg in segments:
        out[seg["category"]] += seg["end"] - seg["start"]
    return out
