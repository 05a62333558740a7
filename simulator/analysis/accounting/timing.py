"""A step's spans as the accounting reads them: start, end and transfer start by task
id (arrays, and lists for the walks), each collective's last-arriving member, and each
task's stream predecessor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from simulator.builder.tasks import Task


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
