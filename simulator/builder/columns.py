"""Every task's attributes as arrays by task id: what the accounting and the span table
read after a run, without a Python object per task.

A full-fidelity workload shares one prototype program per stage
(:mod:`simulator.builder.program`), and its ``tasks`` are a view that makes task
objects per rank on first use. Reading an attribute of every task through that view
made all of them: 14.6 million objects, 13.6 GB and most of the command's time for
GPT-3 on 1,024 GPUs. Here a stage's attributes are read once from its prototype and
tiled over the stage's ranks (task ids run rank by rank, each rank's tasks in its
prototype's order); a rank's compute factors (slow GPUs, jitter) scale its work
tasks' ``weight_s`` exactly as :meth:`SharedPrograms.tasks_of` does, and ranks whose
task objects were made (and may have been changed) are read from those. Any other
workload is read task by task.

Text attributes are codes into their values, numbered in order of first appearance
by task id (what a pass over the tasks in id order gives), so tables built from
either representation are identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
import pandas as pd

from simulator.builder.program import SharedPrograms, TaskView
from simulator.builder.tasks import Task, Workload
from simulator.system.collectives.plan import Plan

TEXT = ("stream", "op", "kind", "name")
NUMERIC = {"rank": np.int32, "microbatch": np.int32, "layer": np.int32, "chunk": np.int32,
           "nbytes": np.float64, "weight_s": np.float64}


@dataclass(frozen=True)
class TaskColumns:
    """Attributes by task id: ``codes[attr]`` into ``values[attr]`` for the text ones,
    ``numbers[attr]`` for the others; ``prev``, each task's predecessor on its stream
    (-1 for none); ``plan_ids``, the collectives' ids in order, and ``plans`` their
    plans; ``compute``, each rank's compute stream as ids in program order."""

    codes: dict[str, np.ndarray]
    values: dict[str, list[str]]
    numbers: dict[str, np.ndarray]
    prev: np.ndarray
    plan_ids: np.ndarray
    plans: list[Plan]
    compute: Callable[[int], np.ndarray]

    def __len__(self) -> int:
        return len(self.prev)

    def categorical(self, attr: str, order: np.ndarray) -> pd.Categorical:
        """A text attribute of the tasks ``order`` names, as a categorical."""
        return pd.Categorical.from_codes(self.codes[attr][order].astype(np.int32, copy=False),
                                         self.values[attr])

    def text(self, attr: str, ids: np.ndarray) -> list[str]:
        values = self.values[attr]
        return [values[c] for c in self.codes[attr][ids].tolist()]


class _Codes(dict[Any, int]):
    """Value → code, numbering new values as they come."""

    def __missing__(self, key: Any) -> int:
        code = self[key] = len(self)
        return code


def _read(tasks: Sequence[Task], tables: dict[str, _Codes]) -> dict[str, np.ndarray]:
    """Every attribute of ``tasks`` as arrays, the text ones coded through ``tables``."""
    n = len(tasks)
    out = {attr: np.fromiter(map(table.__getitem__, map(attrgetter(attr), tasks)), np.int32, n)
           for attr, table in tables.items()}
    for attr, dtype in NUMERIC.items():
        out[attr] = np.fromiter(map(attrgetter(attr), tasks), dtype, n)
    return out


def _stream_prev(n: int, streams: Sequence[Sequence[int]]) -> np.ndarray:
    prev = np.full(n, -1, dtype=np.int64)
    for ids in streams:
        if len(ids) > 1:
            arr = np.asarray(ids, dtype=np.int64)
            prev[arr[1:]] = arr[:-1]
    return prev


def task_columns(w: Workload) -> TaskColumns:
    """The columns of ``w``'s tasks (see the module notes)."""
    if w.shared is not None and isinstance(w.tasks, TaskView):
        return _shared_columns(w.shared, w.tasks)
    tables = {attr: _Codes() for attr in TEXT}
    tasks = w.tasks
    cols = _read(tasks, tables)
    streams = [[t.id for t in ts] for prog in w.programs.values() for ts in prog.streams.values()]
    plan_ids = [t.id for t in tasks if t.plan is not None]
    computes = {r: np.fromiter((t.id for t in prog.streams.get("compute", [])), np.int64)
                for r, prog in w.programs.items()}
    return TaskColumns({a: cols[a] for a in TEXT}, {a: list(tables[a]) for a in TEXT},
                       {a: cols[a] for a in NUMERIC}, _stream_prev(len(tasks), streams),
                       np.asarray(plan_ids, dtype=np.int64),
                       [p for p in (tasks[i].plan for i in plan_ids) if p is not None],
                       computes.__getitem__)


def _shared_columns(shared: SharedPrograms, view: TaskView) -> TaskColumns:
    layout, per = shared.layout, shared.layout.per_stage
    tables = {attr: _Codes() for attr in TEXT}
    dtypes = {**dict.fromkeys(TEXT, np.int32), **NUMERIC, "prev": np.int64}
    n = sum(len(shared.protos[q]) for q in range(layout.pp)) * per
    # filled stage by stage in place (a list of parts then one concatenation held every
    # column twice: 1.7 GB more at 31 million tasks)
    arrays = {attr: np.empty(n, dtype) for attr, dtype in dtypes.items()}
    plan_ids: list[np.ndarray] = []
    plans: list[Plan] = []
    for q in range(layout.pp):
        proto = shared.protos[q]
        size = len(proto)
        cols = _read(proto, tables)
        cols["prev"] = _stream_prev(size, list(shared.streams[q].values()))
        firsts = np.asarray([shared.first_id(q * per + d) for d in range(per)], dtype=np.int64)
        base = int(firsts[0]) if per else 0
        blocks = {attr: a[base:base + size * per].reshape(per, size)
                  for attr, a in arrays.items()}
        for attr, block in blocks.items():
            if attr != "rank":  # the prototype's is its first rank's
                block[:] = cols[attr]
        blocks["rank"][:] = np.arange(q * per, (q + 1) * per, dtype=np.int32)[:, None]
        np.add(blocks["prev"], firsts[:, None], out=blocks["prev"],
               where=(cols["prev"] >= 0)[None, :])
        coll = [i for i, t in enumerate(proto) if t.plan is not None]
        if coll:
            plan_ids.append((firsts[:, None] + np.asarray(coll, dtype=np.int64)).ravel())
            plans.extend([p for p in (proto[i].plan for i in coll) if p is not None] * per)
    for rank, factors in shared.factors.items():  # per-rank compute factors
        mask, first = shared.work_mask(rank // per), shared.first_id(rank)
        block = arrays["weight_s"][first:first + len(mask)]
        block[mask] *= factors
    for rank, tasks in view.made().items():  # objects that may have been changed
        first = shared.first_id(rank)
        for attr, values in _read(tasks, tables).items():
            arrays[attr][first:first + len(tasks)] = values
    compute = {q: np.asarray(shared.streams[q].get("compute", []), dtype=np.int64)
               for q in range(layout.pp)}
    return TaskColumns({a: arrays[a] for a in TEXT}, {a: list(tables[a]) for a in TEXT},
                       {a: arrays[a] for a in NUMERIC}, arrays["prev"],
                       np.concatenate(plan_ids) if plan_ids else np.zeros(0, np.int64), plans,
                       lambda r: shared.first_id(r) + compute[r // per])
