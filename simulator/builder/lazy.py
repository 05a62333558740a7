"""Stamped copies kept as records until someone reads their tasks.

A folded build copies each (rank, kind, stage)'s recorded action for every other
micro-batch (:mod:`simulator.builder.stamp`); making those copies' task objects was
most of the build. Where it is safe (:func:`eligible`), a copy of a one-stream record
makes only the tasks the builder may reach by reference — its first (a received
transfer's wait goes on it), its last (the send after it waits on it) and the ones the
action returns (the data-parallel pass buckets their gradients) — and leaves ``None``
in ``ctx.tasks`` and on its stream for the rest, which are then exactly their record's
rows: nothing can have changed a task it never held. :class:`Copies` makes a copy's
other tasks on first need, the same objects in both places: when a dependency names
one (``Context.count_dependents``), when the workload's :class:`LazyTasks` or
:class:`LazyPrograms` are read, or when the compiler cannot lay its record's steps over
the copy (:mod:`simulator.engine.blocks`); the engine reads the rest from the records.
``tests/test_lazy_copies.py`` holds every task and every figure to the eager build's.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from simulator.builder.tasks import Program, Task

if TYPE_CHECKING:
    from simulator.builder.context import Context
    from simulator.builder.stamp import Record


def eligible(ctx: Context) -> bool:
    """Whether a build may leave copies' tasks unmade: nothing edits a task's fields
    after its action (slow GPUs and jitter scale durations; DualPipe's pairs move tasks
    to another stream) and no pass inside an action reads its stream beyond the task
    before it (the context-parallel ring looks back for the last compute block)."""
    s = ctx.s
    return ctx.sched.directions == 1 and not s.variability.active and s.parallel.cp == 1


@dataclass(slots=True)
class Copy:
    """One copy: its record, rank, micro-batch, first task id, its collectives' group
    key bases (per record slot), the stream list it went onto and where (inserts
    before it move it right), whether its tasks are all made."""

    rec: Record
    rank: int
    mb: int
    first: int
    bases: list[int]
    stream: list[Any]  # its entries: a Task, or None where unmade
    at: int
    made: bool = False

    @property
    def size(self) -> int:
        return len(self.rec.tasks)


class Copies:
    """A build's lazy copies, in id order, and what makes their tasks."""

    def __init__(self, tasks: list[Any], programs: dict[int, Program]) -> None:
        self.tasks, self.programs = tasks, programs
        self.all: list[Copy] = []
        self.firsts: list[int] = []
        self.by_rank: dict[int, list[Copy]] = {}

    def add(self, copy: Copy) -> None:
        """Keep ``copy`` and make the tasks of it the builder may reach."""
        self.all.append(copy)
        self.firsts.append(copy.first)
        mine = self.by_rank.get(copy.rank)
        if mine is None:
            mine = self.by_rank[copy.rank] = []
        mine.append(copy)
        tasks, stream, first, at, rank = self.tasks, copy.stream, copy.first, copy.at, copy.rank
        rec, mb = copy.rec, copy.mb
        rows, bases, smb = rec.rows, copy.bases, str(mb)
        assert rows is not None
        for off in rec.reached:  # as :meth:`make` makes them
            (name, op, kind, duration, plan, group, slot, j, dst, nbytes, mine_, layer, chunk,
             weight_s, pre, post, _) = rows[off]
            tasks[first + off] = stream[at + off] = Task(
                first + off, rank, name, op, kind, pre if post is None else pre + smb + post,
                duration, plan, group, () if slot < 0 else (group, bases[slot] + j), dst,
                nbytes, mb if mine_ else -1, layer, chunk, [], 0, weight_s)

    def make(self, copy: Copy, k: int) -> Task:
        """Task ``k`` of ``copy``, as :meth:`simulator.builder.stamp.Stamps.replay`
        makes it."""
        assert copy.rec.rows is not None
        (stream, op, kind, duration, plan, group, slot, j, dst, nbytes, mine, layer, chunk,
         weight_s, pre, post, _) = copy.rec.rows[k]
        return Task(copy.first + k, copy.rank, stream, op, kind,
                    pre if post is None else pre + str(copy.mb) + post, duration, plan, group,
                    () if slot < 0 else (group, copy.bases[slot] + j), dst, nbytes,
                    copy.mb if mine else -1, layer, chunk, [], 0, weight_s)

    def of(self, task_id: int) -> Copy:
        """The copy task ``task_id`` belongs to."""
        return self.all[bisect_right(self.firsts, task_id) - 1]

    def position(self, copy: Copy) -> int:
        """Where ``copy``'s first task is on its stream now."""
        stream, head, i = copy.stream, self.tasks[copy.first], copy.at
        while stream[i] is not head:
            i += 1
        return i

    def fill(self, copy: Copy) -> None:
        """Make every task of ``copy`` (in ``ctx.tasks`` and on its stream)."""
        if copy.made:
            return
        tasks, stream, first, n = self.tasks, copy.stream, copy.first, copy.size
        k, j = 0, self.position(copy)
        while k < n:
            e = stream[j]
            if e is None:
                tasks[first + k] = stream[j] = self.make(copy, k)
                k += 1
            elif first <= e.id < first + n:  # made already (others were put between)
                k += 1
            j += 1
        copy.made = True

    def tasks_of(self, copy: Copy) -> list[Task]:
        """``copy``'s tasks, made."""
        self.fill(copy)
        return self.tasks[copy.first:copy.first + copy.size]

    def fill_rank(self, rank: int) -> None:
        for copy in self.by_rank.get(rank, ()):
            if not copy.made:
                self.fill(copy)

    def fill_all(self) -> None:
        for copy in self.all:
            if not copy.made:
                self.fill(copy)

    def pending(self, rank: int) -> list[Copy]:
        """``rank``'s copies whose tasks are not all made."""
        return [c for c in self.by_rank.get(rank, ()) if not c.made]


class Done(Sequence[Task]):
    """What a lazy copy's action returned, where that is a list of its tasks (a
    backward's gradients, which the data-parallel pass buckets): the copy is made when
    the list is read."""

    def __init__(self, copies: Copies, copy: Copy) -> None:
        self.copies, self.copy = copies, copy

    def _tasks(self) -> list[Task]:
        tasks, built = self.copies.tasks_of(self.copy), self.copy.rec.built
        assert isinstance(built, list)
        return [tasks[off] for off in built]

    def __len__(self) -> int:
        built = self.copy.rec.built
        assert isinstance(built, list)
        return len(built)

    @overload
    def __getitem__(self, i: int) -> Task: ...

    @overload
    def __getitem__(self, i: slice) -> list[Task]: ...

    def __getitem__(self, i: int | slice) -> Task | list[Task]:
        return self._tasks()[i]

    def __iter__(self) -> Iterator[Task]:
        return iter(self._tasks())


class LazyTasks(Sequence[Task]):
    """``Workload.tasks`` of a build with lazy copies: a copy's tasks are made when one
    of them is read (all of them when the whole is iterated or sliced)."""

    def __init__(self, copies: Copies) -> None:
        self.copies = copies

    def __len__(self) -> int:
        return len(self.copies.tasks)

    @overload
    def __getitem__(self, i: int) -> Task: ...

    @overload
    def __getitem__(self, i: slice) -> list[Task]: ...

    def __getitem__(self, i: int | slice) -> Task | list[Task]:
        raw = self.copies.tasks
        if isinstance(i, slice):
            self.copies.fill_all()
            return raw[i]
        t = raw[i]
        if t is None:
            self.copies.fill(self.copies.of(i if i >= 0 else i + len(raw)))
            t = raw[i]
        return t

    def __iter__(self) -> Iterator[Task]:
        self.copies.fill_all()
        return iter(self.copies.tasks)


class LazyPrograms(Mapping[int, Program]):
    """``Workload.programs`` of a build with lazy copies: a rank's copies are made when
    its program is read."""

    def __init__(self, copies: Copies) -> None:
        self.copies = copies

    def __len__(self) -> int:
        return len(self.copies.programs)

    def __iter__(self) -> Iterator[int]:
        return iter(self.copies.programs)

    def __contains__(self, rank: Any) -> bool:
        return rank in self.copies.programs

    def __getitem__(self, rank: int) -> Program:
        prog = self.copies.programs[rank]
        self.copies.fill_rank(rank)
        return prog
