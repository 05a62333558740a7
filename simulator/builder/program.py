"""Shared programs: a full-fidelity workload as one prototype program per stage.

Every rank of a pipeline stage runs the same program; ranks differ only in the
ids in it: their own, their groups' and their peers'. The builder therefore
builds one *prototype* per stage, the program of the stage's first rank
(dp 0, tp 0, cp 0, what folded simulation builds), and :class:`SharedPrograms`
stands for the rest. Rank ``r`` of stage ``q`` is its prototype with every
rank id moved by the permutation that translates the (dp, tp, cp) coordinates by
``r``'s (:meth:`SharedPrograms.peer`): a group becomes ``r``'s group of the same
kind (tensor, data, context parallel, the tied embedding's), a destination
``r``'s peer in the other stage. Task ids follow the per-rank build's: rank by
rank, each rank's tasks in its prototype's order, so task ``i`` is the same task
in either representation.

Sharing is exact only where that permutation maps every group of the prototype
onto a group the builder would give the rank, spanning as many nodes (so its
collective's plan is the same): :func:`share` checks that for every rank and
every group, and the builder falls back to building every rank when it fails
(a mixture of experts' groups, whose token loads differ by rank, never share).
Per-rank compute factors (slow GPUs, jitter) are kept apart from the prototypes
as arrays.

Nothing here runs: the engine (:mod:`simulator.engine.engine`) walks the prototypes
with each rank's ids. Code that wants task objects gets them from
:class:`TaskView` and :class:`ProgramView`, built on first use per rank.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from simulator.builder.tasks import Program, Task
from simulator.system.layout import Layout


def is_work(t: Task) -> bool:
    """A compute-stream task that computes (what slow GPUs and jitter scale)."""
    return t.stream == "compute" and t.plan is None and t.dst < 0


@dataclass
class SharedPrograms:
    """One prototype program per stage and what moves it onto every rank."""

    layout: Layout
    protos: dict[int, list[Task]]  # stage -> its first rank's tasks, in id order
    streams: dict[int, dict[str, list[int]]]  # stage -> stream -> local indices in order
    owner: dict[int, tuple[int, int]]  # a prototype task's id -> (stage, local index)
    base: list[int]  # stage -> id of its first rank's first task (then the end)
    factors: dict[int, np.ndarray]  # rank -> factors of its work tasks (slow, jitter)
    # stage -> which prototype tasks are work (:meth:`work_mask`)
    _work: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def world(self) -> int:
        return self.layout.world

    def length(self, stage: int) -> int:
        return len(self.protos[stage])

    def first_id(self, rank: int) -> int:
        """Id of ``rank``'s first task."""
        per = self.layout.per_stage
        q = rank // per
        return self.base[q] + (rank - q * per) * len(self.protos[q])

    def peer(self, rank: int, other: int) -> int:
        """Where ``rank``'s permutation takes ``other`` (a rank its prototype names)."""
        lay = self.layout
        d, c = lay.coord(rank), lay.coord(other)
        return lay.rank(c.pp, (c.dp + d.dp) % lay.dp, (c.tp + d.tp) % lay.tp,
                        lay.cp_shift(c.cp, d.cp))

    def group(self, rank: int, group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(self.peer(rank, r) for r in group))

    def task_id(self, rank: int, proto_id: int) -> int:
        """The id, on ``rank``, of the task its prototype calls ``proto_id``
        (a prototype of another stage names the same peer's task)."""
        q, local = self.owner[proto_id]
        delta = rank - (rank // self.layout.per_stage) * self.layout.per_stage
        return self.first_id(q * self.layout.per_stage + delta) + local

    def rank_of(self, task_id: int) -> tuple[int, int]:
        """(rank, local index) of a task id."""
        q = bisect_right(self.base, task_id) - 1
        delta, local = divmod(task_id - self.base[q], len(self.protos[q]))
        return q * self.layout.per_stage + delta, local

    def tasks_of(self, rank: int) -> list[Task]:
        """``rank``'s tasks as objects, in id order (what the per-rank build gives)."""
        q = rank // self.layout.per_stage
        first = self.first_id(rank)
        f = self.factors.get(rank)
        work = iter(f) if f is not None else None
        groups: dict[tuple[int, ...], tuple[int, ...]] = {}
        out = []
        for local, p in enumerate(self.protos[q]):
            g = groups.get(p.group)
            if g is None:
                g = groups[p.group] = self.group(rank, p.group) if p.group else ()
            t = self._make(rank, first + local, p, g)
            if work is not None and is_work(p):
                x = float(next(work))
                t.duration *= x
                t.weight_s *= x
            out.append(t)
        return out

    def task(self, rank: int, local: int) -> Task:
        """``rank``'s task at ``local`` in its prototype, alone (what :meth:`tasks_of`
        makes for it): the accounting's walks visit a few tasks of many ranks."""
        q = rank // self.layout.per_stage
        p = self.protos[q][local]
        t = self._make(rank, self.first_id(rank) + local, p,
                       self.group(rank, p.group) if p.group else ())
        f = self.factors.get(rank)
        if f is not None and is_work(p):
            x = float(f[self.work_index(q)[local]])
            t.duration *= x
            t.weight_s *= x
        return t

    def work_mask(self, stage: int) -> np.ndarray:
        """Which of ``stage``'s prototype tasks are work (what a rank's factors scale)."""
        return self._work_of(stage)[0]

    def work_index(self, stage: int) -> np.ndarray:
        """Each prototype task's index among ``stage``'s work tasks (its factor's)."""
        return self._work_of(stage)[1]

    def _work_of(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._work.get(stage)
        if got is None:
            mask = np.fromiter(map(is_work, self.protos[stage]), bool)
            got = self._work[stage] = (mask, np.cumsum(mask) - 1)
        return got

    def _make(self, rank: int, tid: int, p: Task, g: tuple[int, ...]) -> Task:
        return Task(tid, rank, p.stream, p.op, p.kind, p.name, p.duration, p.plan,
                    g, (g, p.group_key[1]) if p.group_key else (),
                    self.peer(rank, p.dst) if p.dst >= 0 else -1, p.nbytes, p.microbatch,
                    p.layer, p.chunk, [self.task_id(rank, d) for d in p.deps],
                    p.dependents, p.weight_s)


def _stage_groups(layout: Layout, rank: int) -> set[tuple[int, ...]]:
    """The groups the builder can give ``rank`` (besides a mixture of experts'; the
    mirror is DualPipe's pair of copies)."""
    c = layout.coord(rank)
    tie = (layout.rank(0, c.dp, c.tp, c.cp), layout.rank(layout.pp - 1, c.dp, c.tp, c.cp))
    mirror = tuple(sorted((rank, layout.rank(layout.pp - 1 - c.pp, c.dp, c.tp, c.cp))))
    return {layout.tp_group(rank), layout.dp_group(rank), layout.cp_group(rank), tie,
            layout.shard_group(rank), layout.replicate_group(rank),
            layout.cp_a2a_group(rank), layout.cp_ring_group(rank), mirror}


def share(layout: Layout, tasks: list[Task], programs: Mapping[int, Program],
          ) -> SharedPrograms | None:
    """Shared programs from the prototypes' build (one rank per stage, the stage's
    first), or None when some rank's groups do not follow from its prototype's."""
    per = layout.per_stage
    protos: dict[int, list[Task]] = {}
    streams: dict[int, dict[str, list[int]]] = {}
    owner: dict[int, tuple[int, int]] = {}
    for rank in sorted(programs):
        q = rank // per
        if rank != q * per:
            return None
        mine = sorted((t for ts in programs[rank].streams.values() for t in ts),
                      key=lambda t: t.id)
        protos[q] = mine
        for local, t in enumerate(mine):
            owner[t.id] = (q, local)
        streams[q] = {name: [owner[t.id][1] for t in ts]
                      for name, ts in programs[rank].streams.items()}
    if sorted(protos) != list(range(layout.pp)) or len(owner) != len(tasks):
        return None
    base = [0]
    for q in range(layout.pp):
        base.append(base[-1] + per * len(protos[q]))
    shared = SharedPrograms(layout, protos, streams, owner, base, {})
    for q in range(layout.pp):
        proto_groups = {t.group for t in protos[q] if t.group}
        for delta in range(per):
            rank = q * per + delta
            known = _stage_groups(layout, rank) if proto_groups else set()
            for g in proto_groups:
                mapped = shared.group(rank, g)
                if mapped not in known or \
                        layout.domains_spanned(mapped) != layout.domains_spanned(g):
                    return None
    return shared


class TaskView(Sequence[Task]):
    """``Workload.tasks`` of shared programs: task objects made per rank on first use
    of :meth:`of_rank` (or of the rank's program, or iteration) and kept, so code may
    annotate them as it would a list's. Indexing a rank not made yet makes that one
    task, anew on every access (the accounting's walks visit a few tasks of many ranks);
    make the rank with :meth:`of_rank` to change its tasks."""

    def __init__(self, shared: SharedPrograms) -> None:
        self.shared = shared
        self._ranks: dict[int, list[Task]] = {}

    def __len__(self) -> int:
        return self.shared.base[-1]

    def made(self) -> dict[int, list[Task]]:
        """The ranks whose task objects exist (the engine runs those, as changed)."""
        return self._ranks

    def of_rank(self, rank: int) -> list[Task]:
        got = self._ranks.get(rank)
        if got is None:
            got = self._ranks[rank] = self.shared.tasks_of(rank)
        return got

    @overload
    def __getitem__(self, i: int) -> Task: ...

    @overload
    def __getitem__(self, i: slice) -> list[Task]: ...

    def __getitem__(self, i: int | slice) -> Task | list[Task]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        rank, local = self.shared.rank_of(i)
        made = self._ranks.get(rank)
        return made[local] if made is not None else self.shared.task(rank, local)

    def __iter__(self) -> Iterator[Task]:
        for rank in range(self.shared.world):
            yield from self.of_rank(rank)


class ProgramView(Mapping[int, Program]):
    """``Workload.programs`` of shared programs: every rank's, made on first use."""

    def __init__(self, tasks: TaskView) -> None:
        self.tasks = tasks
        self._programs: dict[int, Program] = {}

    def __len__(self) -> int:
        return self.tasks.shared.world

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.tasks.shared.world))

    def __contains__(self, rank: Any) -> bool:
        return isinstance(rank, int) and 0 <= rank < self.tasks.shared.world

    def __getitem__(self, rank: int) -> Program:
        if rank not in self:
            raise KeyError(rank)
        prog = self._programs.get(rank)
        if prog is None:
            shared = self.tasks.shared
            mine = self.tasks.of_rank(rank)
            order = shared.streams[rank // shared.layout.per_stage]
            prog = self._programs[rank] = Program(
                rank, {name: [mine[i] for i in locs] for name, locs in order.items()})
        return prog
