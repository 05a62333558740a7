"""Flows sharing links, in SimPy.

A transfer is a flow of bytes over a set of links. Concurrent flows share each
link's capacity fairly: a flow's rate is the smallest fair share among the links
it crosses, ``min over links of capacity / (sum of weights on the link)``. Rates
are recomputed whenever a flow starts or ends, for the flows that share a link
with it, and their completions are rescheduled. Two equal flows on one link
therefore each take twice as long as one alone.

A flow's ``weight`` is how many identical flows it stands for on *shared* links:
symmetry folding simulates one representative rank and charges the links that
ranks share (the fabric core) with the load of all the ranks it represents. On a
rank's private links (its NVSwitch port, its NIC) a flow always counts once. Where a
flow's members sit behind different shared links (a collective spanning several
leaves of a cluster's fabric), its links come as a :class:`Route`, which carries the
load the flow puts on each link and replaces that rule.

A ``watch`` (optional) sees every flow start and end, with its links: what the
colocation of several jobs on one fabric uses to tell which links their flows shared.
Without one nothing is recorded.

The network owns no global state; it lives in the SimPy environment it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import simpy
from simpy.events import Event, Timeout

from simulator.system.topology import LinkId


class Route(tuple[LinkId, ...]):
    """Links (a tuple of link ids) with the load a flow over them puts on each: how
    many flows it stands for there (``loads``, one per link, in order)."""

    loads: tuple[float, ...]

    def __new__(cls, links: Sequence[LinkId], loads: Sequence[float]) -> Route:
        route = super().__new__(cls, links)
        if len(route) != len(loads):
            raise ValueError(f"{len(route)} links but {len(loads)} loads")
        route.loads = tuple(float(x) for x in loads)
        return route


class Watch(Protocol):
    """Told when a flow starts and when it ends (its links, the time)."""

    def started(self, links: tuple[_Link, ...], now: float) -> None: ...

    def ended(self, links: tuple[_Link, ...], now: float) -> None: ...


class _Link:
    """One link's state: its capacity, its load (weighted flow count), the flows on it
    and how long it has carried at least one."""

    __slots__ = ("busy", "cap", "flows", "id", "load", "since", "weighted")

    def __init__(self, link: LinkId, cap: float, weighted: bool) -> None:
        self.id = link
        self.cap = cap
        self.weighted = weighted  # whether a flow counts its weight here (shared links)
        self.flows: dict[Flow, None] = {}
        self.load = 0.0
        self.busy = 0.0
        self.since = 0.0


class Flow:
    __slots__ = ("done", "gen", "latency", "links", "loads", "rate", "remaining", "updated",
                 "weight")

    def __init__(self, done: simpy.Event, links: tuple[_Link, ...], nbytes: float,
                 weight: float, now: float, latency: float = 0.0,
                 loads: tuple[float, ...] | None = None) -> None:
        self.done = done
        self.loads = loads  # per link, its load there (a Route's), else None
        self.latency = latency
        self.links = links
        self.remaining = nbytes
        self.weight = weight
        self.rate = 0.0
        self.updated = now
        self.gen = 0


class FlowNetwork:
    def __init__(self, env: simpy.Environment, capacity: Callable[[LinkId], float],
                 shared: Callable[[LinkId], bool] = lambda link: False) -> None:
        self.env = env
        self.capacity = capacity
        self.shared = shared
        self._links: dict[LinkId, _Link] = {}  # every link seen so far
        # a links tuple (by identity: callers pass the same tuple for a group's every
        # collective) -> (that tuple, kept alive so its id stays unique, its links)
        self._resolved: dict[int, tuple[Sequence[LinkId], tuple[_Link, ...]]] = {}
        self.flows_started = 0
        self.watch: Watch | None = None

    @property
    def busy(self) -> dict[LinkId, float]:
        """Seconds each link carried at least one flow (links that carried any)."""
        return {link.id: link.busy for link in self._links.values() if link.busy > 0}

    def _resolve(self, links: Sequence[LinkId]) -> tuple[_Link, ...]:
        got = self._resolved.get(id(links))
        if got is not None and got[0] is links:
            return got[1]
        objs = []
        for link in links:
            obj = self._links.get(link)
            if obj is None:
                obj = self._links[link] = _Link(link, self.capacity(link), self.shared(link))
            objs.append(obj)
        out = tuple(objs)
        self._resolved[id(links)] = (links, out)
        return out

    def transfer(self, nbytes: float, links: Sequence[LinkId], weight: float = 1.0,
                 latency: float = 0.0, done: simpy.Event | None = None) -> simpy.Event:
        """An event that fires ``latency`` seconds after ``nbytes`` have crossed ``links``
        (the links are free again during the latency): ``done`` if given (an event
        others already wait on), else a new one."""
        if done is None:
            done = Event(self.env)
        if nbytes <= 0 or not links:
            _succeed_after(self.env, done, latency)
            return done
        now = self.env._now
        objs = self._resolve(links)
        loads = links.loads if type(links) is Route else None
        flow = Flow(done, objs, float(nbytes), weight, now, latency, loads)
        affected: dict[Flow, None] = {}
        rate = math.inf
        if loads is None:
            for link in objs:
                on = link.flows
                if on:
                    affected.update(on)
                else:
                    link.since = now
                on[flow] = None
                link.load += weight if link.weighted else 1.0
                r = link.cap / link.load
                rate = min(rate, r)
        else:
            for link, add in zip(objs, loads, strict=True):
                on = link.flows
                if on:
                    affected.update(on)
                else:
                    link.since = now
                on[flow] = None
                link.load += add
                rate = min(rate, link.cap / link.load)
        self.flows_started += 1
        if self.watch is not None:
            self.watch.started(objs, now)
        if affected:  # the neighbours' rates change: settle them at the old ones first
            _settle(affected, now)
            affected[flow] = None
            self._reschedule(affected)
        else:  # alone on its links: its rate is the smallest capacity share
            flow.rate, flow.gen = rate, 1
            ev = Timeout(self.env, flow.remaining / rate, (flow, 1))
            ev.callbacks.append(self._on_timeout)
        return done

    def _reschedule(self, flows: dict[Flow, None]) -> None:
        env, on_timeout = self.env, self._on_timeout
        for f in flows:
            rate = math.inf
            for link in f.links:
                r = link.cap / link.load
                rate = min(rate, r)
            if rate == f.rate and f.gen:
                continue  # unchanged: its pending completion stays valid
            f.rate = rate
            f.gen += 1
            ev = Timeout(env, max(f.remaining, 0.0) / rate, (f, f.gen))
            ev.callbacks.append(on_timeout)

    def _on_timeout(self, event: Any) -> None:
        """A flow's completion as last scheduled: stale when its rate changed since."""
        flow, gen = event._value
        if flow.gen == gen:
            self._finish(flow)

    def _finish(self, flow: Flow) -> None:
        now = self.env._now
        flow.remaining = 0.0
        flow.gen = -1
        affected: dict[Flow, None] = {}
        loads = flow.loads
        if loads is None:
            weight = flow.weight
            for link in flow.links:
                on = link.flows
                del on[flow]
                if on:
                    link.load -= weight if link.weighted else 1.0
                    affected.update(on)
                else:
                    link.load = 0.0
                    link.busy += now - link.since
        else:
            for link, sub in zip(flow.links, loads, strict=True):
                on = link.flows
                del on[flow]
                if on:
                    link.load -= sub
                    affected.update(on)
                else:
                    link.load = 0.0
                    link.busy += now - link.since
        if self.watch is not None:
            self.watch.ended(flow.links, now)
        if affected:
            _settle(affected, now)
            self._reschedule(affected)
        _succeed_after(self.env, flow.done, flow.latency)


def _settle(flows: dict[Flow, None], now: float) -> None:
    for f in flows:
        f.remaining -= f.rate * (now - f.updated)
        f.updated = now


def _succeed_after(env: simpy.Environment, event: simpy.Event, delay: float) -> None:
    """``event.succeed()`` taking effect ``delay`` later: one scheduled event where a
    succeed followed by a timeout would take two (what ``Event.succeed`` does, with a
    delay; the engine's hottest path)."""
    if delay <= 0:
        event.succeed()
        return
    event._ok = True
    event._value = None
    env.schedule(event, simpy.events.NORMAL, delay)
