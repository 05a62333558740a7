"""Laid copies: a stamped copy's steps are its record's, moved.

A folded build keeps its stamped copies as records (:mod:`simulator.builder.lazy`).
:class:`Blocks` compiles each record's first copy from its tasks and lays the same
steps over every later copy, with per-step offsets the streams add as they read them;
:func:`flatten` gives :class:`~simulator.engine.compile.Template` a rank's tasks with
what it needs of the unmade ones (:class:`Lazy`).
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from simulator.builder.tasks import Program, Task
from simulator.engine.steps import COLL, RUN

if TYPE_CHECKING:
    from collections.abc import Sequence

    from simulator.builder.lazy import Copies, Copy
    from simulator.engine.compile import Template, Where


class Lazy(NamedTuple):
    """A rank's lazy copies for :class:`Template`: the copies, every task's duration (an
    unmade task's its record's) and, per stream, (position, copy) of each copy whose
    tasks are not all made, in stream order."""

    copies: Copies
    durations: list[float]
    pending: dict[str, list[tuple[int, Copy]]]


class Blocks:
    """One stream's stamped copies (:mod:`simulator.builder.stamp`). A copy's tasks are
    its record's but for their ids, names, micro-batch and group keys; where a step
    starts at a copy's first task, the copy compiles to the steps its record's first
    such copy compiled to, with positions moved by where it starts and run indices by
    the runs before it. So those steps are kept once, relative to the copy
    (:meth:`keep`), and every later copy's steps are the same tuples, with its offsets
    beside them (:meth:`lay`; the stream adds them as it reads a step). That holds
    where the copy is still whole and in order on the stream, none of its tasks but the
    first gained a dependency, its tasks have the kept copy's dependents (part of the
    key) and its last step ends inside it (its last task a collective, a send or
    waited on: nothing after the copy then changes its steps). The first step's
    dependencies are each copy's own, and a laid collective's rendezvous key is read
    from its task when it has one (:meth:`Template.tail`)."""

    def __init__(self, tmpl: Template, seq: list[Task], order: Sequence[int], where: Where,
                 steps: list[tuple[Any, ...]], po: list[int], ro: list[int],
                 lazy: Lazy | None, laid: dict[int, Block] | None = None) -> None:
        self.tmpl, self.seq, self.order, self.where = tmpl, seq, order, where
        self.steps, self.po, self.ro, self.lazy = steps, po, ro, lazy
        # (record, its made tasks' dependents) -> the steps and runs relative to the copy,
        # and their :class:`Block` where a chain may price them at once
        self.done: dict[tuple[Any, ...], tuple[list[tuple[Any, ...]], list[range],
                                               Block | None]] = {}
        self.laid = {} if laid is None else laid  # a laid copy's first step -> its Block
        self.at: dict[int, Copy] = {}  # position -> the lazy copy there, until made
        self.parts: dict[int, list[int]] = {}  # a pair's position -> its copies'

    def prepare(self, pending: list[tuple[int, Copy]],
                ) -> list[tuple[int, int, tuple[Any, ...] | None]]:
        """(position, length, key) of each lazy copy on the stream, in stream order, or of
        a pair of adjacent copies where a run goes on from the first into the second.
        Unmade tasks are their record's rows (nothing held them), so a copy's key is its
        record and its made tasks' dependents, a pair's both copies'; None, and the
        copies made, where a run before could go on into it, a made task but the first
        has a dependency (the pair's second: any), or its last task ends no step (a run
        to its end would go on past it)."""
        seq, at = self.seq, self.at
        out: list[tuple[int, int, tuple[Any, ...] | None]] = []
        half: tuple[int, int, tuple[Any, ...]] | None = None  # a copy a run leaves open
        for p, copy in pending:
            reached = [seq[p + off] for off in copy.rec.reached]
            prev, last = seq[p - 1] if p else None, reached[-1]
            opens = prev is None or prev.plan is not None or prev.dst >= 0 or prev.dependents
            ends = last.plan is not None or last.dst >= 0 or last.dependents
            clean = True
            for t in reached[1:]:
                if t.deps:
                    clean = False
                    break
            key: tuple[Any, ...] = (id(copy.rec), tuple([t.dependents for t in reached]))
            at[p] = copy
            if half is not None and not opens and half[0] + half[1] == p and clean \
                    and ends and not reached[0].deps:
                out[-1] = (half[0], half[1] + copy.size, half[2] + key)
                self.parts[half[0]] = [half[0], p]
                half = None
                continue
            half = (p, copy.size, key) if opens and clean and not ends else None
            out.append((p, copy.size, key if opens and clean and ends else None))
        for p, _, kept in out:
            if kept is None:
                self.make(p)
        return out

    def make(self, p: int) -> None:
        """Make the tasks of the lazy copy at ``p``, or of the pair there (none there:
        nothing to do)."""
        for q in self.parts.pop(p, (p,)):
            copy = self.at.pop(q, None)
            if copy is None:
                continue
            assert self.lazy is not None and isinstance(self.order, range)
            made = self.lazy.copies.tasks_of(copy)
            self.seq[q:q + copy.size] = made
            start = self.order.start + q
            self.tmpl.tasks[start:start + copy.size] = made

    def pad(self) -> None:
        """Offsets of 0 for the steps compiled since the last laid copy."""
        k = len(self.steps) - len(self.po)
        if k:
            self.po += [0] * k
            self.ro += [0] * k

    def keep(self, key: tuple[Any, ...], p: int, s0: int, r0: int) -> None:
        """Keep the steps from ``s0`` and the runs from ``r0``, just compiled for the copy
        at ``p``, relative to it."""
        at = self.order[p]
        rel: list[tuple[Any, ...]] = []
        for kind, _, a, b, g, _, dependents, lead in self.steps[s0:]:
            if kind == RUN:
                rel.append((RUN, (), a - r0, b - at if b >= 0 else -1, g, None, 0, -1))
            else:
                rel.append((kind, (), a - at, b, g, None, dependents,
                            lead - r0 if lead >= 0 else -1))
        runs = [range(r[0] - at, r[0] - at + len(r)) for r in self.tmpl.runs[r0:]]
        self.done[key] = rel, runs, block(rel)

    def lay(self, key: tuple[Any, ...], p: int) -> bool:
        """Lay the steps kept for ``key`` over the copy at ``p``; False where none are."""
        got = self.done.get(key)
        if got is None:
            return False
        rel, runs, blk = got
        tmpl, steps, po, ro = self.tmpl, self.steps, self.po, self.ro
        k = len(steps) - len(po)
        if k:  # :meth:`pad`
            po += [0] * k
            ro += [0] * k
        seq, where = self.seq, self.where
        d = seq[p].deps
        if d and len(d) == 1 and p and d[0] != seq[p - 1].id:  # another's task (first_deps)
            deps: tuple[Any, ...] = tuple(d) if where is None else (where(d[0]),)
        else:
            deps = tmpl.first_deps(seq, self.order, where, steps, po[-1], p) if d else ()
        at, r0, s0, n = self.order[p], len(tmpl.runs), len(steps), len(rel)
        tmpl.runs += runs
        tmpl.moved.append((r0, len(runs), at))
        tmpl.moved_runs.append(runs)
        steps += rel
        po += [at] * n
        ro += [r0] * n
        if deps:
            steps[s0] = (steps[s0][0], deps, *steps[s0][2:])
        if blk is not None:
            self.laid[s0] = blk
        return True


class Block(NamedTuple):
    """A kept copy's steps where every one is a run leading into a collective of one
    plan and group (``phases``, template group ``g``), none with dependencies (the
    first's are each copy's own) and none waited on but perhaps the last: per step, its
    run (``leads``) and its position (``at``) relative to the copy. A chain prices a
    laid copy of it in one loop (:func:`simulator.engine.chains.forward`) and its spans
    are written after the run (:func:`simulator.engine.laid.settle`)."""

    phases: Any
    g: int
    leads: list[int]
    at: list[int]


def block(rel: list[tuple[Any, ...]]) -> Block | None:
    """The :class:`Block` of steps ``rel`` (relative to their copy), or None where they
    are not all of that form."""
    if not rel:
        return None
    phases, g = rel[0][3], rel[0][4]
    for k, (kind, deps, _, b, gk, _, dependents, lead) in enumerate(rel):
        if kind != COLL or deps or lead < 0 or b is not phases or gk != g or \
                (dependents and k < len(rel) - 1):
            return None
    return Block(phases, g, [step[7] for step in rel], [step[2] for step in rel])


def flatten(prog: Program, copies: Copies | None, rank: int,
            ) -> tuple[list[Task], list[tuple[str, range]], list[int], Lazy | None]:
    """A rank's tasks, its streams one after another, each stream's range in them, their
    ids and, where some of its lazy copies are unmade, what :class:`Template` needs of
    those (:class:`Lazy`; a copy others were put between is made now)."""
    where: dict[str, list[tuple[int, Copy]]] = {}
    if copies is not None:
        names = {id(ts): name for name, ts in prog.streams.items()}
        tasks = copies.tasks
        for c in copies.pending(rank):
            p, n = c.at, len(c.rec.durations)
            if c.stream[p] is not tasks[c.first]:  # others were put before it
                p = copies.position(c)
            if p + n > len(c.stream) or c.stream[p + n - 1] is not tasks[c.first + n - 1]:
                copies.fill(c)
            else:
                where.setdefault(names[id(c.stream)], []).append((p, c))
    mine = list(chain.from_iterable(prog.streams.values()))
    streams, k, starts = [], 0, {}
    for name, ts in prog.streams.items():
        streams.append((name, range(k, k + len(ts))))
        starts[name] = k
        k += len(ts)
    if not where:
        return mine, streams, list(map(attrgetter("id"), mine)), None
    assert copies is not None
    spans = sorted([(starts[name] + p, c) for name, at in where.items() for p, c in at],
                   key=itemgetter(0))
    ids: list[int] = []
    durations: list[float] = []
    last = 0
    for at, c in spans:  # made tasks read, unmade ones their record's
        if at == last + 1:  # one made task between (a send, most often)
            t = mine[last]
            ids.append(t.id)
            durations.append(t.duration)
        elif at > last:
            ids += map(attrgetter("id"), mine[last:at])
            durations += map(attrgetter("duration"), mine[last:at])
        n = len(c.rec.durations)
        ids += range(c.first, c.first + n)
        durations += c.rec.durations
        last = at + n
    ids += map(attrgetter("id"), mine[last:])
    durations += map(attrgetter("duration"), mine[last:])
    for at_ in where.values():
        at_.sort(key=itemgetter(0))
    return mine, streams, ids, Lazy(copies, durations, where)
