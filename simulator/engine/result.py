"""What a run of the engine produces: every task's start and end by task id, each
collective's transfer start and last-arriving member, link busy time and totals.
The span list and the dictionaries of collective starts are made on demand; a run's
tasks get their spans from the run's start after the run (:func:`run_spans`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from simulator.builder.tasks import Workload
from simulator.system.topology import LinkId

if TYPE_CHECKING:
    from simulator.engine.engine import Engine


def busy_by_class(busy: Mapping[LinkId, float], lock: int = 1) -> dict[str, float]:
    """Seconds each link class was busy, summed over its links (NVLink ports, NICs, the
    core); a lock-step group's own links count once for each of its ``lock`` ranks
    (alike by symmetry; the shared core carried the group's weight)."""
    out: dict[str, float] = {}
    for link, secs in busy.items():
        key = {"nvl": "intra_node", "nic": "inter_node"}.get(str(link[0]), "core")
        out[key] = out.get(key, 0.0) + (secs if key == "core" else secs * lock)
    return out


@dataclass
class SimResult:
    """Times by task id (``start``, ``end``; ``begin``: a collective's transfer start,
    else NaN; ``last``: the member task that arrived last, else -1) and totals."""

    workload: Workload
    start: np.ndarray
    end: np.ndarray
    begin: np.ndarray
    last: np.ndarray
    link_busy: dict[str, float]  # seconds per link class, summed over simulated links
    end_time: float
    events: int  # SimPy events scheduled
    wall_s: float
    #: lock-step groups the run simulated (:mod:`simulator.engine.lockstep`), one
    #: process per TP group standing for its ranks; 0 when every rank ran its own
    lockstep_groups: int = 0
    #: events the per-step path would have scheduled for the steps chains ran in
    #: closed form, beyond the one each chain holds (:mod:`simulator.engine.chains`)
    merged_events: int = 0

    @cached_property
    def spans(self) -> list[tuple[int, float, float]]:
        """(task id, start, end) of every task, by id."""
        return list(zip(range(len(self.start)), self.start.tolist(), self.end.tolist(),
                        strict=True))

    @cached_property
    def comm_start(self) -> dict[int, float]:
        """Collective task id -> when its transfer began (every member had arrived)."""
        ids = np.flatnonzero(~np.isnan(self.begin))
        return dict(zip(ids.tolist(), self.begin[ids].tolist(), strict=True))

    @cached_property
    def last_arrival(self) -> dict[int, int]:
        """Collective task id -> the member task that arrived last (for the members
        that waited)."""
        ids = np.flatnonzero(self.last >= 0)
        return dict(zip(ids.tolist(), self.last[ids].tolist(), strict=True))


def run_spans(e: Engine) -> tuple[np.ndarray, np.ndarray]:
    """Start and end by task id: collectives and sends as they ran, a run's tasks
    from the run's start and their durations summed in order."""
    start = np.frombuffer(e.start, np.float64).copy()
    end = np.frombuffer(e.end, np.float64).copy()
    t0 = np.frombuffer(e.run_t0, np.float64)
    layouts: dict[int, tuple[np.ndarray, ...]] = {}
    points = e.interference.slow_points if e.interference is not None else {}
    slow = np.fromiter(sorted(points), np.int64)  # runs interference stretched
    for inst in e.instances:
        tmpl = inst.template
        if not tmpl.runs:
            continue
        got = layouts.get(id(tmpl))
        if got is None:
            locals_, first, lens = tmpl.layout
            run_no = np.repeat(np.arange(len(lens)), lens)
            got = layouts[id(tmpl)] = (
                locals_, run_no, tmpl.duration_array[locals_],
                tmpl.prefixes(tmpl.durations), np.append(first, len(locals_)))
        locals_, run_no, dur, prefix, offsets = got
        if inst.durations is not tmpl.durations:  # a slow or jittered rank's own
            dur = np.asarray(inst.durations, np.float64)[locals_]
            prefix = tmpl.prefixes(inst.durations)
        ids = (locals_ + inst.ids.start if isinstance(inst.ids, range)
               else inst.id_array()[locals_])
        s = t0[inst.run_base + run_no] + prefix
        start[ids] = s
        end[ids] = s + dur
        lo, hi = np.searchsorted(slow, (inst.run_base, inst.run_base + len(tmpl.runs)))
        for run in slow[lo:hi].tolist():  # work done -> time, piecewise linear
            work, when = zip(*points[run], strict=True)
            k = run - inst.run_base
            sl = slice(int(offsets[k]), int(offsets[k + 1]))
            start[ids[sl]] = np.interp(prefix[sl], work, when)
            end[ids[sl]] = np.interp(prefix[sl] + dur[sl], work, when)
    return start, end
