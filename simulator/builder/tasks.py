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
    from simulator.builder.lazy import Copies
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
    # some collective whose kernels hold SMs for their whole run (Plan.sms: DeepEP's,
    # NCCL's channels) runs on a stream beside the compute, whose runs the engine then
    # slows (simulator.engine.interference); on the compute stream it overlaps none
    holds_sms: bool = False
    #: a folded build's stamped copies whose tasks are made when read
    #: (:mod:`simulator.builder.lazy`; then ``programs`` and ``tasks`` are views over
    #: its raw lists, which the engine reads with the records)
    stamped: Copies | None = None

    def weight_of(self, rank: int) -> float:
        return self.weight if self.weights is None else self.weights[rank]


class _Heap:
    """The collector's tracked objects as last counted here (``tracked``) and after the
    last full pass here (``base``), and the objects pauses made since the count."""

    made = 0
    tracked = 0
    base = 0


@contextmanager
def gc_paused() -> Iterator[None]:
    """Millions of small acyclic objects make CPython's cyclic collector rescan a
    growing heap again and again; nothing built here forms cycles that need it.

    On the way out, what was made moves to the oldest generation unscanned
    (``gc.freeze`` then ``gc.unfreeze``): left young, the next young collection would
    walk every object made under the pause (a third of a folded GPT-3 build and
    simulation's CPU). What the collector then does not count toward a full pass, this
    does: once the tracked objects have doubled since the last one it saw, a full
    collection (amortised: each object scanned once per doubling of the heap)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            try:  # a signal's exception inside the promotion must not leave gc disabled
                _promote()
            finally:
                gc.enable()


def _promote() -> None:
    if gc.get_freeze_count():  # someone froze objects (before a fork): leave them be
        return
    _Heap.made += gc.get_count()[0]  # net objects made since the last young pass
    gc.freeze()
    if _Heap.made <= max(_Heap.tracked, 500_000):  # too few to double the heap
        gc.unfreeze()
        return
    tracked = gc.get_freeze_count()  # a walk over every object: done this rarely
    gc.unfreeze()
    _Heap.made, _Heap.tracked = 0, tracked
    if not _Heap.base:
        _Heap.base = tracked
    elif tracked > 2 * _Heap.base:
        gc.collect()
        gc.freeze()
        _Heap.base = _Heap.tracked = gc.get_freeze_count()
        gc.unfreeze()
