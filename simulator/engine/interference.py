"""Interference: compute slowed while the rank's transfers are in flight.

With ``gpu.interference`` in the profile (and a device whose communication overlaps its
compute), a rank's compute runs slow down by the factor of a link class while a transfer
of that rank over that class is in flight (a collective's from its start to its end, a
send's at both ends; the largest factor when several are): a run holds its remaining
work, and each time its rank's factor changes the run's end is rescheduled (a stale end
is ignored by its generation, as :class:`simulator.system.network.FlowNetwork` does for
flows). A collective whose kernels hold SMs for their whole run (``Plan.sms``: DeepEP's,
NCCL's channels) slows its members' compute by gpu.sms / (gpu.sms − those SMs) the same
way (:func:`simulator.system.collectives.channels.sm_factor`).
Its tasks' spans follow the run's piecewise rate
(:attr:`Interference.slow_points`).
"""

from __future__ import annotations

from typing import Any

import simpy
from simpy.events import Event, Timeout

from simulator.system.topology import Topology
from simulator.system.units import LinkName

Phases = list[tuple[list[tuple[LinkName, float]], float]]


class Pace:
    """A rank's compute speed under interference: the factors of its transfers in
    flight, the largest of them (1 with none), and its compute run in progress."""

    __slots__ = ("active", "factor", "run")

    def __init__(self) -> None:
        self.active: list[float] = []
        self.factor = 1.0
        self.run: SlowRun | None = None


class SlowRun:
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


class Interference:
    """Every simulated rank's pace, the runs it stretched and the factors of each
    collective's phases and each send."""

    def __init__(self, env: simpy.Environment, slowing: dict[str, float], topo: Topology,
                 ranks: list[int], held: dict[int, float] | None = None) -> None:
        self.env, self.slowing, self.topo = env, slowing, topo
        self.held = held if held is not None else {}  # id(phases) -> SMs held, as a factor
        self.pace = {rank: Pace() for rank in ranks}
        self.factors: dict[Any, float] = {}  # id(phases) or (src, dst) -> factor
        self.slow_points: dict[int, list[tuple[float, float]]] = {}  # run -> breakpoints

    def slow_run(self, rank: int, run: int, total: float) -> Event:
        """The event that ends a compute run of ``total`` seconds at full speed, at the
        rank's speed as it changes (:meth:`pace_to`)."""
        pace, now = self.pace[rank], self.env._now
        sr = pace.run = SlowRun(Event(self.env), run, total, now)
        if pace.factor != 1.0:
            sr.mark(self.slow_points)
        self._schedule(pace, sr)
        return sr.done

    def _schedule(self, pace: Pace, sr: SlowRun) -> None:
        sr.gen += 1
        gen = sr.gen

        def end(_: Event) -> None:
            if sr.gen == gen:  # not rescheduled since
                if sr.points is not None:
                    sr.points.append((sr.total, self.env._now))
                pace.run = None
                sr.done.succeed()

        Timeout(self.env, max(sr.left, 0.0) * pace.factor).callbacks.append(end)

    def pace_to(self, rank: int, add: float, remove: float) -> None:
        """Add and/or remove a transfer's factor on a rank (0: none); reschedule its
        run's end when its speed changes."""
        pace = self.pace.get(rank)
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
        if sr is not None and now == sr.t0 and factor == 1.0:
            # back to full speed at its start (the transfer it waited for ended now, its
            # release came after the run began): a plain run, as a chain would have it
            sr.points = None
            self.slow_points.pop(sr.index, None)
        elif sr is not None:
            sr.left -= (now - sr.since) / pace.factor
            sr.since = now
            sr.mark(self.slow_points).append((sr.total - sr.left, now))
        pace.factor = factor
        if sr is not None:
            self._schedule(pace, sr)

    def slow_while(self, ev: Event, ranks: Any, factor: float) -> None:
        """Slow ``ranks``' compute by ``factor`` until ``ev`` (a transfer's end) fires."""
        if factor <= 1.0:
            return
        for r in ranks:
            self.pace_to(r, factor, 0.0)

        def release(_: Event) -> None:
            for r in ranks:
                self.pace_to(r, 0.0, factor)

        ev.callbacks.append(release)

    def coll_factor(self, phases: Phases) -> float:
        """A collective's interference: the largest of its link classes' and of the SMs
        its kernels hold (``held``)."""
        f = self.factors.get(id(phases))
        if f is None:
            f = self.factors[id(phases)] = max(
                (self.slowing.get(c, 1.0) for legs, _ in phases for c, _ in legs),
                default=1.0) if self.slowing else 1.0
            f = self.factors[id(phases)] = max(f, self.held.get(id(phases), 1.0))
        return f

    def send_factor(self, src: int, dst: int) -> float:
        f = self.factors.get((src, dst))
        if f is None:
            f = self.factors[(src, dst)] = self.slowing.get(
                self.topo.link_class(src, dst), 1.0)
        return f
