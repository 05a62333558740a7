"""A step's spans as the accounting reads them: start, end and transfer start by task
id (arrays, and compact arrays for the walks), each collective's last-arriving member, and each
task's stream predecessor.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from simulator.builder.tasks import Task


def _compact(values: np.ndarray, code: str) -> array:
    """An array's values for scalar reads: Python numbers at 8 bytes each, not a list's
    object per value (a 16,384-GPU step has tens of millions of tasks)."""
    out = array(code)
    out.frombytes(np.ascontiguousarray(values).tobytes())
    return out


@dataclass(frozen=True)
class Timing:
    """Spans by task id (arrays, and compact sequences for the walks), each
    collective's transfer start (``begin``; a task's start otherwise) and
    last-arriving member, and each task's stream predecessor (-1 for none)."""

    tasks: Sequence[Task]
    start_a: np.ndarray
    end_a: np.ndarray
    begin_a: np.ndarray
    last_arrival: Mapping[int, int]
    prev: Sequence[int]
    start: Sequence[float]
    end: Sequence[float]
    begins: Sequence[float]

    @classmethod
    def of(cls, tasks: Sequence[Task], start: np.ndarray, end: np.ndarray,
           transfer: np.ndarray, last_arrival: Mapping[int, int], prev: np.ndarray) -> Timing:
        """From every task's start and end by id, each collective's transfer start (NaN
        for other tasks) and each task's stream predecessor (-1 for none)."""
        start = np.asarray(start, dtype=np.float64)
        end = np.asarray(end, dtype=np.float64)
        begin = np.where(np.isnan(transfer), start, transfer)
        return cls(tasks, start, end, begin, last_arrival, _compact(prev.astype(np.int64), "q"),
                   _compact(start, "d"), _compact(end, "d"), _compact(begin, "d"))

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
