"""The compact form: each distinct program compiled once into steps.

A run of compute tasks that nobody waits on is one step held with a single timeout,
a collective or a send one step each, and a run followed by a collective that waits on
nothing else is one step (the rank registers its arrival at the run's end, so a
collective of k members costs one timeout, not k). Dependencies are (owner, local
index) pairs where programs are shared (full fidelity: the ranks of a stage share
their stage's prototype and differ only in their ids), else task ids. A step is a
tuple ``(kind, deps, a, b, g, tail, dependents, lead)`` whose fields
:func:`simulator.engine.streams.stream` reads by kind (:data:`RUN`, :data:`COLL`,
:data:`SEND`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np

from simulator.builder.tasks import Task
from simulator.engine.blocks import Block, Blocks, Lazy
from simulator.engine.steps import COLL, RUN, SEND
from simulator.system.collectives.plan import Plan

#: runs at least this many long at a position: summed there with one vector addition
VECTOR = 32
Where = Callable[[int], tuple[int, int]] | None  # a shared program's (owner, local index)


class Template:
    """One program compiled to steps, per stream. Local index = position in
    ``tasks``; a dependency is (owner rank of the template, local index), or the task
    id where programs are not shared. ``fuse``: a run may lead into the collective
    after it as one step."""

    def __init__(self, tasks: list[Task], streams: Sequence[tuple[str, Sequence[int]]],
                 where: Callable[[int], tuple[int, int]] | None,
                 phases: Callable[[Plan], Any], shared: bool, fuse: bool = True,
                 lazy: Lazy | None = None) -> None:
        self.n = len(tasks)
        self.shared, self.fuse = shared, fuse  # ``phases`` is not kept: it holds the engine
        self.durations = list(map(attrgetter("duration"), tasks)) if lazy is None \
            else lazy.durations
        # what slow GPUs and jitter scale (program.is_work, inline: this runs per task),
        # which only a shared program's ranks read (their compute factors)
        self.work = [i for i, t in enumerate(tasks)
                     if t.plan is None and t.dst < 0 and t.stream == "compute"] \
            if shared else []
        self.groups: list[tuple[int, ...]] = []
        gidx: dict[tuple[int, ...], int] = {}
        self.runs: list[Sequence[int]] = []  # run -> local indices (a slice of a stream's)
        # per stream index: its distinct collectives (group, phases) and send
        # destinations, which :mod:`simulator.engine.chains` reads for the links it uses
        self.flows: list[tuple[int, int, Any]] = []
        self.sends: list[tuple[int, int]] = []
        self.streams: list[list[tuple[Any, ...]]] = []
        # per stream, per step: what its positions and its run indices are moved by
        # (a stamped copy's steps are its record's, shared: :class:`Blocks`)
        self.offsets: list[tuple[list[int], list[int]]] = []
        # per stream: a laid copy's first step -> its steps' :class:`Block`, where a
        # chain may price them in one loop (:func:`simulator.engine.chains.forward`)
        self.laid: list[dict[int, Block]] = []
        self.moved: list[tuple[int, int, int]] = []  # (first run, runs, position moved by)
        self.moved_runs: list[list[range]] = []  # and those runs, relative to the copy
        # every stream's order a range: every run is one (a slice of it, or laid)
        self.ranged = all(isinstance(o, range) and o.step == 1 for _, o in streams)
        self.tasks = tasks  # a laid step's rendezvous key is its task's (:meth:`tail`)
        # an unmade task of a lazy copy by local index (:mod:`simulator.builder.lazy`)
        self.lookup: Callable[[int], Task] | None = None
        self.stream_names: list[str] = []
        for name, order in streams:
            if order:
                by_id: dict[tuple[int, int], tuple[int, Any]] = {}
                dsts: dict[int, None] = {}
                laid: dict[int, Block] = {}
                steps, po, ro = self._stream(tasks, order, where, gidx, phases, by_id, dsts,
                                             lazy, name, laid)
                self.streams.append(steps)
                self.laid.append(laid)
                self.offsets.append((po, ro))
                self.flows += [(len(self.stream_names), *f) for f in by_id.values()]
                self.sends += [(len(self.stream_names), d) for d in dsts]
                self.stream_names.append(name)
        self.totals = self.run_totals(self.durations)

    def _stream(self, tasks: list[Task], order: Sequence[int], where: Where,
                gidx: dict[tuple[int, ...], int], phases: Callable[[Plan], Any],
                by_id: dict[tuple[int, int], tuple[int, Any]], dsts: dict[int, None],
                lazy: Lazy | None, name: str, laid: dict[int, Block],
                ) -> tuple[list[tuple[Any, ...]], list[int], list[int]]:
        """One stream's steps and their offsets; into ``by_id`` its collectives, into
        ``dsts`` its sends. Where a step starts at a lazy copy (``lazy``) whose record an
        earlier copy compiled, that copy's steps are laid over it (:class:`Blocks`)."""
        seq = tasks[order.start:order.stop] if isinstance(order, range) and order.step == 1 \
            else [tasks[k] for k in order]
        steps: list[tuple[Any, ...]] = []
        po: list[int] = []
        ro: list[int] = []
        args = (seq, order, where, gidx, phases, by_id, dsts, steps, po)
        blocks = Blocks(self, seq, order, where, steps, po, ro, lazy, laid)
        starts = blocks.prepare(lazy.pending.get(name, [])) if lazy is not None else []
        i = 0
        for p, size, key in starts:
            if p < i:  # a step ran into it
                continue
            if p > i:
                if p == i + 1 and seq[i].dst >= 0:
                    i = self._send(seq, order, where, dsts, steps, po, ro, i)
                else:
                    blocks.pad()
                    i = self._steps(*args, i, p)
            if i != p:
                continue
            if key is not None and blocks.lay(key, p):
                i = p + size
                continue
            blocks.make(p)
            blocks.pad()
            s0, r0 = len(steps), len(self.runs)
            i = self._steps(*args, p, p + size)
            if key is not None and i == p + size:
                blocks.keep(key, p, s0, r0)
        if i < len(seq):
            blocks.pad()
            self._steps(*args, i, len(seq))
        blocks.pad()
        return steps, po, ro

    def _steps(self, seq: list[Task], order: Sequence[int], where: Where,
               gidx: dict[tuple[int, ...], int], phases: Callable[[Plan], Any],
               by_id: dict[tuple[int, int], tuple[int, Any]], dsts: dict[int, None],
               steps: list[tuple[Any, ...]], po: list[int], i: int, stop: int) -> int:
        """Compile the stream's steps that start at positions ``i`` to ``stop`` (the
        last may run past it) into ``steps``; where the next step starts. The steps
        before ``i`` have their offsets in ``po``."""
        append, runs, fuse, shared = steps.append, self.runs, self.fuse, self.shared
        nruns = len(runs)
        plan: Plan | None = None  # the last collective's plan and group, and what they gave
        group: tuple[int, ...] = ()
        g, ph = -1, None
        n = len(seq)
        while i < stop:
            t = seq[i]
            # (owner, local index) pairs; without ``where`` the task ids themselves
            d = t.deps
            deps = (tuple(d) if where is None else tuple(map(where, d))) if d else ()
            if deps and len(d) == 1 and self._after(steps, seq, order, i,
                                                    po[-1] if po and len(po) == len(steps) else 0):
                deps = ()  # the task before it on its stream, which has ended by then
            lead = -1
            if t.plan is None and t.dst < 0:  # a run of plain compute
                j, waited = i + 1, t.dependents  # whether its last task is waited on
                if not waited:
                    while j < n:
                        tj = seq[j]
                        if tj.plan is not None or tj.dst >= 0 or tj.deps:
                            break
                        j += 1
                        waited = tj.dependents
                        if waited:
                            break
                lead, nruns = nruns, nruns + 1
                runs.append(order[i:j])
                nxt = seq[j] if j < n and not waited and fuse else None
                if nxt is None or nxt.plan is None or nxt.dst >= 0 or nxt.deps:
                    # the fifth field: whether interference may slow the run
                    append((RUN, deps, lead, order[j - 1] if waited else -1,
                            t.stream == "compute", None, 0, -1))
                    i = j
                    continue
                # the run leads straight into a collective nobody else gates: one step
                # that registers its arrival time (no timeout of its own, see ``stream``)
                i, t = j, nxt
            if t.dst >= 0:
                dsts[t.dst] = None
                append((SEND, deps, order[i], t.dst, t.nbytes, None, t.dependents, -1))
            else:
                if t.plan is not plan or t.group is not group:
                    plan, group = t.plan, t.group
                    g, ph = self._collective(plan, group, gidx, phases, by_id)
                # a rendezvous is (group, tail): a shared program's n-th collective of
                # the group, else the task's own group key
                tail = t.group_key[1] if shared else t.group_key
                append((COLL, deps, order[i], ph, g, tail, t.dependents, lead))
            i += 1
        return i

    def _send(self, seq: list[Task], order: Sequence[int], where: Where,
              dsts: dict[int, None], steps: list[tuple[Any, ...]], po: list[int],
              ro: list[int], i: int) -> int:
        """The step of the send at ``i`` alone between two laid copies, as :meth:`_steps`
        compiles it, with offsets of 0 (and the steps before theirs: :meth:`Blocks.pad`);
        the next position."""
        if k := len(steps) - len(po):
            po += [0] * k
            ro += [0] * k
        t, d, step = seq[i], seq[i].deps, steps[-1] if steps else None
        if d and len(d) == 1 and step and i and d[0] == seq[i - 1].id and step[0] != RUN \
                and seq[i - 1].dependents == 1 and step[2] + po[-1] == order[i - 1]:
            steps[-1] = (*step[:6], 0, step[7])  # :meth:`first_deps`'s and :meth:`_after`'s
            deps: tuple[Any, ...] = ()
        else:
            deps = self.first_deps(seq, order, where, steps, po[-1] if po else 0, i)
        dsts[t.dst] = None
        steps.append((SEND, deps, order[i], t.dst, t.nbytes, None, t.dependents, -1))
        po.append(0)
        ro.append(0)
        return i + 1

    def first_deps(self, seq: list[Task], order: Sequence[int], where: Where,
                   steps: list[tuple[Any, ...]], offset: int, i: int) -> tuple[Any, ...]:
        """The dependencies of a step that starts at task ``i``, as :meth:`_steps` gives
        them (the step before moved by ``offset``)."""
        d = seq[i].deps
        if not d:
            return ()
        deps = tuple(d) if where is None else tuple(map(where, d))
        return () if len(d) == 1 and self._after(steps, seq, order, i, offset) else deps

    def tail(self, local: int) -> Any:
        """The rendezvous key's tail of the collective at ``local`` (see :meth:`_steps`)."""
        t = self.tasks[local]
        if t is None:
            assert self.lookup is not None
            t = self.lookup(local)
        key = t.group_key
        return key[1] if self.shared else key

    @staticmethod
    def _after(steps: list[tuple[Any, ...]], seq: list[Task], order: Sequence[int],
               i: int, offset: int = 0) -> bool:
        """Whether task ``i`` of a stream waits on nothing but the collective or send
        before it, which nothing else waits on: then neither needs an event (the stream
        runs its steps in order), and the step before no longer has a dependent."""
        if not steps or seq[i].deps[0] != seq[i - 1].id or seq[i - 1].dependents != 1:
            return False
        step = steps[-1]
        if step[0] == RUN or step[2] + offset != order[i - 1]:
            return False
        steps[-1] = (*step[:6], 0, step[7])
        return True

    def _collective(self, plan: Plan | None, group: tuple[int, ...],
                    gidx: dict[tuple[int, ...], int], phases: Callable[[Plan], Any],
                    by_id: dict[tuple[int, int], tuple[int, Any]]) -> tuple[int, Any]:
        """A collective's group index and phases. The builder hands out one tuple per
        group and one plan per (op, size, group): identities find them without hashing
        (the tasks keep them alive)."""
        key = (id(group), id(plan))
        found = by_id.get(key)
        if found is None:
            g = gidx.get(group)
            if g is None:
                g = gidx[group] = len(self.groups)
                self.groups.append(group)
            assert plan is not None
            found = by_id[key] = (g, phases(plan))
        return found

    @cached_property
    def layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`run_layout` of the runs (a laid copy's moved to its positions)."""
        if self.moved and self.ranged:
            return laid_layout(self.runs, self.moved, self.moved_runs)
        flat, first, lens = run_layout(self.runs)
        if self.moved:
            r0, count, at = np.asarray(self.moved, np.int64).T
            which = np.repeat(r0 - (np.cumsum(count) - count), count) + np.arange(count.sum())
            shift = np.zeros(len(lens), np.int64)
            shift[which] = np.repeat(at, count)
            flat += np.repeat(shift, lens)
        return flat, first, lens

    @cached_property
    def duration_array(self) -> np.ndarray:
        """:attr:`durations` as an array."""
        return np.fromiter(self.durations, np.float64, len(self.durations))  # asarray's, sooner

    @cached_property
    def sums(self) -> tuple[np.ndarray, np.ndarray]:
        """:func:`run_sums` of :attr:`durations` (the run's timeouts at compile time,
        its tasks' offsets after the run)."""
        return run_sums(self.layout, self.duration_array)

    def run_totals(self, durations: list[float]) -> list[float]:
        """Each run's timeout: its durations summed in order."""
        return self._sums(durations)[0].tolist()

    def prefixes(self, durations: list[float]) -> np.ndarray:
        """Per task of every run, in run order: the durations before it in its run,
        summed in the order the run's timeout summed them."""
        return self._sums(durations)[1]

    def _sums(self, durations: list[float]) -> tuple[np.ndarray, np.ndarray]:
        return self.sums if durations is self.durations \
            else run_sums(self.layout, np.asarray(durations, np.float64))


def run_layout(runs: list[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs' tasks in run order (local indices), each run's first position in that
    order and each run's length."""
    lens = np.fromiter(map(len, runs), np.int64, len(runs))
    flat = np.fromiter(chain.from_iterable(runs), np.int64, int(lens.sum()))
    first = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=first[1:])
    return flat, first, lens


def laid_layout(runs: list[Sequence[int]], moved: list[tuple[int, int, int]],
                rel: list[list[range]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`run_layout` of runs that are all ranges, where ``moved[k]`` are runs laid
    from the kept ranges ``rel[k]``, moved by a position: those read once per kept list
    and placed by array, the others one by one."""
    n = len(runs)
    lens, starts = np.empty(n, np.int64), np.empty(n, np.int64)
    laid = np.zeros(n, bool)
    groups: dict[int, tuple[list[range], list[int], list[int]]] = {}
    for (r0, _, at), kept in zip(moved, rel, strict=True):
        g = groups.setdefault(id(kept), (kept, [], []))
        g[1].append(r0)
        g[2].append(at)
    for kept, r0s, ats in groups.values():
        which = np.asarray(r0s, np.int64)[:, None] + np.arange(len(kept))
        lens[which] = np.fromiter(map(len, kept), np.int64, len(kept))
        starts[which] = np.fromiter(map(attrgetter("start"), kept), np.int64, len(kept)) \
            + np.asarray(ats, np.int64)[:, None]
        laid[which] = True
    rest = np.flatnonzero(~laid)
    others = [runs[r] for r in rest.tolist()]
    lens[rest] = np.fromiter(map(len, others), np.int64, len(others))
    starts[rest] = np.fromiter(map(attrgetter("start"), others), np.int64, len(others))
    first = np.zeros(n, np.int64)
    np.cumsum(lens[:-1], out=first[1:])
    flat = np.repeat(starts - first, lens) + np.arange(int(lens.sum()), dtype=np.int64)
    return flat, first, lens


def run_sums(layout: tuple[np.ndarray, np.ndarray, np.ndarray],
             durations: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each run's total and each task's prefix (in run order), summed as ``total = 0.0``
    then ``total += d`` task by task: one vector addition per position in a run over
    the runs at least that long (the same floating-point additions, in the same
    order), and the few runs longer than the rest one by one."""
    flat, first, lens = layout
    d = np.asarray(durations, np.float64)[flat]
    totals = np.zeros(len(lens))
    prefix = np.empty(len(flat))
    if not len(lens):
        return totals, prefix
    by_len = np.argsort(-lens, kind="stable")  # the runs longer than k: a prefix of it
    longer = len(lens) - np.cumsum(np.bincount(lens))
    k, most = 0, int(lens.max())
    while k < most and longer[k] >= VECTOR:
        runs = by_len[:longer[k]]
        pos = first[runs] + k
        prefix[pos] = totals[runs]
        totals[runs] += d[pos]
        k += 1
    for r in by_len[:longer[k]].tolist() if k < most else ():
        total = float(totals[r])
        for at in range(int(first[r]) + k, int(first[r] + lens[r])):
            prefix[at] = total
            total += float(d[at])
        totals[r] = total
    return totals, prefix


class Instance:
    """A simulated rank: its template, its task ids, its groups' ids, its durations."""

    __slots__ = ("_id_array", "chain", "delta", "durations", "groups", "ids", "keys",
                 "rank", "run_base", "template", "totals")

    def __init__(self, rank: int, template: Template, ids: range | list[int], delta: int,
                 run_base: int) -> None:
        self.rank, self.template, self.ids, self.delta = rank, template, ids, delta
        self.run_base = run_base
        self.durations, self.totals = template.durations, template.totals
        self.groups: list[int] = []
        self.keys: list[Any] = []  # per template group: how its group keys map
        # id(phases) -> a collective chains may price in closed form
        self.chain: dict[int, list[Any]] | None = None
        self._id_array: np.ndarray | None = None

    def id_array(self) -> np.ndarray:
        """:attr:`ids` as an array (made once)."""
        if self._id_array is None:
            self._id_array = np.fromiter(self.ids, np.int64, len(self.ids))
        return self._id_array

    def total_array(self) -> np.ndarray:
        """:attr:`totals` as an array (the template's where they are its)."""
        tmpl = self.template
        return tmpl.sums[0] if self.totals is tmpl.totals \
            else np.asarray(self.totals, np.float64)
