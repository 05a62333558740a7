"""Lazy copies (:mod:`simulator.builder.lazy`) against a build that makes every task.

A folded build leaves a stamped copy's tasks unmade but for its first, its last and
what its action returns; the compiler lays its record's steps over it
(:class:`simulator.engine.blocks.Blocks`), and the workload's tasks and programs make
the rest when read. Every task read back (every field, floats by their bits, plans by
identity, every stream's order) and every figure of the run (spans, collective starts,
last arrivals, link busy seconds in the network's order, report figures) must be the
eager build's; the compiled steps, each moved by its offsets, must be the eager
compile's; and the tasks must really stay unmade through the build and the compile.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from simulator.builder import workload as builder
from simulator.builder.context import Context
from simulator.builder.lazy import LazyTasks
from simulator.builder.tasks import Task, Workload
from simulator.builder.workload import build_workload
from simulator.engine.compile import RUN
from simulator.engine.engine import Engine
from simulator.errors import UserError
from tests.test_chains import LAYOUTS, _scenario, same_figures
from tests.test_stamp import MOE, exact, small


def _eager(s: Any) -> Workload:
    """The folded build with every task made."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "eligible", lambda ctx: False)
        w = build_workload(s, fidelity="folded")
    assert w.stamped is None
    return w


def _absolute(e: Engine) -> list[list[tuple[Any, ...]]]:
    """Every stream's steps with their offsets added (what the stream reads)."""
    out = []
    for inst in e.instances:
        tmpl = inst.template
        for steps, (po, ro) in zip(tmpl.streams, tmpl.offsets, strict=True):
            rows = []
            for step, p, r in zip(steps, po, ro, strict=True):
                kind, deps, a, b, g, tail, dependents, lead = step
                if kind == RUN:
                    rows.append((kind, deps, a + r, b + p if b >= 0 else b, g, tail,
                                 dependents, lead))
                    continue
                at = a + p
                rows.append((kind, deps, at, b, g, tmpl.tail(at) if tail is None else tail,
                             dependents, lead + r if lead >= 0 else lead))
            out.append(rows)
    return out


def _compare(s: Any) -> tuple[Engine, Engine]:
    """Run the lazy and the eager build (the lazy one first, before anything reads its
    tasks); every figure and every compiled step equal."""
    lazy, eager = build_workload(s, fidelity="folded"), _eager(s)
    ea = Engine(lazy, s.hardware)
    a = ea.run()
    eb = Engine(eager, s.hardware)
    b = eb.run()
    assert _absolute(ea) == _absolute(eb)
    for ia, ib in zip(ea.instances, eb.instances, strict=True):
        assert ia.ids == ib.ids and ia.template.durations == ib.template.durations
        assert ia.totals == ib.totals
        assert all((x == y).all() for x, y in zip(ia.template.layout, ib.template.layout,
                                                   strict=True))
    same_figures(s, ea, a, eb, b)
    assert exact(lazy) == exact(eager)
    return ea, eb


def test_a_folded_pipeline_keeps_its_copies_unmade_and_runs_the_same() -> None:
    """TP 2 · PP 2 · DP 2, eight micro-batches: many copies' tasks are never made by the
    build or the compile (each record's first copy and those with other dependents are
    compiled from their tasks), and the run is the eager build's."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2, batch=8)
    lazy = build_workload(s, fidelity="folded")
    copies = lazy.stamped
    assert copies is not None and isinstance(lazy.tasks, LazyTasks)
    unmade = sum(t is None for t in copies.tasks)
    assert unmade > len(copies.tasks) / 3
    e = Engine(lazy, s.hardware)
    assert any(inst.template.moved for inst in e.instances)  # steps laid over copies
    assert any(t is None for t in copies.tasks)  # the compile made only some
    _compare(s)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parallel=LAYOUTS, gpus_per_node=st.sampled_from([2, 4, 8]),
       batch=st.integers(1, 8))
def test_lazy_copies_change_no_task_and_no_figure(parallel: dict[str, Any],
                                                  gpus_per_node: int, batch: int) -> None:
    _compare(accepted(parallel, gpus_per_node, batch))


def accepted(parallel: dict[str, Any], gpus_per_node: int, batch: int) -> Any:
    """The scenario of a drawn layout, which must build folded (else the draw is
    dropped)."""
    try:
        s = _scenario(parallel, gpus_per_node, batch)
        build_workload(s, fidelity="folded")
    except UserError:
        assume(False)
        raise
    return s


@pytest.mark.parametrize("case", [
    {"parallel": {"dp": 2, "ep": 2}, "model": MOE},
    {"parallel": {"dp": 2, "ep": 2, "recompute": "full"}, "model": MOE},
    {"parallel": {"dp": 2, "sequence_parallel": True, "recompute": "selective"}},
], ids=["moe", "moe-recompute", "sp-selective"])
def test_experts_and_sequence_parallelism(case: dict[str, Any]) -> None:
    """Experts' all-to-alls meet other simulated ranks inside copies: a laid step's
    rendezvous key is read from its task (made then), as the eager compile's."""
    ea, _ = _compare(small(**case))
    assert any(inst.template.moved for inst in ea.instances)


def test_a_dependency_on_an_unmade_task_makes_its_copy() -> None:
    """Counting dependents makes the copy of a task a dependency names that was never
    made (every later read then sees the dependents)."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 1}, gpus_per_node=2, batch=8)
    lazy, eager = build_workload(s, fidelity="folded"), _eager(s)
    copies = lazy.stamped
    assert copies is not None
    d = next(k for k, t in enumerate(copies.tasks) if t is None)
    counts = [t.dependents if t is not None else 0 for t in copies.tasks]
    waiter = Task(len(copies.tasks), 0, "compute", "X", "x", "waits", deps=[d])
    copies.tasks.append(waiter)
    ctx = SimpleNamespace(tasks=copies.tasks, lazy=copies)
    Context.count_dependents(ctx)  # type: ignore[arg-type]
    made = copies.tasks[d]
    assert made is not None and copies.of(d).made
    assert counts[d] == 0 and made.dependents == 1
    assert exact_task(replace(made, dependents=0)) == exact_task(eager.tasks[d])


def test_reading_a_task_makes_its_copy_as_the_eager_build_does() -> None:
    s = _scenario({"tp": 2, "pp": 2, "dp": 1}, gpus_per_node=2, batch=8)
    lazy, eager = build_workload(s, fidelity="folded"), _eager(s)
    copies = lazy.stamped
    assert copies is not None
    i = next(k for k, t in enumerate(copies.tasks) if t is None)
    t = lazy.tasks[i]
    assert exact_task(t) == exact_task(eager.tasks[i])
    copy = copies.of(i)
    assert copy.made and lazy.tasks[i] is t  # made once, the same object after
    assert all(copies.tasks[k] is not None for k in range(copy.first, copy.first + copy.size))
    assert [u.id for u in copy.stream if u is not None] == \
        [u.id for u in copy.stream if u is not None and u.rank == t.rank]
    rank = next(r for r in lazy.programs if copies.pending(r))
    program = lazy.programs[rank]  # a rank's program makes its copies
    assert not copies.pending(rank)
    assert all(u is not None for ts in program.streams.values() for u in ts)


def test_a_task_put_inside_a_copy_moves_the_rest_of_it() -> None:
    """A task another pass puts between a copy's tasks (as ``compute_after`` does) is
    stepped over when the copy is made: each of its tasks lands where the eager one is."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 1}, gpus_per_node=2, batch=8)
    lazy, eager = build_workload(s, fidelity="folded"), _eager(s)
    copies = lazy.stamped
    assert copies is not None
    copy = next(c for c in copies.all if not c.made and c.size > 3)
    at = copies.position(copy)
    foreign = Task(-7, copy.rank, "compute", "X", "x", "between")
    copy.stream.insert(at + 2, foreign)
    copies.fill(copy)
    got = copy.stream[at:at + copy.size + 1]
    assert got[2] is foreign
    want = [eager.tasks[k] for k in range(copy.first, copy.first + copy.size)]
    assert [exact_task(t) for t in got[:2] + got[3:]] == [exact_task(t) for t in want]


@pytest.mark.parametrize("parallel", [
    {"tp": 2, "pp": 2, "dp": 1, "cp": 2, "cp_comm_type": "p2p"},
    {"tp": 1, "pp": 2, "dp": 1, "schedule": "dualpipe", "virtual_stages": 2},
])
def test_where_a_pass_reads_back_along_a_stream_every_task_is_made(
        parallel: dict[str, Any]) -> None:
    """Context parallelism's ring looks back along the stream for the last compute
    block, DualPipe moves tasks between streams: those builds make every task."""
    try:
        s = _scenario(parallel, gpus_per_node=2, batch=4)
    except UserError:
        pytest.skip("layout not accepted")
    assert build_workload(s, fidelity="folded").stamped is None


def test_variability_and_full_fidelity_make_every_task() -> None:
    slow = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2, batch=4,
                     variability={"slow_gpus": [{"ranks": [1], "compute_slowdown": 1.3}]})
    assert build_workload(slow, fidelity="folded").stamped is None
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2, batch=4)
    assert build_workload(s, fidelity="full").stamped is None


def exact_task(t: Task) -> tuple[Any, ...]:
    return (*(repr(getattr(t, f)) for f in ("id", "rank", "stream", "op", "kind", "name",
                                            "duration", "group", "group_key", "dst",
                                            "nbytes", "microbatch", "layer", "chunk",
                                            "deps", "dependents", "weight_s")), t.plan)


def test_a_copys_reached_tasks_are_made_as_make_makes_them() -> None:
    """``Copies.add`` makes a copy's first, last and returned tasks inline: each is the
    task ``Copies.make`` gives (but for the dependencies and dependents the build adds
    later)."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2, batch=8)
    copies = build_workload(s, fidelity="folded").stamped
    assert copies is not None
    made = 0
    for copy in copies.all:
        for off in copy.rec.reached:
            t = copies.tasks[copy.first + off]
            assert t is not None
            assert exact_task(replace(t, deps=[], dependents=0)) == \
                exact_task(copies.make(copy, off))
            made += 1
    assert made >= 2 * len(copies.all) > 0
