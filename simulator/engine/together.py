"""Several workloads on one network, in one SimPy environment.

Each job is a workload per step (its programs, groups and rank numbering), the
topology that names the links its ranks use on the shared network, a number of
measured steps and a start time. A job runs its steps one after another, one
:class:`Engine` per step (the next starts when every stream of the last is done); its
flows share the network's links with every other job's, and nothing else connects
them: jobs are not synchronised with each other. A job that has run its measured
steps keeps stepping, unmeasured, until every job has run its own, so that no
measured step runs on a fabric emptier than it would be in the steady state; the run stops there.

Nothing here knows what a transformer is.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy
from simpy.events import AllOf, Event, Timeout

from simulator.builder.tasks import Workload, gc_paused
from simulator.engine.engine import Engine
from simulator.engine.result import SimResult
from simulator.system.hardware import HardwareProfile
from simulator.system.network import FlowNetwork, Watch
from simulator.system.topology import LinkId, Topology


@dataclass
class Job:
    workload_of: Callable[[int], Workload]  # its k-th step's workload (k from 0)
    hw: HardwareProfile
    topo: Topology  # its ranks' links on the shared network
    steps: int  # measured steps
    start_s: float = 0.0  # when its first step starts


@dataclass
class Steps:
    """One job's measured steps: when each started and ended (seconds), and the first
    one's spans."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    first: SimResult | None = None

    @property
    def times(self) -> list[float]:
        return [e - s for s, e in zip(self.starts, self.ends, strict=True)]


@dataclass
class Together:
    """What a run of several jobs gave: each job's steps and each link's busy seconds."""

    steps: list[Steps]
    busy: dict[LinkId, float]
    end_s: float


def run_together(jobs: Sequence[Job], capacity: Callable[[LinkId], float],
                 shared: Callable[[LinkId], bool], watch: Watch | None = None) -> Together:
    """Run ``jobs`` side by side on one network of links (``capacity``, ``shared``), until
    each has run its measured steps; ``watch`` sees every flow."""
    env = simpy.Environment()
    net = FlowNetwork(env, capacity, shared)
    net.watch = watch
    done = [Event(env) for _ in jobs]
    everyone = AllOf(env, done)
    steps = [Steps() for _ in jobs]
    current: list[Engine | None] = [None] * len(jobs)
    for i, job in enumerate(jobs):
        env.process(_job(env, net, job, steps[i], done[i], current, i))
    with gc_paused():
        try:
            env.run(until=everyone)
        except RuntimeError:  # the queue ran dry first: a job's step never ended
            for engine, ev in zip(current, done, strict=True):
                if engine is not None and not ev.triggered:
                    engine.collect(0.0)  # raises the deadlock with its first task
            raise
    return Together(steps, net.busy, env.now)


def _job(env: simpy.Environment, net: FlowNetwork, job: Job, steps: Steps, done: Event,
         current: list[Engine | None], index: int) -> Generator[simpy.Event, Any, None]:
    if job.start_s > 0:
        yield Timeout(env, job.start_s)
    k = 0
    while True:
        engine = current[index] = Engine(job.workload_of(k), job.hw, env, job.topo, net)
        k += 1
        t0 = env.now
        yield engine.launch()
        if len(steps.starts) < job.steps:
            result = engine.collect(0.0)
            steps.starts.append(t0)
            steps.ends.append(result.end_time)
            if steps.first is None:
                steps.first = result
            if len(steps.starts) == job.steps:
                done.succeed()
