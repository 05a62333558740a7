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

from collections.abc import Callable
from typing import Any

from simulator.builder.tasks import Task
from simulator.system.collectives.plan import Plan

RUN, COLL, SEND = 0, 1, 2
Where = Callable[[int], tuple[int, int]] | None  # a shared program's (owner, local index)


class Template:
    """One program compiled to steps, per stream. Local index = position in
    ``tasks``; a dependency is (owner rank of the template, local index), or the task
    id where programs are not shared. ``fuse``: a run may lead into the collective
    after it as one step."""

    def __init__(self, tasks: list[Task], streams: list[tuple[str, list[int]]],
                 where: Callable[[int], tuple[int, int]] | None,
                 phases: Callable[[Plan], Any], shared: bool, fuse: bool = True) -> None:
        self.n = len(tasks)
        self.shared, self.fuse = shared, fuse  # ``phases`` is not kept: it holds the engine
        self.durations = [t.duration for t in tasks]
        # what slow GPUs and jitter scale (program.is_work, inline: this runs per task)
        self.work = [i for i, t in enumerate(tasks)
                     if t.plan is None and t.dst < 0 and t.stream == "compute"]
        self.groups: list[tuple[int, ...]] = []
        gidx: dict[tuple[int, ...], int] = {}
        self.runs: list[list[int]] = []  # run -> local indices
        # per stream index: its distinct collectives (group, phases) and send
        # destinations, which :mod:`simulator.engine.chains` reads for the links it uses
        self.flows: list[tuple[int, int, Any]] = []
        self.sends: list[tuple[int, int]] = []
        self.streams: list[list[tuple[Any, ...]]] = []
        self.stream_names: list[str] = []
        for name, order in streams:
            if order:
                by_id: dict[tuple[int, int], tuple[int, Any]] = {}
                dsts: dict[int, None] = {}
                self.streams.append(self._steps(tasks, order, where, gidx, phases, by_id,
                                                dsts))
                self.flows += [(len(self.stream_names), *f) for f in by_id.values()]
                self.sends += [(len(self.stream_names), d) for d in dsts]
                self.stream_names.append(name)
        self.totals = self.run_totals(self.durations)

    def _steps(self, tasks: list[Task], order: list[int], where: Where,
               gidx: dict[tuple[int, ...], int], phases: Callable[[Plan], Any],
               by_id: dict[tuple[int, int], tuple[int, Any]],
               dsts: dict[int, None]) -> list[tuple[Any, ...]]:
        """One stream's steps; into ``by_id`` its collectives, into ``dsts`` its sends."""
        steps: list[tuple[Any, ...]] = []
        i, n = 0, len(order)
        while i < n:
            local = order[i]
            t = tasks[local]
            # (owner, local index) pairs; without ``where`` the task ids themselves
            deps = (tuple(t.deps) if where is None else tuple(map(where, t.deps))) \
                if t.deps else ()
            lead = -1
            if t.plan is None and t.dst < 0:  # a run of plain compute
                j, run = i, []
                while j < n:
                    tj = tasks[order[j]]
                    if tj.plan is not None or tj.dst >= 0 or (j > i and tj.deps):
                        break
                    run.append(order[j])
                    j += 1
                    if tj.dependents:
                        break
                last = run[-1] if tasks[run[-1]].dependents else -1
                lead = len(self.runs)
                self.runs.append(run)
                nxt = tasks[order[j]] if j < n else None
                if last >= 0 or nxt is None or nxt.plan is None or nxt.dst >= 0 \
                        or nxt.deps or not self.fuse:
                    # the fifth field: whether interference may slow the run
                    steps.append((RUN, deps, lead, last, t.stream == "compute", None, 0,
                                  -1))
                    i = j
                    continue
                # the run leads straight into a collective nobody else gates: one step
                # that registers its arrival time (no timeout of its own, see ``stream``)
                i, local, t = j, order[j], nxt
            if t.dst >= 0:
                dsts[t.dst] = None
                steps.append((SEND, deps, local, t.dst, t.nbytes, None, t.dependents, -1))
            else:
                # the builder hands out one tuple per group and one plan per (op, size,
                # group): identities find them without hashing (the tasks keep them alive)
                key = (id(t.group), id(t.plan))
                found = by_id.get(key)
                if found is None:
                    g = gidx.get(t.group)
                    if g is None:
                        g = gidx[t.group] = len(self.groups)
                        self.groups.append(t.group)
                    assert t.plan is not None
                    found = by_id[key] = (g, phases(t.plan))
                # a rendezvous is (group, tail): a shared program's n-th collective of
                # the group, else the task's own group key
                tail = t.group_key[1] if self.shared else t.group_key
                steps.append((COLL, deps, local, found[1], found[0], tail, t.dependents,
                              lead))
            i += 1
        return steps

    def run_totals(self, durations: list[float]) -> list[float]:
        """Each run's timeout: its durations summed in order."""
        out = []
        for run in self.runs:
            total = 0.0
            for i in run:
                total += durations[i]
            out.append(total)
        return out

    def prefixes(self, durations: list[float]) -> list[float]:
        """Per task of every run, in run order: the durations before it in its run,
        summed in the order the run's timeout summed them."""
        out: list[float] = []
        append = out.append
        for run in self.runs:
            total = 0.0
            for i in run:
                append(total)
                total += durations[i]
        return out


class Instance:
    """A simulated rank: its template, its task ids, its groups' ids, its durations."""

    __slots__ = ("chain", "delta", "durations", "groups", "ids", "keys", "rank",
                 "run_base", "template", "totals")

    def __init__(self, rank: int, template: Template, ids: range | list[int], delta: int,
                 run_base: int) -> None:
        self.rank, self.template, self.ids, self.delta = rank, template, ids, delta
        self.run_base = run_base
        self.durations, self.totals = template.durations, template.totals
        self.groups: list[int] = []
        self.keys: list[Any] = []  # per template group: how its group keys map
        # id(phases) -> a collective chains may price in closed form
        self.chain: dict[int, list[Any]] | None = None
