"""A step's spans as the accounting reads them: start, end and transfer start by task
id (arrays, and views of them for the walks' scalar reads), each collective's
last-arriving member, and each task's stream predecessor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simulator.builder.tasks import Task


def _scalars(values: np.ndarray) -> memoryview:
    """An array's values for scalar reads, as Python numbers: a view of its buffer (a
    list would hold an object per value, a copy 8 bytes more per value; a 16,384-GPU
    step has tens of millions of tasks), read as fast as :class:`array.array`."""
    return np.ascontiguousarray(values).data


@dataclass(frozen=True)
class Timing:
    """Spans by task id (arrays, and compact sequences for the walks), each
    collective's transfer start (``begin``; a task's start otherwise) and
    last-arriving member, and each task's stream predecessor (-1 for none)."""

    tasks: Sequence[Task]
    start_a: np.ndarray
    end_a: np.ndarray
    begin_a: np.ndarray
    last: memoryview  # by task id: the member that arrived last, -1 for none
    prev: memoryview
    start: memoryview
    end: memoryview
    begins: memoryview

    @classmethod
    def of(cls, tasks: Sequence[Task], start: np.ndarray, end: np.ndarray,
           transfer: np.ndarray, last: np.ndarray, prev: np.ndarray) -> Timing:
        """From every task's start and end by id, each collective's transfer start (NaN
        for other tasks) and last-arriving member (-1 for other tasks and a collective
        with no wait), and each task's stream predecessor (-1 for none)."""
        start = np.ascontiguousarray(start, dtype=np.float64)
        end = np.ascontiguousarray(end, dtype=np.float64)
        begin = np.where(np.isnan(transfer), start, transfer)
        return cls(tasks, start, end, begin, _scalars(last.astype(np.int64, copy=False)),
                   _scalars(prev.astype(np.int64, copy=False)), _scalars(start),
                   _scalars(end), _scalars(begin))

    def begin(self, tid: int) -> float:
        return self.begins[tid]

    def arrived(self, tid: int) -> int:
        """The member of collective ``tid`` that arrived last (``tid`` itself for a task
        that is not a collective or a collective whose members did not wait)."""
        last = int(self.last[tid])
        return last if last >= 0 else tid

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
