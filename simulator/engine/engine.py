"""The discrete-event engine: SimPy processes replaying per-rank programs.

One SimPy process per (simulated rank, stream) walks its program in order
(:mod:`simulator.engine.streams`). A task waits for its dependencies (events of other
tasks), then:

- compute: holds the stream for its duration;
- collective: rendezvous with the other *simulated* members of its group (each registers
  when it will arrive; the transfer starts at the latest arrival), then runs its plan
  phase by phase — each leg one flow over every simulated member's link of the leg's
  class (a ring advances in lock-step, at its slowest member's share), counted once per
  member on shared links; the phase ends when its flows end plus ``steps × α`` (the
  first phase's plus the profile's sync cost,
  :func:`simulator.system.collectives.cost.phase_latencies`);
- point-to-point send: one flow from sender to receiver over the link class between
  them, plus one α and the profile's send sync cost (``gpu.send_sync_us`` of that class,
  the calibrated ping-pong between compute).

Compute may run slower while the rank's transfers are in flight
(:mod:`simulator.engine.interference`). At full fidelity a TP group whose ranks provably
run alike runs as one process (:mod:`simulator.engine.lockstep`). Consecutive steps
that nothing else observes (compute, and collectives of one simulated member alone on
links no other stream uses) run in closed form as one event
(:mod:`simulator.engine.chains`). Each distinct program
is compiled once into steps (:mod:`simulator.engine.compile`); at full fidelity a
stage's ranks share its prototype (:mod:`simulator.builder.program`): times go into flat
arrays by task id, a run's tasks get their spans from the run's start and their
durations summed in order. Nothing here knows what a transformer is. Determinism: no
randomness, insertion-ordered containers only; a workload gives bit-identical spans.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Generator
from functools import cached_property
from typing import Any

import numpy as np
import simpy
from simpy.events import AllOf, Event, Timeout

from simulator.builder.program import SharedPrograms, TaskView
from simulator.builder.tasks import Workload, gc_paused
from simulator.engine.blocks import flatten
from simulator.engine.chains import plan_chains
from simulator.engine.compile import Instance, Template
from simulator.engine.interference import Interference, Phases
from simulator.engine.laid import settle
from simulator.engine.lockstep import expand, lockstep_ranks, lockstep_size
from simulator.engine.result import SimResult, busy_by_class, run_spans
from simulator.engine.streams import Rendezvous, stream
from simulator.system.collectives.channels import sm_factor
from simulator.system.collectives.cost import leg_rate, phase_latencies, sync_burst_cost
from simulator.system.collectives.plan import Plan
from simulator.system.hardware import HardwareProfile
from simulator.system.network import FlowNetwork
from simulator.system.topology import Topology
from simulator.system.units import LinkName


class Engine:
    """One workload's processes. Alone it owns its SimPy environment, topology and
    network; several engines given one ``env`` and one ``net`` (each its own ``topo``,
    which names the links its ranks use on that network) run side by side, each with
    its own programs, groups and rendezvous (:mod:`simulator.engine.together`)."""

    #: laid copies chains priced at once, whose spans :func:`settle` writes after the run
    priced: list[tuple[Any, ...]]
    #: rank -> stream -> gate (:func:`simulator.engine.chains.calm`): its streams whose
    #: collectives hold SMs beside the compute, and its sharers of the compute's links
    gates: dict[int, dict[str, Any]]
    sharers: dict[int, dict[str, Any]]

    def __init__(self, workload: Workload, hw: HardwareProfile,
                 env: simpy.Environment | None = None, topo: Topology | None = None,
                 net: FlowNetwork | None = None, lockstep: bool = True,
                 chains: bool = True) -> None:
        self.w = workload
        self.hw = hw
        self.env = simpy.Environment() if env is None else env
        self.topo = Topology(workload.layout, hw, workload.link_factors) if topo is None \
            else topo
        self.net = FlowNetwork(self.env, self.topo.capacity, self.topo.shared) \
            if net is None else net
        self.events: dict[int, simpy.Event] = {}
        self.rendezvous: dict[tuple[Any, ...], Rendezvous] = {}
        self._group_id: dict[tuple[int, ...], int] = {}
        self.members: list[list[int]] = []  # per group id, its simulated members
        self.size: list[int] = []  # and how many
        self._links: dict[tuple[int, LinkName], tuple[Any, ...]] = {}
        self._plan_cache: dict[int, list[tuple[list[tuple[LinkName, float]], float]]] = {}
        self._plans_alive: list[Plan] = []
        self._weights: dict[int, float] = {}
        self._sends: dict[tuple[int, int], tuple[Any, ...]] = {}
        # interference: link class -> how much slower compute runs while a transfer of the
        # rank over it is in flight (none when transfers run in line with compute); and
        # id(phases) -> gpu.sms / (gpu.sms - SMs its kernels hold) (Plan.sms)
        gpu = hw.gpu
        over = gpu.comm_overlaps_compute
        self._slowing: dict[str, float] = {c: f for c, f in gpu.interference.items()
                                           if f > 1} if over else {}
        self._sm_slow: dict[int, float] = {}
        self._sms = gpu.sms if over and workload.holds_sms else None
        self._slowed = slowed = bool(self._slowing) or self._sms is not None
        # a sync cost that grows with the compute before a collective: each rank's compute
        # seconds so far and as of its last collective, and the plan behind each phases
        self.bursts = bool(gpu.collective_sync_burst)
        self._busy: dict[int, float] = {}
        self._mark: dict[int, float] = {}
        self._plan_of: dict[int, Plan] = {}  # id(phases) -> plan, a group of more than one
        # lock-step groups: the ranks one simulated rank stands for (its TP group's)
        alone = env is None and topo is None and net is None
        self.lock = lockstep_size(workload, alone) if lockstep else 1
        with gc_paused():  # a tuple per step: the collector would rescan the workload
            self.instances = self._compile()
        # chains (:mod:`simulator.engine.chains`): not where another job's flows, the
        # rank's changing pace (every rank's under link interference; under SMs held,
        # the ranks :func:`plan_chains` finds) or its compute bursts reach into a step
        self.chains = chains and alone and not self._slowing and not self.bursts
        self.merged, self.priced = 0, []  # events the chains saved; laid copies they priced
        self.gates, self.sharers = {}, {}  # their gates (:mod:`simulator.engine.chains`)
        if self.chains:
            plan_chains(self)
        self.interference = Interference(
            self.env, self._slowing, self.topo, [inst.rank for inst in self.instances],
            self._sm_slow) if slowed else None
        self.ids_of = {inst.rank: inst.ids for inst in self.instances}
        n = len(workload.tasks)
        nan = array("d", [math.nan])
        self.start, self.end, self.begin = nan * n, nan * n, nan * n
        self.last = array("q", [-1]) * n
        runs = sum(len(inst.template.runs) for inst in self.instances)
        self.run_t0 = nan * runs

    # ------------------------------------------------------------ compile
    def _compile(self) -> list[Instance]:
        shared = self.w.shared
        if shared is not None:
            return self._compile_shared(shared)
        out, run_base = [], 0
        copies = self.w.stamped  # lazy copies: their raw programs, read with the records
        for rank, prog in (self.w.programs if copies is None else copies.programs).items():
            mine, streams, ids, lazy = flatten(prog, copies, rank)
            tmpl = Template(mine, streams, None, self._phases, False, not self._slowed, lazy)
            if lazy is not None:
                tmpl.lookup = lambda a, ids=ids, view=self.w.tasks: view[ids[a]]
            inst = Instance(rank, tmpl, ids, 0, run_base)
            run_base += len(tmpl.runs)
            for g in tmpl.groups:
                inst.groups.append(self._intern(g))
            out.append(inst)
        return out

    def _compile_shared(self, shared: SharedPrograms) -> list[Instance]:
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
            tmpl = Template(shared.protos[q], streams, where, self._phases, True,
                            not self._slowed)
            for delta in range(0, per, self.lock):  # TP index 0 of each lock-step group
                rank = q * per + delta
                first = shared.first_id(rank)
                if rank in made:
                    own = Template(made[rank], streams, shared.rank_of, self._phases, True,
                                    not self._slowed)
                    inst = Instance(rank, own, range(first, first + own.n), 0, run_base)
                    run_base += len(own.runs)
                    inst.groups = [self._intern(g) for g in own.groups]
                    out.append(inst)
                    continue
                inst = Instance(rank, tmpl, range(first, first + tmpl.n), delta, run_base)
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
            g = self._group_id[group] = len(self.members)
            self.members.append([r for r in group if r in self.ids_of_all])
            self.size.append(len(self.members[-1]))
        return g

    @cached_property
    def ids_of_all(self) -> set[int]:
        """The simulated ranks."""
        return lockstep_ranks(self.w, self.lock)

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
        finished = self.launch()
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
        return self.collect(time.perf_counter() - start)

    def launch(self) -> simpy.Event:
        """Start every stream's process; the event fires when all are done (stop there:
        stale completions of rescheduled flows may still sit in the queue, later than
        the step's end)."""
        procs = [self.env.process(stream(self, inst, steps, offsets, name))
                 for inst in self.instances
                 for name, steps, offsets in zip(inst.template.stream_names,
                                                 inst.template.streams,
                                                 inst.template.offsets, strict=True)]
        return self.env.all_of(procs)

    def collect(self, wall: float) -> SimResult:
        """What the run gave (after the event of :meth:`launch` fired, or the queue ran
        dry: a deadlock, raised here), ``wall`` seconds of it."""
        settle(self)
        start_a, end_a = run_spans(self)
        begin = np.frombuffer(self.begin, np.float64)
        last = np.frombuffer(self.last, np.int64)
        if self.lock > 1:  # every rank's spans from its lock-step group's
            assert self.w.shared is not None
            expand(self.w.shared, self.lock, start_a, end_a, begin, last)
        unfinished = np.flatnonzero(np.isnan(end_a))
        if len(unfinished):
            first = self.w.tasks[int(unfinished[0])]
            raise RuntimeError(f"deadlock: {len(unfinished)} tasks never ran, first "
                               f"{first.name} on rank {first.rank}")
        busy = busy_by_class(self.topo.own(self.net.busy), self.lock)
        end = float(end_a.max()) if len(end_a) else 0.0
        return SimResult(self.w, start_a, end_a, begin, last, busy, end,
                         self._event_count(), wall,
                         len(self.instances) if self.lock > 1 else 0, self.merged)

    def _event_count(self) -> int:
        """Events SimPy scheduled: its private heap counter (simpy 4's ``_eid``)."""
        counter = getattr(self.env, "_eid", None)
        return int(next(counter)) if counter is not None else 0

    # ------------------------------------------------------------ streams
    def burst_counters(self, rank: int, stream: str) -> tuple[bool, dict[int, float],
                                                              dict[int, float]]:
        """Whether ``stream`` of ``rank`` counts its compute toward the burst before the
        rank's next collective (the compute stream, where the profile's sync cost grows
        with the burst), and the ranks' compute seconds so far and as of their last
        collective."""
        if self.bursts:
            self._busy.setdefault(rank, 0.0)
            self._mark.setdefault(rank, 0.0)
        return self.bursts and stream == "compute", self._busy, self._mark

    # ------------------------------------------------------------ transfers
    def transfer(self, grp: int, phases: Phases,
                 cut: float = 0.0) -> Generator[simpy.Event, Any, None]:
        """A collective's plan, phase by phase, once every member has arrived (``cut``
        seconds, at most 0, off the first phase's latency: :meth:`_burst_cost`)."""
        weight = self.group_weight(grp)
        for i, (legs, latency) in enumerate(phases):
            alpha = max(latency + cut, 0.0) if i == 0 else latency
            if len(legs) == 1:  # the common case: α rides on the flow's completion
                link_class, nbytes = legs[0]
                yield self.net.transfer(nbytes, self.group_links(grp, link_class), weight,
                                        alpha)
                continue
            flows = [self.net.transfer(nbytes, self.group_links(grp, link_class), weight)
                     for link_class, nbytes in legs]
            pending = [f for f in flows if not f.triggered]
            if pending:
                yield AllOf(self.env, pending)
            if alpha > 0:
                yield Timeout(self.env, alpha)

    def burst_cost(self, phases: Phases,
                    burst: float) -> float:
        """What a collective costs beyond its sync cost when its members arrive from up to
        ``burst`` seconds of compute (:func:`simulator.system.collectives.cost.sync_burst_cost`;
        negative after a burst shorter than the calibration's, never below minus the
        sync cost itself)."""
        plan = self._plan_of.get(id(phases))
        return 0.0 if plan is None else sync_burst_cost(plan, self.hw, burst)

    def dst(self, inst: Instance, dst: int) -> int:
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
                self.w.weight_of(rank) * self.lock)
        rate, cal, alpha, links, weight = route
        if cal is not None:
            nbytes = nbytes * rate / (cal.busbw_GBps * 1e9)
        return self.net.transfer(nbytes, links, weight, alpha)

    def group_weight(self, grp: int) -> float:
        """How many ranks the simulated members stand for on shared links."""
        weight = self._weights.get(grp)
        if weight is None:
            members = self.members[grp]
            weight = self._weights[grp] = self.w.weight * len(members) * self.lock \
                if self.w.weights is None else sum(self.w.weights[r] for r in members)
        return weight

    def group_links(self, grp: int, link_class: LinkName) -> tuple[Any, ...]:
        """Every simulated member's link of a class (shared links once): a ring moves in
        lock-step, so one flow over all of them proceeds at the slowest member's share."""
        key = (grp, link_class)
        links = self._links.get(key)
        if links is None:
            links = self._links[key] = self.topo.group_links(self.members[grp], link_class)
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
            held = sm_factor(plan, self.hw.gpu) if plan.sms and self._sms is not None \
                else 1.0
            if held > 1:
                self._sm_slow[id(out)] = held
            self._plans_alive.append(plan)  # keeps id(plan) unique while cached
            if self.bursts and plan.n > 1:
                self._plan_of[id(out)] = plan
        return out


def simulate(workload: Workload, hw: HardwareProfile,
             progress: Callable[[float], None] | None = None, horizon: float = 0.0,
             lockstep: bool = True, chains: bool = True) -> SimResult:
    """Run ``workload`` alone; ``lockstep=False`` simulates every rank even where its
    TP group runs in lock-step, ``chains=False`` every step with its own events (what
    tests compare lock-step groups and chains with)."""
    return Engine(workload, hw, lockstep=lockstep, chains=chains).run(progress, horizon)
