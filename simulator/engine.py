"""The discrete-event engine: SimPy processes replaying per-rank programs.

One SimPy process per (simulated rank, stream) walks its task list in order. A
task waits for its dependencies (events of other tasks), then:

- compute: holds the stream for its duration;
- collective: rendezvous with the other *simulated* members of its group (key
  ``group_key``), then runs its plan phase by phase — each leg one flow over
  every simulated member's link of the leg's class (a ring advances in lock-step,
  at its slowest member's share), counted once per member on shared links; the
  phase ends when its flows end plus ``steps × α``;
- point-to-point send: one flow from sender to receiver over the link class
  between them, plus one α.

Runs of compute tasks that nobody waits on are held with a single timeout and
their spans computed arithmetically (an optimisation that changes no result).
Spans are flat records; nothing here knows what a transformer is.

Determinism: no randomness, insertion-ordered containers only; the same
workload gives bit-identical spans.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from simulator.collectives import Plan, leg_rate, phase_alpha
from simulator.hardware import HardwareProfile, LinkName
from simulator.network import FlowNetwork
from simulator.tasks import Task, Workload, gc_paused
from simulator.topology import Topology


@dataclass
class SimResult:
    workload: Workload
    spans: list[tuple[int, float, float]]  # (task id, start, end)
    comm_start: dict[int, float]  # collective task id -> when its transfer began
    last_arrival: dict[int, int]  # collective task id -> the member task that arrived last
    link_busy: dict[str, float]  # seconds per link class, summed over simulated links
    end_time: float
    events: int
    wall_s: float


class _Rendezvous:
    __slots__ = ("arrived", "done", "last", "members", "start")

    def __init__(self, env: simpy.Environment, members: int) -> None:
        self.members = members
        self.arrived: list[int] = []
        self.done = env.event()
        self.start = 0.0
        self.last = -1


class Engine:
    def __init__(self, workload: Workload, hw: HardwareProfile) -> None:
        self.w = workload
        self.hw = hw
        self.env = simpy.Environment()
        self.topo = Topology(workload.layout, hw, workload.link_factors)
        self.net = FlowNetwork(self.env, self.topo.capacity, self.topo.shared)
        self.events: dict[int, simpy.Event] = {}
        self.spans: list[tuple[int, float, float]] = []
        self.rendezvous: dict[tuple[Any, ...], _Rendezvous] = {}
        self.simulated = set(workload.programs)
        self.comm_start: dict[int, float] = {}  # collective task -> all members arrived
        self.last_arrival: dict[int, int] = {}  # collective task -> member that arrived last
        self._members: dict[tuple[int, ...], list[int]] = {}
        self._links: dict[tuple[tuple[int, ...], LinkName], tuple[Any, ...]] = {}
        self._plan_cache: dict[int, list[tuple[list[tuple[LinkName, float]], float]]] = {}
        self._plans_alive: list[Plan] = []
        self._weights: dict[tuple[Any, ...], float] = {}

    def event_of(self, task_id: int) -> simpy.Event:
        ev = self.events.get(task_id)
        if ev is None:
            ev = self.events[task_id] = self.env.event()
        return ev

    def run(self, progress: Callable[[float], None] | None = None,
            horizon: float = 0.0) -> SimResult:
        """Run to the end. With ``progress`` and an expected end time ``horizon`` (the
        analytic estimate), the run advances in twentieths of it and reports the
        fraction of simulated time done (it may pass 1 when the estimate is short)."""
        start = time.perf_counter()
        procs = [self.env.process(self.stream(tasks)) for prog in self.w.programs.values()
                 for tasks in prog.streams.values() if tasks]
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
        unfinished: list[Task] = []
        if len(self.spans) != len(self.w.tasks):  # every task that ran left one span
            ran = {tid for tid, _, _ in self.spans}
            unfinished = [t for t in self.w.tasks if t.id not in ran]
        if unfinished:
            raise RuntimeError(f"deadlock: {len(unfinished)} tasks never ran, first "
                               f"{unfinished[0].name} on rank {unfinished[0].rank}")
        busy: dict[str, float] = {}
        for link, secs in self.net.busy.items():
            key = {"nvl": "intra_node", "nic": "inter_node"}.get(str(link[0]), "core")
            busy[key] = busy.get(key, 0.0) + secs
        end = max((e for _, _, e in self.spans), default=0.0)
        return SimResult(self.w, self.spans, self.comm_start, self.last_arrival, busy, end,
                         self._event_count(), wall)

    def _event_count(self) -> int:
        """Events SimPy scheduled: its private heap counter (simpy 4's ``_eid``)."""
        counter = getattr(self.env, "_eid", None)
        return int(next(counter)) if counter is not None else 0

    # ------------------------------------------------------------ streams
    def stream(self, tasks: list[Task]) -> Generator[simpy.Event, Any, None]:
        env, spans = self.env, self.spans
        i, n = 0, len(tasks)
        while i < n:
            task = tasks[i]
            if task.deps:
                waits = [self.event_of(d) for d in task.deps]
                pending = [e for e in waits if not e.triggered]
                if pending:
                    yield env.all_of(pending)
            if task.plan is None and task.dst < 0:
                # a run of plain compute: one timeout, spans computed in place
                j, t0 = i, env.now
                total = 0.0
                while j < n:
                    tj = tasks[j]
                    if tj.plan is not None or tj.dst >= 0 or (j > i and tj.deps):
                        break
                    spans.append((tj.id, t0 + total, t0 + total + tj.duration))
                    total += tj.duration
                    j += 1
                    if tj.dependents:
                        break
                if total > 0:
                    yield env.timeout(total)
                last = tasks[j - 1]
                if last.dependents:
                    self.event_of(last.id).succeed()
                i = j
                continue
            t0 = env.now
            if task.dst >= 0:
                yield from self.send(task)
            else:
                yield from self.collective(task)
            spans.append((task.id, t0, env.now))
            if task.dependents:
                self.event_of(task.id).succeed()
            i += 1

    def send(self, task: Task) -> Generator[simpy.Event, Any, None]:
        link_class = self.topo.link_class(task.rank, task.dst)
        rate = self.topo.rate(link_class)
        cal = self.hw.collectives.get("send_recv", {}).get(link_class)
        nbytes = task.nbytes if cal is None else task.nbytes * rate / (cal.busbw_GBps * 1e9)
        alpha = self.topo.alpha(link_class) if cal is None else cal.alpha_us * 1e-6
        yield self.net.transfer(nbytes, self.topo.send_links(task.rank, task.dst, link_class),
                                self.w.weight_of(task.rank), alpha)

    def collective(self, task: Task) -> Generator[simpy.Event, Any, None]:
        members = self._members.get(task.group)
        if members is None:
            members = self._members[task.group] = [r for r in task.group if r in self.simulated]
        rv = None
        if len(members) > 1:
            rv = self.rendezvous.get(task.group_key)
            if rv is None:
                rv = self.rendezvous[task.group_key] = _Rendezvous(self.env, len(members))
            rv.arrived.append(task.rank)
            if len(rv.arrived) < rv.members:
                yield rv.done
                self.comm_start[task.id] = rv.start
                self.last_arrival[task.id] = rv.last
                return
            del self.rendezvous[task.group_key]
            rv.start = self.env.now
            rv.last = task.id
        self.comm_start[task.id] = self.env.now
        plan = task.plan
        assert plan is not None
        weight = self._group_weight(task.group, members)
        for legs, alpha in self._phases(plan):
            if len(legs) == 1:  # the common case: α rides on the flow's completion
                link_class, nbytes = legs[0]
                yield self.net.transfer(nbytes, self._group_links(task.group, link_class),
                                        weight, alpha)
                continue
            flows = [self.net.transfer(nbytes, self._group_links(task.group, link_class),
                                       weight) for link_class, nbytes in legs]
            pending = [f for f in flows if not f.triggered]
            if pending:
                yield self.env.all_of(pending)
            if alpha > 0:
                yield self.env.timeout(alpha)
        if rv is not None:
            rv.done.succeed()

    def _group_weight(self, group: tuple[int, ...], members: list[int]) -> float:
        """How many ranks the simulated members stand for on shared links."""
        if self.w.weights is None:
            return self.w.weight * len(members)
        key = (group, "weight")
        weight = self._weights.get(key)
        if weight is None:
            weight = self._weights[key] = sum(self.w.weights[r] for r in members)
        return weight

    def _group_links(self, group: tuple[int, ...], link_class: LinkName) -> tuple[Any, ...]:
        """Every simulated member's link of a class (shared links once): a ring moves in
        lock-step, so one flow over all of them proceeds at the slowest member's share."""
        key = (group, link_class)
        links = self._links.get(key)
        if links is None:
            seen: dict[Any, None] = {}
            for r in self._members[group]:
                seen.update(dict.fromkeys(self.topo.links(r, link_class)))
            links = self._links[key] = tuple(seen)
        return links

    def _phases(self, plan: Plan) -> list[tuple[list[tuple[LinkName, float]], float]]:
        """Per phase: (link class, bytes to put on that class's link) legs and α × steps.
        A calibrated busbw becomes equivalent bytes at the link's rate."""
        out = self._plan_cache.get(id(plan))
        if out is None:
            out = []
            for phase in plan.phases:
                legs = [(leg.link_class, leg.bytes_per_rank * self.topo.rate(leg.link_class)
                         / leg_rate(leg, plan.op, self.hw)) for leg in phase.legs]
                out.append((legs, phase_alpha(phase, plan.op, self.hw)))
            self._plan_cache[id(plan)] = out
            self._plans_alive.append(plan)  # keeps id(plan) unique while cached
        return out


def simulate(workload: Workload, hw: HardwareProfile,
             progress: Callable[[float], None] | None = None, horizon: float = 0.0,
             ) -> SimResult:
    return Engine(workload, hw).run(progress, horizon)
