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
rank's private links (its NVSwitch port, its NIC) a flow always counts once.

The network owns no global state; it lives in the SimPy environment it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import simpy
from simpy.events import Event, Timeout

from simulator.topology import LinkId


class Flow:
    __slots__ = ("done", "gen", "latency", "links", "rate", "remaining", "updated", "weight")

    def __init__(self, done: simpy.Event, links: tuple[LinkId, ...], nbytes: float,
                 weight: float, now: float, latency: float = 0.0) -> None:
        self.done = done
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
        self._cap: dict[LinkId, float] = {}  # capacity of each link seen so far
        self._weighted: dict[LinkId, bool] = {}  # whether a flow counts its weight there
        self.flows_on: dict[LinkId, dict[Flow, None]] = {}
        self.load: dict[LinkId, float] = {}
        self.busy: dict[LinkId, float] = {}  # seconds each link carried at least one flow
        self._busy_since: dict[LinkId, float] = {}
        self.flows_started = 0

    def transfer(self, nbytes: float, links: Sequence[LinkId], weight: float = 1.0,
                 latency: float = 0.0) -> simpy.Event:
        """An event that fires ``latency`` seconds after ``nbytes`` have crossed ``links``
        (the links are free again during the latency)."""
        done = Event(self.env)
        if nbytes <= 0 or not links:
            _succeed_after(self.env, done, latency)
            return done
        now = self.env._now
        flow = Flow(done, tuple(links), float(nbytes), weight, now, latency)
        affected = self._neighbours(flow.links)
        if affected:
            self._settle(affected, now)
        flows_on, load, weighted = self.flows_on, self.load, self._weighted
        for link in flow.links:
            on = flows_on.get(link)
            if on is None:
                on = flows_on[link] = {}
                self._cap[link] = self.capacity(link)
                weighted[link] = self.shared(link)
            if not on:
                self._busy_since[link] = now
            on[flow] = None
            load[link] = load.get(link, 0.0) + (weight if weighted[link] else 1.0)
        affected[flow] = None
        self._reschedule(affected, now)
        self.flows_started += 1
        return done

    def _neighbours(self, links: tuple[LinkId, ...]) -> dict[Flow, None]:
        out: dict[Flow, None] = {}
        flows_on = self.flows_on
        for link in links:
            on = flows_on.get(link)
            if on:
                out.update(on)
        return out

    def _settle(self, flows: dict[Flow, None], now: float) -> None:
        for f in flows:
            f.remaining -= f.rate * (now - f.updated)
            f.updated = now

    def _reschedule(self, flows: dict[Flow, None], now: float) -> None:
        cap, load = self._cap, self.load
        for f in flows:
            links = f.links
            link = links[0]
            rate = cap[link] / load[link]
            for link in links[1:]:
                r = cap[link] / load[link]
                rate = min(rate, r)
            if rate == f.rate and f.gen:
                continue  # unchanged: its pending completion stays valid
            f.rate = rate
            f.gen += 1
            delay = max(f.remaining, 0.0) / rate
            ev = Timeout(self.env, delay)
            ev.callbacks.append(self._make_finisher(f, f.gen))

    def _make_finisher(self, flow: Flow, gen: int) -> Callable[[Any], None]:
        def finish(_: Any) -> None:
            if flow.gen == gen:
                self._finish(flow)
        return finish

    def _finish(self, flow: Flow) -> None:
        now = self.env._now
        flow.remaining = 0.0
        flow.gen = -1
        flows_on, load, weighted = self.flows_on, self.load, self._weighted
        for link in flow.links:
            on = flows_on[link]
            del on[flow]
            load[link] -= flow.weight if weighted[link] else 1.0
            if not on:
                load[link] = 0.0
                self.busy[link] = self.busy.get(link, 0.0) + now - self._busy_since.pop(link)
        affected = self._neighbours(flow.links)
        if affected:
            self._settle(affected, now)
            self._reschedule(affected, now)
        _succeed_after(self.env, flow.done, flow.latency)


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
