"""A dependency on the step just before on the same stream, which the compiler drops.

A pipeline's send waits on the last task of the action before it, on the same stream.
The stream runs its steps in order, so that task has ended when the send starts: where
it is a collective or a send that nothing else waits on,
:meth:`simulator.engine.compile.Template._after` drops the dependency and the step
before no longer has a dependent, so neither needs a SimPy event. Every span,
collective start, last arrival, link busy second (in the network's order) and report
figure must equal a compile that keeps them, on random small workloads — folded and
full, chained and step by step, with slow GPUs, jitter and degraded ports — in fewer
events wherever a pipeline sends; and a dependency that is shared, on a compute run or
on another task is kept.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from simulator.builder.tasks import Task
from simulator.builder.workload import build_workload
from simulator.engine.compile import COLL, RUN, SEND, Template
from simulator.engine.engine import Engine
from simulator.errors import UserError
from tests.test_chains import LAYOUTS, VARIABILITY, _scenario, same_figures


def _both(w: Any, hw: Any, chains: bool) -> tuple[Engine, Any, Engine, Any]:
    """The run as compiled, and compiled keeping every dependency."""
    dropped = Engine(w, hw, chains=chains)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Template, "_after", staticmethod(lambda *_: False))
        kept = Engine(w, hw, chains=chains)
    return dropped, dropped.run(), kept, kept.run()


def _identical(s: Any, ea: Engine, a: Any, eb: Engine, b: Any) -> None:
    """The same figures (:func:`tests.test_chains.same_figures`), in no more events."""
    same_figures(s, ea, a, eb, b)
    assert a.events <= b.events


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parallel=LAYOUTS, gpus_per_node=st.sampled_from([2, 4, 8]),
       batch=st.integers(1, 6), fidelity=st.sampled_from(["folded", "full"]),
       variability=VARIABILITY, chains=st.booleans())
def test_dropped_dependencies_change_no_figure(parallel: dict[str, Any], gpus_per_node: int,
                                               batch: int, fidelity: str,
                                               variability: dict[str, Any] | None,
                                               chains: bool) -> None:
    try:
        s = _scenario(parallel, gpus_per_node, batch, variability)
        w = build_workload(s, fidelity=fidelity)
    except UserError:
        assume(False)
        raise
    _identical(s, *_both(w, s.hardware, chains))


@pytest.mark.parametrize("fidelity", ["folded", "full"])
def test_a_pipeline_send_needs_no_event(fidelity: str) -> None:
    """Sends on the compute stream after a TP all-reduce: one event fewer each."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2, batch=4)
    w = build_workload(s, fidelity=fidelity)
    ea, a, eb, b = _both(w, s.hardware, True)
    sends = [st for inst in ea.instances for steps in inst.template.streams
             for st in steps if st[0] == SEND]
    assert sends and not any(st[1] for st in sends)  # no send waits on an event
    assert a.events < b.events
    _identical(s, ea, a, eb, b)


def _task(i: int, stream: str = "compute", plan: Any = None, dst: int = -1,
          deps: list[int] | None = None, dependents: int = 0) -> Task:
    return Task(i, 0, stream, "op", "kind", f"t{i}", 1.0, plan, (0, 1) if plan else (),
                ((0, 1), i) if plan else (), dst, 8.0, 0, 0, 0, deps or [], dependents)


def _compile(tasks: list[Task]) -> list[tuple[Any, ...]]:
    streams: dict[str, list[int]] = {}
    for k, t in enumerate(tasks):
        streams.setdefault(t.stream, []).append(k)
    return Template(tasks, list(streams.items()), None, lambda plan: [plan], False) \
        .streams[0]


def test_only_a_dependency_nothing_else_shares_on_the_step_before_is_dropped() -> None:
    plan = object()
    # a collective, the one task waiting on it right after: dropped, no dependent left
    steps = _compile([_task(0), _task(1, plan=plan, dependents=1),
                      _task(2, dst=1, deps=[1])])
    assert [(k, deps, dependents) for k, deps, _, _, _, _, dependents, _ in steps] == \
        [(COLL, (), 0), (SEND, (), 0)]
    # another task waits on the collective too: both dependencies kept
    steps = _compile([_task(0), _task(1, plan=plan, dependents=2),
                      _task(2, dst=1, deps=[1]), _task(3, stream="pp", deps=[1])])
    assert [(deps, dependents) for _, deps, _, _, _, _, dependents, _ in steps] == \
        [((), 2), ((1,), 0)]
    # the task before is a compute run's last: its run's end keeps its event
    steps = _compile([_task(0, dependents=1), _task(1, plan=plan, deps=[0])])
    assert [(k, deps) for k, deps, *_ in steps] == [(RUN, ()), (COLL, (0,))]
    # a dependency on a task further back: kept
    steps = _compile([_task(0, plan=plan, dependents=1), _task(1, plan=plan),
                      _task(2, dst=1, deps=[0])])
    assert [(deps, dependents) for _, deps, _, _, _, _, dependents, _ in steps] == \
        [((), 1), ((), 0), ((0,), 0)]
