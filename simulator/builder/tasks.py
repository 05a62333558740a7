"""Task and program types: the plain data that the builder writes and the engine runs.

A :class:`Workload` is, per simulated rank, an ordered list of :class:`Task` per
stream (at full fidelity made on demand from one prototype per stage:
:mod:`simulator.builder.program`). A task is compute (a fixed duration), a collective
over a group (a :class:`~simulator.system.collectives.plan.Plan`), or a point-to-point transfer
(``dst``).
Cross-stream and cross-rank dependencies are task ids. This module knows nothing
of transformers or of SimPy: importing the engine loads no model arithmetic.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from simulator.schedules.action import Schedule
from simulator.system.collectives.plan import Plan
from simulator.system.layout import Layout

if TYPE_CHECKING:
    from simulator.builder.program import SharedPrograms

Stream = Literal["compute", "pp", "dp", "zero", "host", "cp", "tp", "replicate", "ep"]


@dataclass(slots=True)
class Task:
    id: int
    rank: int
    stream: Stream
    op: str  # "F", "B", "I", "W", "R", "tp.all_reduce", "pp.send", "dp.all_reduce", ...
    kind: str  # forward/backward/weight_grad/recompute/optimizer or a comm kind (tp, pp, ...)
    name: str
    duration: float = 0.0  # compute seconds
    plan: Plan | None = None  # collective
    group: tuple[int, ...] = ()  # collective members (all ranks, simulated or not)
    group_key: tuple[Any, ...] = ()  # identical on every member of one collective
    dst: int = -1  # p2p destination rank
    nbytes: float = 0.0
    microbatch: int = -1
    layer: int = -1
    chunk: int = 0
    deps: list[int] = field(default_factory=list)
    dependents: int = 0
    weight_s: float = 0.0  # of ``duration``, the weight-gradient share of a fused backward


@dataclass
class Program:
    rank: int
    streams: dict[str, list[Task]]


@dataclass
class Workload:
    programs: Mapping[int, Program]
    tasks: Sequence[Task]
    layout: Layout
    schedule: Schedule
    weight: float  # how many ranks one simulated rank stands for on shared links
    fidelity: str
    # asymmetric folding: per simulated rank, the ranks it stands for (else ``weight``)
    weights: dict[int, float] | None = None
    # per (rank, link class), a degraded port's bandwidth factor
    link_factors: dict[tuple[int, str], float] = field(default_factory=dict)
    # full fidelity: one prototype program per stage for all its ranks (then
    # ``programs`` and ``tasks`` are views that make task objects on first use)
    shared: SharedPrograms | None = None
    # some collective's kernels hold SMs for their whole run (Plan.sms: DeepEP's), which
    # the engine takes from the compute beside them (simulator.engine.interference)
    holds_sms: bool = False

    def weight_of(self, rank: int) -> float:
        return self.weight if self.weights is None else self.weights[rank]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Millions of small acyclic objects make CPython's cyclic collector rescan a
    growing heap again and again; nothing built here forms cycles that need it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
