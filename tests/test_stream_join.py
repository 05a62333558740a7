"""A stream's wait for one pending dependency (:func:`simulator.engine.streams.joined`)
against SimPy's ``AllOf``: the same resumption order among events of the same instant
and the same count of scheduled events, so runs are bit-identical either way."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import simpy
from hypothesis import given
from hypothesis import strategies as st
from simpy.events import AllOf, Event, Timeout

from simulator.engine.streams import joined

Join = Callable[[simpy.Environment, list[Event]], Event]


def _log(join: Join, script: list[tuple[int, int, int]]) -> tuple[list[tuple[Any, ...]], int]:
    """Processes that each wait ``delay`` then on a shared event (or on a timeout of the
    same instant), logging when they resume; the log and the events scheduled."""
    env = simpy.Environment()
    shared = [Event(env) for _ in range(3)]
    log: list[tuple[Any, ...]] = []

    def waiter(k: int, delay: int, which: int, kind: int) -> Generator[Event, Any, None]:
        yield Timeout(env, delay)
        if kind == 0:
            pending = [ev for ev in [shared[which]] if not ev.triggered]
            if pending:
                yield join(env, pending)
        else:
            yield Timeout(env, 0)
        log.append((env.now, k))
        if kind == 1 and not shared[which].triggered:
            shared[which].succeed()

    for k, (delay, which, kind) in enumerate(script):
        env.process(waiter(k, delay, which, kind))
    env.run()
    return log, next(env._eid)  # type: ignore[attr-defined]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 1)),
                min_size=1, max_size=12))
def test_joined_resumes_as_all_of_does(script: list[tuple[int, int, int]]) -> None:
    assert _log(joined, script) == _log(AllOf, script)


def test_joined_of_several_is_all_of() -> None:
    env = simpy.Environment()
    assert isinstance(joined(env, [Event(env), Event(env)]), AllOf)
