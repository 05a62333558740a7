"""Which shared links several jobs' flows crossed at once, and for how long.

A :class:`Contention` watches a shared network (:attr:`FlowNetwork.watch`): per shared
link, how many flows of each job are on it; while two or more jobs have flows there
the link is *contended*, and the seconds add up. A flow's job is the job holding the
GPU whose port the flow crosses (jobs hold whole nodes, so every port is one job's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from simulator.system.topology import LinkId


class Contention:
    def __init__(self, job_of: Callable[[LinkId], int]) -> None:
        self.job_of = job_of  # a port's job
        self.on: dict[LinkId, dict[int, int]] = {}  # shared link -> job -> flows on it
        self.since: dict[LinkId, float] = {}  # when its current contention began
        self.contended: dict[LinkId, float] = {}  # seconds with two or more jobs on it
        self.users: dict[LinkId, set[int]] = {}  # the jobs whose flows crossed it

    def _job(self, links: Sequence[Any]) -> int:
        return self.job_of(next(link.id for link in links if not link.weighted))

    def started(self, links: Sequence[Any], now: float) -> None:
        shared = [link.id for link in links if link.weighted]
        if not shared:
            return
        job = self._job(links)
        for link in shared:
            on = self.on.setdefault(link, {})
            before = len(on)
            on[job] = on.get(job, 0) + 1
            self.users.setdefault(link, set()).add(job)
            if before == 1 and len(on) == 2:
                self.since[link] = now

    def ended(self, links: Sequence[Any], now: float) -> None:
        shared = [link.id for link in links if link.weighted]
        if not shared:
            return
        job = self._job(links)
        for link in shared:
            on = self.on[link]
            on[job] -= 1
            if on[job] == 0:
                del on[job]
                if len(on) == 1:
                    self.contended[link] = self.contended.get(link, 0.0) + now - self.since[link]
