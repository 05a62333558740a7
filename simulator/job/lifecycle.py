"""The job over days: a SimPy model of a whole training run with failures.

One process trains: segments of ``checkpoint_every`` steps (each step's time
drawn from ``step_time_s``, a sample of step times — one value when every step
takes the same), each followed by a checkpoint. A second process draws
interruptions, a Poisson process over the component classes of
:mod:`simulator.job.reliability`, and interrupts the first:

- an **unexpected** failure loses every step since the last checkpoint that is
  safe on storage (for an asynchronous checkpoint, one whose background write
  has finished), then costs the restart and the reload; a failure during a
  restart starts the restart over;
- a **planned** interruption keeps the whole steps done so far, writes a
  checkpoint synchronously, then restarts (the planned stop loses no work).

A synchronous checkpoint stalls training for its write; an asynchronous one for
its copy to host memory, and for the rest of the previous write when the next
checkpoint comes before it finished. The last checkpoint (the trained model)
must be safe before the job ends.

Goodput is useful compute time over wall-clock time, useful time being the
steps to train × the mean step time: with no failures it is 1 − (checkpoint
stalls) / (wall time) exactly. Every draw comes from generators seeded per run
(failures and step times on separate streams, so that two checkpoint intervals
see the same failures: common random numbers for the interval scan).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from simulator.job.reliability import COMPONENTS, CheckpointCost, Component
from simulator.outputs.progress import progress_bar

Event = tuple[float, float, str]  # (seconds, steps trained and in memory, what happened)


@dataclass(frozen=True)
class JobSpec:
    """Everything the job model needs; seconds throughout."""

    steps: int  # optimizer steps to train
    step_time_s: tuple[float, ...]  # step times, sampled per step (one value: every step)
    checkpoint_every: int  # steps between checkpoints
    checkpoint: CheckpointCost
    restart_s: float  # interruption to relaunch, before the reload
    failures_per_s: dict[Component, float]  # unexpected interruptions of the job
    planned_per_s: float = 0.0  # planned interruptions of the job

    @property
    def mean_step_s(self) -> float:
        return float(np.mean(self.step_time_s))


@dataclass
class JobRun:
    """One simulated run."""

    seed: int
    wall_s: float = 0.0
    useful_s: float = 0.0  # steps × mean step time
    checkpoint_s: float = 0.0  # training stalled for checkpoints
    lost_work_s: list[float] = field(default_factory=list)  # per unexpected failure
    restart_s: float = 0.0  # down after unexpected failures (restarts + reloads)
    planned_s: float = 0.0  # down for planned interruptions (write + restart + reload)
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0))
    planned: int = 0
    checkpoints: int = 0
    events: list[Event] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s

    @property
    def breakdown_s(self) -> dict[str, float]:
        """Where the wall time went; the parts add up to it when every step takes the
        same time (else training is the mean step's share)."""
        return {"training": self.useful_s, "checkpoint": self.checkpoint_s,
                "lost_work": sum(self.lost_work_s), "restart": self.restart_s,
                "planned": self.planned_s}

    @property
    def mean_loss_per_failure_s(self) -> float:
        """Unsaved work plus time down, per unexpected failure (nan without any)."""
        n = sum(self.failures.values())
        return (sum(self.lost_work_s) + self.restart_s) / n if n else math.nan


class _Job:
    """The state one run's two processes share."""

    def __init__(self, env: simpy.Environment, spec: JobSpec, seed: int, trace: bool) -> None:
        self.env, self.spec, self.trace = env, spec, trace
        streams = np.random.SeedSequence(seed).spawn(2)
        self.fail_rng = np.random.default_rng(streams[0])
        self.step_rng = np.random.default_rng(streams[1])
        self.run = JobRun(seed)
        self.done = 0  # steps trained, in memory
        self.durable = 0  # steps in the last checkpoint safe on storage
        self.anchor = 0.0  # work since this time is not on storage
        self.anchor_ck = 0.0  # checkpoint stalls counted up to the anchor
        # (steps, captured at, safe at, checkpoint stalls counted when captured)
        self.pending: tuple[int, float, float, float] | None = None
        self.segment: tuple[float, int, float] | None = None  # (start, steps, duration)
        self.down_s = 0.0  # > 0: the next thing to do is to come back up
        self.down_since = 0.0
        self.down_planned = False  # the time down is charged to planned interruptions
        self.stall_since: float | None = None  # waiting for a checkpoint since

    def log(self, what: str) -> None:
        if self.trace:
            self.run.events.append((self.env.now, self.progress(), what))

    def progress(self) -> float:
        """Steps in memory now, counting the running segment's fraction."""
        if self.segment is None:
            return float(self.done)
        start, k, duration = self.segment
        return self.done + k * min(1.0, (self.env.now - start) / duration)

    def segment_s(self, k: int) -> float:
        times = self.spec.step_time_s
        if len(times) == 1:
            return k * times[0]
        return float(self.step_rng.choice(np.asarray(times), size=k).sum())

    def promote(self) -> None:
        """The pending asynchronous write, if it has finished, is now the checkpoint."""
        if self.pending is not None and self.pending[2] <= self.env.now:
            if self.pending[1] > self.anchor:
                self.anchor, self.anchor_ck = self.pending[1], self.pending[3]
            self.durable, self.pending = self.pending[0], None

    def checkpoint(self) -> Generator[simpy.Event, Any, None]:
        ck, env = self.spec.checkpoint, self.env
        self.stall_since = env.now
        if self.pending is not None:  # the previous background write is still going
            yield env.timeout(max(0.0, self.pending[2] - env.now))
            self.promote()
        yield env.timeout(ck.blocking_s)
        self.end_stall()
        self.run.checkpoints += 1
        self.pending = (self.done, env.now, env.now - ck.blocking_s + ck.durable_s,
                        self.run.checkpoint_s)
        self.promote()
        self.log("checkpoint")

    def train(self) -> Generator[simpy.Event, Any, None]:
        spec, env = self.spec, self.env
        while self.done < spec.steps or self.pending is not None or self.down_s:
            try:
                if self.down_s:
                    self.down_since = env.now
                    yield env.timeout(self.down_s)
                    self.end_down()
                    self.down_s, self.anchor = 0.0, env.now
                    self.anchor_ck = self.run.checkpoint_s
                    self.log("restart")
                elif self.done < spec.steps:
                    k = min(spec.checkpoint_every, spec.steps - self.done)
                    duration = self.segment_s(k)
                    self.segment = (env.now, k, duration)
                    yield env.timeout(duration)
                    self.segment, self.done = None, self.done + k
                    yield from self.checkpoint()
                else:  # the trained model's checkpoint must be safe before the end
                    assert self.pending is not None
                    self.stall_since = env.now
                    yield env.timeout(max(0.0, self.pending[2] - env.now))
                    self.end_stall()
                    self.promote()
            except simpy.Interrupt as stop:
                self.interrupted(str(stop.cause))
        self.run.wall_s = env.now
        self.run.useful_s = spec.steps * spec.mean_step_s

    def interrupted(self, cause: str) -> None:
        ck, now = self.spec.checkpoint, self.env.now
        self.log(cause)
        self.promote()
        if self.down_s:  # hit while coming back up: start the restart over
            self.end_down()
            self.down_s = self.spec.restart_s + ck.reload_s
        elif cause == "planned":
            if self.segment is not None:  # keep the whole steps done, then write
                start, k, duration = self.segment
                kept = min(k, int(k * (now - start) / duration))
                self.done += kept
                self.run.planned_s += now - start - kept * duration / k  # the partial step
            if self.stall_since is not None:  # the checkpoint's stall so far counts
                self.end_stall()
            self.durable = self.done
            self.down_s = ck.durable_s + self.spec.restart_s + ck.reload_s
        else:
            # training since the anchor; the stalls in it count as checkpoint time
            self.run.lost_work_s.append(now - self.anchor
                                        - (self.run.checkpoint_s - self.anchor_ck))
            self.done = self.durable
            self.down_s = self.spec.restart_s + ck.reload_s
        self.down_planned = cause == "planned"
        if cause == "planned":
            self.run.planned += 1
        else:
            self.run.failures[cause] += 1
        self.segment, self.pending, self.stall_since = None, None, None
        self.log("rollback")

    def end_stall(self) -> None:
        assert self.stall_since is not None
        self.run.checkpoint_s += self.env.now - self.stall_since
        self.stall_since = None

    def end_down(self) -> None:
        """Charge the time down so far (a restart can itself be interrupted)."""
        spent = self.env.now - self.down_since
        if self.down_planned:
            self.run.planned_s += spent
        else:
            self.run.restart_s += spent

    def interruptions(self, trainer: simpy.Process) -> Generator[simpy.Event, Any, None]:
        spec = self.spec
        causes = [*spec.failures_per_s, "planned"]
        rates = np.array([*spec.failures_per_s.values(), spec.planned_per_s])
        total = float(rates.sum())
        if total <= 0:
            return
        p = rates / total
        while True:
            yield self.env.timeout(self.fail_rng.exponential(1.0 / total))
            cause = causes[int(self.fail_rng.choice(len(causes), p=p))]
            if not trainer.is_alive:
                return
            if cause == "planned" and self.down_s:
                continue  # already down: the maintenance happens during the restart
            trainer.interrupt(cause)


def run_job(spec: JobSpec, seed: int, trace: bool = False) -> JobRun:
    """Simulate one run; ``trace`` records its events (for the progress figure)."""
    env = simpy.Environment()
    job = _Job(env, spec, seed, trace)
    job.log("start")
    trainer = env.process(job.train())
    env.process(job.interruptions(trainer))
    env.run(until=trainer)
    job.log("end")
    return job.run


def run_many(spec: JobSpec, seeds: Sequence[int], desc: str | None = None,
             runs: list[JobRun] | None = None) -> list[JobRun]:
    """One run per seed, appended to ``runs`` (a new list by default) as each ends, so a
    caller interrupted part way knows how many it had; with ``desc``, a progress bar (a
    terminal only, after 2 s)."""
    runs = [] if runs is None else runs
    if desc is None:
        runs.extend(run_job(spec, seed) for seed in seeds)
        return runs
    with progress_bar(len(seeds), desc) as bar:
        for seed in seeds:
            runs.append(run_job(spec, seed))
            bar.update()
    return runs
