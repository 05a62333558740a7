"""The discrete-event engine: SimPy processes replaying per-rank programs.

One SimPy process per (simulated rank, stream) walks its program in order. A
task waits for its dependencies (events of other tasks), then:

- compute: holds the stream for its duration;
- collective: rendezvous with the other *simulated* members of its group (each
  registers when it will arrive; the transfer starts at the latest arrival), then
  runs its plan phase by phase — each leg one flow over every simulated member's
  link of the leg's class (a ring advances in lock-step, at its slowest member's
  share), counted once per member on shared links; the phase ends when its flows
  end plus ``steps × α`` (the first phase's plus the profile's sync cost,
  :func:`simulator.system.collectives.phase_latencies`);
- point-to-point send: one flow from sender to receiver over the link class
  between them, plus one α and the profile's send sync cost
  (``gpu.send_sync_us`` of that class, the calibrated ping-pong between compute).

**Interference.** With ``gpu.interference`` in the profile (and a device whose
communication overlaps its compute), a rank's compute runs slow down by the
factor of a link class while a transfer of that rank over that class is in
flight (a collective's from its start to its end, a send's at both ends; the
largest factor when several are): a run holds its remaining work, and each time
its rank's factor changes the run's end is rescheduled (a stale end is
ignored by its generation, as :class:`simulator.system.network.FlowNetwork` does for
flows). Its tasks' spans follow the run's piecewise rate. Runs then never fuse
into the collective after them, since the arrival they would register moves.

**Compact form.** Before running, each distinct program is compiled once into
steps (:class:`_Template`): a run of compute tasks that nobody waits on is one
step held with a single timeout, a collective or a send one step each,
a run followed by a collective that waits on nothing else is one step (the rank
registers its arrival at the run's end, so a collective of k members costs one
timeout, not k), dependencies are (owner, local index) pairs. At full fidelity the ranks of a
stage share their stage's prototype (:mod:`simulator.builder.program`) and differ only
in their ids, so the engine holds no object per task: times go into flat
arrays by task id, a run's tasks get their spans arithmetically after the run
(start = run start + the durations before it, summed in order as the run's
timeout was), and :class:`SimResult` makes the span list and the dictionaries
of collective starts on demand. Nothing here knows what a transformer is.

Determinism: no randomness, insertion-ordered containers only; the same
workload gives bit-identical spans.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import simpy
from simpy.events import AllOf, Event, Timeout

from simulator.builder.program import SharedPrograms, TaskView
from simulator.builder.tasks import Task, Workload, gc_paused
from simulator.system.collectives import Plan, leg_rate, phase_latencies, sync_burst_cost
from simulator.system.hardware import HardwareProfile, LinkName
from simulator.system.network import FlowNetwork
from simulator.system.topology import Topology

RUN, COLL, SEND = 0, 1, 2


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


class _Rendezvous:
    __slots__ = ("arrived", "burst", "done", "last", "members", "start")

    def __init__(self, env: simpy.Environment, members: int) -> None:
        self.members = members
        self.arrived = 0
        self.done = Event(env)
        self.start = 0.0
        self.last = -1
        self.burst = 0.0  # the longest compute burst a member arrives from


class _Pace:
    """A rank's compute speed under interference: the factors of its transfers in
    flight, the largest of them (1 with none), and its compute run in progress."""

    __slots__ = ("active", "factor", "run")

    def __init__(self) -> None:
        self.active: list[float] = []
        self.factor = 1.0
        self.run: _SlowRun | None = None


class _SlowRun:
    """A compute run that interference may stretch: work left (seconds at full speed)
    as of ``since``, the generation of its scheduled end, and its (work done, time)
    breakpoints once its speed was ever not 1."""

    __slots__ = ("done", "gen", "index", "left", "points", "since", "t0", "total")

    def __init__(self, done: Event, index: int, total: float, now: float) -> None:
        self.done, self.index, self.total, self.left = done, index, total, total
        self.since = self.t0 = now
        self.gen = 0
        self.points: list[tuple[float, float]] | None = None

    def mark(self, runs: dict[int, list[tuple[float, float]]]) -> list[tuple[float, float]]:
        """Its breakpoints, started (at its start, full speed so far) when first needed."""
        if self.points is None:
            self.points = runs[self.index] = [(0.0, self.t0)]
        return self.points


class _Template:
    """One program compiled to steps, per stream. Local index = position in
    ``tasks``; a dependency is (owner rank of the template, local index), or the task
    id where programs are not shared. ``fuse``: a run may lead into the collective
    after it as one step."""

    def __init__(self, tasks: list[Task], streams: list[tuple[str, list[int]]],
                 where: Callable[[int], tuple[int, int]] | None,
                 phases: Callable[[Plan], Any], shared: bool, fuse: bool = True) -> None:
        self.n = len(tasks)
        self.phases, self.shared, self.fuse = phases, shared, fuse
        self.durations = [t.duration for t in tasks]
        # what slow GPUs and jitter scale (program.is_work, inline: this runs per task)
        self.work = [i for i, t in enumerate(tasks)
                     if t.plan is None and t.dst < 0 and t.stream == "compute"]
        self.groups: list[tuple[int, ...]] = []
        gidx: dict[tuple[int, ...], int] = {}
        self.runs: list[list[int]] = []  # run -> local indices
        self.streams: list[list[tuple[Any, ...]]] = []
        self.stream_names: list[str] = []
        for name, order in streams:
            if order:
                self.streams.append(self._steps(tasks, order, where, gidx))
                self.stream_names.append(name)
        self.totals = self.run_totals(self.durations)

    def _steps(self, tasks: list[Task], order: list[int],
               where: Callable[[int], tuple[int, int]] | None,
               gidx: dict[tuple[int, ...], int]) -> list[tuple[Any, ...]]:
        steps: list[tuple[Any, ...]] = []
        by_id: dict[tuple[int, int], tuple[int, Any]] = {}  # (id(group), id(plan)) -> g, phases
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
                    found = by_id[key] = (g, self.phases(t.plan))
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


class _Instance:
    """A simulated rank: its template, its task ids, its groups' ids, its durations."""

    __slots__ = ("delta", "durations", "groups", "ids", "keys", "rank", "run_base",
                 "template", "totals")

    def __init__(self, rank: int, template: _Template, ids: range | list[int], delta: int,
                 run_base: int) -> None:
        self.rank, self.template, self.ids, self.delta = rank, template, ids, delta
        self.run_base = run_base
        self.durations, self.totals = template.durations, template.totals
        self.groups: list[int] = []
        self.keys: list[Any] = []  # per template group: how its group keys map


class Engine:
    def __init__(self, workload: Workload, hw: HardwareProfile) -> None:
        self.w = workload
        self.hw = hw
        self.env = simpy.Environment()
        self.topo = Topology(workload.layout, hw, workload.link_factors)
        self.net = FlowNetwork(self.env, self.topo.capacity, self.topo.shared)
        self.events: dict[int, simpy.Event] = {}
        self.rendezvous: dict[tuple[Any, ...], _Rendezvous] = {}
        self._group_id: dict[tuple[int, ...], int] = {}
        self._members: list[list[int]] = []  # per group id, its simulated members
        self._size: list[int] = []  # and how many
        self._links: dict[tuple[int, LinkName], tuple[Any, ...]] = {}
        self._plan_cache: dict[int, list[tuple[list[tuple[LinkName, float]], float]]] = {}
        self._plans_alive: list[Plan] = []
        self._weights: dict[int, float] = {}
        self._sends: dict[tuple[int, int], tuple[Any, ...]] = {}
        # interference: link class -> how much slower compute runs while a transfer of
        # the rank over it is in flight (none when transfers run in line with compute)
        gpu = hw.gpu
        self._slowing: dict[str, float] = {
            c: f for c, f in gpu.interference.items() if f > 1
        } if gpu.comm_overlaps_compute else {}
        self._pace: dict[int, _Pace] = {}
        self._slow_factor: dict[Any, float] = {}  # id(phases) or (src, dst) -> factor
        self.slow_points: dict[int, list[tuple[float, float]]] = {}  # run -> breakpoints
        # a sync cost that grows with the compute before a collective: each rank's compute
        # seconds so far and as of its last collective, and the plan behind each phases
        self._bursts = bool(gpu.collective_sync_burst)
        self._busy: dict[int, float] = {}
        self._mark: dict[int, float] = {}
        self._plan_of: dict[int, Plan] = {}  # id(phases) -> plan, a group of more than one
        self.instances = self._compile()
        if self._slowing:
            self._pace = {inst.rank: _Pace() for inst in self.instances}
        self.ids_of = {inst.rank: inst.ids for inst in self.instances}
        n = len(workload.tasks)
        nan = array("d", [math.nan])
        self.start, self.end, self.begin = nan * n, nan * n, nan * n
        self.last = array("q", [-1]) * n
        runs = sum(len(inst.template.runs) for inst in self.instances)
        self.run_t0 = nan * runs

    # ------------------------------------------------------------ compile
    def _compile(self) -> list[_Instance]:
        shared = self.w.shared
        if shared is not None:
            return self._compile_shared(shared)
        out, run_base = [], 0
        for rank, prog in self.w.programs.items():
            mine = [t for ts in prog.streams.values() for t in ts]
            streams, k = [], 0
            for name, ts in prog.streams.items():
                streams.append((name, list(range(k, k + len(ts)))))
                k += len(ts)
            tmpl = _Template(mine, streams, None, self._phases, False, not self._slowing)
            inst = _Instance(rank, tmpl, [t.id for t in mine], 0, run_base)
            run_base += len(tmpl.runs)
            for g in tmpl.groups:
                inst.groups.append(self._intern(g))
            out.append(inst)
        return out

    def _compile_shared(self, shared: SharedPrograms) -> list[_Instance]:
        layout, per = shared.layout, shared.layout.per_stage
        owner = shared.owner

        def where(proto_id: int) -> tuple[int, int]:
            q, local = owner[proto_id]
            return q * per, local

        # ranks whose task objects were made (and may have been changed) run those
        made = self.w.tasks.made() if isinstance(self.w.tasks, TaskView) else {}
        out, run_base = [], 0
        for q in range(layout.pp):
            streams = list(shared.streams[q].items())
            tmpl = _Template(shared.protos[q], streams, where, self._phases, True,
                             not self._slowing)
            for delta in range(per):
                rank = q * per + delta
                first = shared.first_id(rank)
                if rank in made:
                    own = _Template(made[rank], streams, shared.rank_of, self._phases, True,
                                    not self._slowing)
                    inst = _Instance(rank, own, range(first, first + own.n), 0, run_base)
                    run_base += len(own.runs)
                    inst.groups = [self._intern(g) for g in own.groups]
                    out.append(inst)
                    continue
                inst = _Instance(rank, tmpl, range(first, first + tmpl.n), delta, run_base)
                run_base += len(tmpl.runs)
                for g in tmpl.groups:
                    inst.groups.append(self._intern(shared.group(rank, g)))
                f = shared.factors.get(rank)
                if f is not None:
                    durations = list(tmpl.durations)
                    for i, x in zip(tmpl.work, f.tolist(), strict=True):
                        durations[i] *= x
                    inst.durations, inst.totals = durations, tmpl.run_totals(durations)
                out.append(inst)
        return out

    def _intern(self, group: tuple[int, ...]) -> int:
        g = self._group_id.get(group)
        if g is None:
            g = self._group_id[group] = len(self._members)
            self._members.append([r for r in group if r in self.ids_of_all])
            self._size.append(len(self._members[-1]))
        return g

    @cached_property
    def ids_of_all(self) -> set[int]:
        return set(self.w.programs)

    def event_of(self, task_id: int) -> simpy.Event:
        ev = self.events.get(task_id)
        if ev is None:
            ev = self.events[task_id] = Event(self.env)
        return ev

    # ------------------------------------------------------------ run
    def run(self, progress: Callable[[float], None] | None = None,
            horizon: float = 0.0) -> SimResult:
        """Run to the end. With ``progress`` and an expected end time ``horizon`` (the
        analytic estimate), the run advances in twentieths of it and reports the
        fraction of simulated time done (it may pass 1 when the estimate is short)."""
        start = time.perf_counter()
        procs = [self.env.process(self.stream(inst, steps, name)) for inst in self.instances
                 for name, steps in zip(inst.template.stream_names, inst.template.streams,
                                        strict=True)]
        # stop when every stream is done: stale completions of rescheduled flows may
        # still sit in the queue, later than the step's end
        finished = self.env.all_of(procs)
        with gc_paused():
            until = 0.0
            while not finished.triggered:
                if progress is None or horizon <= 0:
                    target: simpy.Event | float = finished
                else:
                    until += horizon / 20
                    target = until
                try:
                    self.env.run(until=target)
                except RuntimeError:  # the queue ran dry first: a deadlock, reported below
                    break
                if progress is not None and horizon > 0:
                    progress(self.env.now / horizon)
        wall = time.perf_counter() - start
        start_a, end_a = self._spans()
        unfinished = np.flatnonzero(np.isnan(end_a))
        if len(unfinished):
            first = self.w.tasks[int(unfinished[0])]
            raise RuntimeError(f"deadlock: {len(unfinished)} tasks never ran, first "
                               f"{first.name} on rank {first.rank}")
        busy: dict[str, float] = {}
        for link, secs in self.net.busy.items():
            key = {"nvl": "intra_node", "nic": "inter_node"}.get(str(link[0]), "core")
            busy[key] = busy.get(key, 0.0) + secs
        end = float(end_a.max()) if len(end_a) else 0.0
        return SimResult(self.w, start_a, end_a, np.frombuffer(self.begin, np.float64),
                         np.frombuffer(self.last, np.int64), busy, end,
                         self._event_count(), wall)

    def _spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Start and end by task id: collectives and sends as they ran, a run's tasks
        from the run's start and their durations summed in order."""
        start = np.frombuffer(self.start, np.float64).copy()
        end = np.frombuffer(self.end, np.float64).copy()
        t0 = np.frombuffer(self.run_t0, np.float64)
        layouts: dict[int, tuple[np.ndarray, ...]] = {}
        slow = np.fromiter(sorted(self.slow_points), np.int64)  # runs interference stretched
        for inst in self.instances:
            tmpl = inst.template
            if not tmpl.runs:
                continue
            got = layouts.get(id(tmpl))
            if got is None:
                locals_ = np.fromiter((i for run in tmpl.runs for i in run), np.int64)
                run_no = np.repeat(np.arange(len(tmpl.runs)),
                                   [len(run) for run in tmpl.runs])
                got = layouts[id(tmpl)] = (
                    locals_, run_no, np.asarray(tmpl.durations, np.float64)[locals_],
                    np.asarray(tmpl.prefixes(tmpl.durations), np.float64),
                    np.concatenate(([0], np.cumsum([len(run) for run in tmpl.runs]))))
            locals_, run_no, dur, prefix, offsets = got
            if inst.durations is not tmpl.durations:  # a slow or jittered rank's own
                dur = np.asarray(inst.durations, np.float64)[locals_]
                prefix = np.asarray(tmpl.prefixes(inst.durations), np.float64)
            ids = (locals_ + inst.ids.start if isinstance(inst.ids, range)
                   else np.asarray(inst.ids)[locals_])
            s = t0[inst.run_base + run_no] + prefix
            start[ids] = s
            end[ids] = s + dur
            lo, hi = np.searchsorted(slow, (inst.run_base, inst.run_base + len(tmpl.runs)))
            for run in slow[lo:hi].tolist():  # work done -> time, piecewise linear
                work, when = zip(*self.slow_points[run], strict=True)
                k = run - inst.run_base
                sl = slice(int(offsets[k]), int(offsets[k + 1]))
                start[ids[sl]] = np.interp(prefix[sl], work, when)
                end[ids[sl]] = np.interp(prefix[sl] + dur[sl], work, when)
        return start, end

    def _event_count(self) -> int:
        """Events SimPy scheduled: its private heap counter (simpy 4's ``_eid``)."""
        counter = getattr(self.env, "_eid", None)
        return int(next(counter)) if counter is not None else 0

    # ------------------------------------------------------------ streams
    def _waits(self, inst: _Instance, deps: tuple[Any, ...]) -> list[simpy.Event]:
        event_of = self.event_of
        if self.w.shared is None:  # task ids
            waits = [event_of(d) for d in deps]
        else:  # (owner, local index): the owner's peer of this rank's
            ids_of, delta = self.ids_of, inst.delta
            waits = [event_of(ids_of[owner + delta][local]) for owner, local in deps]
        return [e for e in waits if not e.triggered]

    def stream(self, inst: _Instance, steps: list[tuple[Any, ...]], name: str = "compute",
               ) -> Generator[simpy.Event, Any, None]:
        # the hottest loop: SimPy's classes called directly (``env.timeout`` makes a
        # bound method per call) and the clock read from ``_now`` (``now`` is a property)
        env, ids, totals, run_t0 = self.env, inst.ids, inst.totals, self.run_t0
        starts, ends, base, event_of = self.start, self.end, inst.run_base, self.event_of
        begin, last, size, meetings = self.begin, self.last, self._size, self.rendezvous
        groups, net, slowing = inst.groups, self.net, bool(self._slowing)
        # the compute burst before each collective, where the profile's sync cost grows
        # with it: this stream's compute adds to the rank's, a collective takes its share
        bursts, rank = self._bursts, inst.rank
        counts = bursts and name == "compute"
        if bursts:
            busy, mark = self._busy, self._mark
            busy.setdefault(rank, 0.0)
            mark.setdefault(rank, 0.0)
        for kind, deps, a, b, g, tail, dependents, lead in steps:
            if deps:
                pending = self._waits(inst, deps)
                if pending:
                    yield AllOf(env, pending)
            if kind == RUN:  # a: the run, b: its last task when someone waits for it,
                t0 = env._now  # g: whether interference may slow it
                total = totals[a]
                if counts:
                    busy[rank] += total
                if total > 0:
                    if slowing and g:
                        yield self._slow_run(inst.rank, base + a, total)
                    else:
                        yield Timeout(env, total)
                run_t0[base + a] = t0
                if b >= 0:
                    event_of(ids[b]).succeed()
                continue
            t0 = env._now  # this task's start: when the rank arrives at it
            if lead >= 0:  # a run first: the rank arrives when the run ends
                run_t0[base + lead] = t0
                t0 += totals[lead]
                if counts:
                    busy[rank] += totals[lead]
            gid = ids[a]
            if kind == SEND:  # b: the destination, g: the bytes
                dst = self._dst(inst, b)
                ev = self.send(inst.rank, dst, g)
                if slowing:
                    self._slow_while(ev, (inst.rank, dst), self._send_factor(inst.rank, dst))
                yield ev
            else:  # b: the plan's phases, g: the group, tail: the rendezvous key's
                phases = b
                grp = groups[g]
                rv = None
                burst = 0.0
                if bursts:  # the rank's compute since its last collective
                    burst = busy[rank] - mark[rank]
                    mark[rank] = busy[rank]
                if size[grp] > 1:
                    # members register when they will arrive; the last to register
                    # waits for the latest arrival and runs the transfer, the others
                    # wait for it to end (one timeout per collective, not per member)
                    key = (grp, tail)
                    rv = meetings.get(key)
                    if rv is None:
                        rv = meetings[key] = _Rendezvous(env, size[grp])
                    rv.arrived += 1
                    if bursts:
                        rv.burst = max(rv.burst, burst)
                    if t0 >= rv.start:
                        rv.start, rv.last = t0, gid
                    if rv.arrived < rv.members:
                        yield rv.done
                        begin[gid] = rv.start
                        if rv.last != gid:  # it waited for the latest arrival
                            last[gid] = rv.last
                        starts[gid] = t0
                        ends[gid] = env._now
                        if dependents:
                            event_of(gid).succeed()
                        continue
                    del meetings[key]
                    if rv.last != gid:
                        last[gid] = rv.last
                    if rv.start > env._now:
                        yield Timeout(env, rv.start - env._now)
                    burst = rv.burst
                elif t0 > env._now:
                    yield Timeout(env, t0 - env._now)
                begin[gid] = env._now
                cut = 0.0  # a short burst's discount, off the first phase's latency
                if bursts:
                    extra = self._burst_cost(phases, burst)
                    if extra > 0:
                        yield Timeout(env, extra)
                    else:
                        cut = extra
                if len(phases) == 1 and len(phases[0][0]) == 1:
                    # one flow, whose completion is the members' event: no generator,
                    # no second event to wake them
                    legs, alpha = phases[0]
                    link_class, nbytes = legs[0]
                    ev = net.transfer(nbytes, self._group_links(grp, link_class),
                                      self._group_weight(grp), max(alpha + cut, 0.0),
                                      None if rv is None else rv.done)
                    if slowing:
                        self._slow_while(ev, self._members[grp], self._coll_factor(phases))
                    yield ev
                else:
                    ev = Event(env)
                    if slowing:
                        self._slow_while(ev, self._members[grp], self._coll_factor(phases))
                    yield from self.transfer(grp, phases, cut)
                    ev.succeed()
                    if rv is not None:
                        rv.done.succeed()
            starts[gid] = t0
            ends[gid] = env._now
            if dependents:
                event_of(gid).succeed()

    # ------------------------------------------------------------ interference
    def _slow_run(self, rank: int, run: int, total: float) -> Event:
        """The event that ends a compute run of ``total`` seconds at full speed, at the
        rank's speed as it changes (:meth:`_pace_to`)."""
        pace, now = self._pace[rank], self.env._now
        sr = pace.run = _SlowRun(Event(self.env), run, total, now)
        if pace.factor != 1.0:
            sr.mark(self.slow_points)
        self._schedule(pace, sr)
        return sr.done

    def _schedule(self, pace: _Pace, sr: _SlowRun) -> None:
        sr.gen += 1
        gen = sr.gen

        def end(_: Event) -> None:
            if sr.gen == gen:  # not rescheduled since
                if sr.points is not None:
                    sr.points.append((sr.total, self.env._now))
                pace.run = None
                sr.done.succeed()

        Timeout(self.env, max(sr.left, 0.0) * pace.factor).callbacks.append(end)

    def _pace_to(self, rank: int, add: float, remove: float) -> None:
        """Add and/or remove a transfer's factor on a rank (0: none); reschedule its
        run's end when its speed changes."""
        pace = self._pace.get(rank)
        if pace is None:  # not simulated here
            return
        if add:
            pace.active.append(add)
        if remove:
            pace.active.remove(remove)
        factor = max(pace.active, default=1.0)
        if factor == pace.factor:
            return
        sr, now = pace.run, self.env._now
        if sr is not None:
            sr.left -= (now - sr.since) / pace.factor
            sr.since = now
            sr.mark(self.slow_points).append((sr.total - sr.left, now))
        pace.factor = factor
        if sr is not None:
            self._schedule(pace, sr)

    def _slow_while(self, ev: Event, ranks: Any, factor: float) -> None:
        """Slow ``ranks``' compute by ``factor`` until ``ev`` (a transfer's end) fires."""
        if factor <= 1.0:
            return
        for r in ranks:
            self._pace_to(r, factor, 0.0)

        def release(_: Event) -> None:
            for r in ranks:
                self._pace_to(r, 0.0, factor)

        ev.callbacks.append(release)

    def _coll_factor(self, phases: list[tuple[list[tuple[LinkName, float]], float]]) -> float:
        """A collective's interference: the largest of its link classes'."""
        f = self._slow_factor.get(id(phases))
        if f is None:
            f = self._slow_factor[id(phases)] = max(
                (self._slowing.get(c, 1.0) for legs, _ in phases for c, _ in legs),
                default=1.0)
        return f

    def _send_factor(self, src: int, dst: int) -> float:
        f = self._slow_factor.get((src, dst))
        if f is None:
            f = self._slow_factor[(src, dst)] = self._slowing.get(
                self.topo.link_class(src, dst), 1.0)
        return f

    def transfer(self, grp: int, phases: list[tuple[list[tuple[LinkName, float]], float]],
                 cut: float = 0.0) -> Generator[simpy.Event, Any, None]:
        """A collective's plan, phase by phase, once every member has arrived (``cut``
        seconds, at most 0, off the first phase's latency: :meth:`_burst_cost`)."""
        weight = self._group_weight(grp)
        for i, (legs, latency) in enumerate(phases):
            alpha = max(latency + cut, 0.0) if i == 0 else latency
            if len(legs) == 1:  # the common case: α rides on the flow's completion
                link_class, nbytes = legs[0]
                yield self.net.transfer(nbytes, self._group_links(grp, link_class), weight,
                                        alpha)
                continue
            flows = [self.net.transfer(nbytes, self._group_links(grp, link_class), weight)
                     for link_class, nbytes in legs]
            pending = [f for f in flows if not f.triggered]
            if pending:
                yield AllOf(self.env, pending)
            if alpha > 0:
                yield Timeout(self.env, alpha)

    def _burst_cost(self, phases: list[tuple[list[tuple[LinkName, float]], float]],
                    burst: float) -> float:
        """What a collective costs beyond its sync cost when its members arrive from up to
        ``burst`` seconds of compute (:func:`simulator.system.collectives.sync_burst_cost`;
        negative after a burst shorter than the calibration's, never below minus the
        sync cost itself)."""
        plan = self._plan_of.get(id(phases))
        return 0.0 if plan is None else sync_burst_cost(plan, self.hw, burst)

    def _dst(self, inst: _Instance, dst: int) -> int:
        """A send's destination: the prototype's peer of the rank (or itself)."""
        shared = self.w.shared
        return dst if shared is None or inst.delta == 0 else shared.peer(inst.rank, dst)

    def send(self, rank: int, dst: int, nbytes: float) -> simpy.Event:
        """One point-to-point transfer: a flow over the links between the two ranks
        after one α, the calibrated send/recv's when the profile has one, plus the
        profile's send sync cost (``gpu.send_sync_us``, once per send)."""
        route = self._sends.get((rank, dst))
        if route is None:
            link_class = self.topo.link_class(rank, dst)
            rate = self.topo.rate(link_class)
            cal = self.hw.collectives.get("send_recv", {}).get(link_class)
            alpha = self.topo.alpha(link_class) if cal is None else cal.alpha_us * 1e-6
            alpha += self.hw.gpu.send_sync_s(link_class)
            route = self._sends[(rank, dst)] = (
                rate, cal, alpha, self.topo.send_links(rank, dst, link_class),
                self.w.weight_of(rank))
        rate, cal, alpha, links, weight = route
        if cal is not None:
            nbytes = nbytes * rate / (cal.busbw_GBps * 1e9)
        return self.net.transfer(nbytes, links, weight, alpha)

    def _group_weight(self, grp: int) -> float:
        """How many ranks the simulated members stand for on shared links."""
        weight = self._weights.get(grp)
        if weight is None:
            members = self._members[grp]
            weight = self._weights[grp] = self.w.weight * len(members) \
                if self.w.weights is None else sum(self.w.weights[r] for r in members)
        return weight

    def _group_links(self, grp: int, link_class: LinkName) -> tuple[Any, ...]:
        """Every simulated member's link of a class (shared links once): a ring moves in
        lock-step, so one flow over all of them proceeds at the slowest member's share."""
        key = (grp, link_class)
        links = self._links.get(key)
        if links is None:
            seen: dict[Any, None] = {}
            for r in self._members[grp]:
                seen.update(dict.fromkeys(self.topo.links(r, link_class)))
            links = self._links[key] = tuple(seen)
        return links

    def _phases(self, plan: Plan) -> list[tuple[list[tuple[LinkName, float]], float]]:
        """Per phase: (link class, bytes to put on that class's link) legs and α × steps
        (the first phase's with the sync cost). A calibrated busbw becomes equivalent
        bytes at the link's rate."""
        out = self._plan_cache.get(id(plan))
        if out is None:
            out = []
            for phase, alpha in zip(plan.phases, phase_latencies(plan, self.hw), strict=True):
                legs = [(leg.link_class, leg.bytes_per_rank * self.topo.rate(leg.link_class)
                         / leg_rate(leg, plan.op, self.hw)) for leg in phase.legs]
                out.append((legs, alpha))
            self._plan_cache[id(plan)] = out
            self._plans_alive.append(plan)  # keeps id(plan) unique while cached
            if self._bursts and plan.n > 1:
                self._plan_of[id(out)] = plan
        return out


def simulate(workload: Workload, hw: HardwareProfile,
             progress: Callable[[float], None] | None = None, horizon: float = 0.0,
             ) -> SimResult:
    return Engine(workload, hw).run(progress, horizon)
