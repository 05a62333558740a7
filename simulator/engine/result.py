"""What a run of the engine produces: every task's start and end by task id, each
collective's transfer start and last-arriving member, link busy time and totals.
The span list and the dictionaries of collective starts are made on demand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from simulator.builder.tasks import Workload
from simulator.system.topology import LinkId


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
    events: int
    wall_s: float
    #: lock-step groups the run simulated (:mod:`simulator.engine.lockstep`), one
    #: process per TP group standing for its ranks; 0 when every rank ran its own
    lockstep_groups: int = 0

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
