"""Shared per-stage programs (:mod:`simulator.builder.program`) against building every rank.

At full fidelity the builder builds one prototype per stage and the engine runs
every rank of the stage from it. Both the task objects it makes on demand and
the simulation must equal what building every rank's program gives, exactly:
every field of every task, every span, every collective's start and last
arrival, and the number of SimPy events.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from simulator.analysis.report import engine_metrics
from simulator.builder.columns import task_columns
from simulator.builder.program import ProgramView, TaskView, share
from simulator.builder.tasks import Program, Task, Workload
from simulator.builder.workload import build_workload
from simulator.engine.engine import simulate
from simulator.outputs.span_table import span_table
from simulator.spec.load import load_scenario, scenario_from_dict
from simulator.system.collectives.choice import make_plan
from simulator.system.collectives.plan import GroupShape
from simulator.system.layout import Layout
from tests.test_workload_golden import digest

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
GPT = {"layers": 4, "hidden": 128, "heads": 8, "vocab": 512, "seq_len": 64}

CASES: list[tuple[str, tuple[str, ...]]] = [
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.schedule=zb-h1", "parallel.zero=3",
                                 "parallel.recompute=full")),
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.zero=1", "parallel.dp_bucket_MB=1000")),
    ("gpt2-xl-16gpu-slow-net-powersgd", ()),
    ("interleaved-vs-1f1b-interleaved", ("training.global_batch=8",)),
    ("llama2-7b-8gpu-fsdp", ()),
]


def _both(s: Any) -> tuple[Workload, Workload]:
    shared = build_workload(s, fidelity="full")
    per_rank = build_workload(s, fidelity="full", share_stages=False)
    return shared, per_rank


def _same_run(a: Workload, b: Workload, s: Any) -> None:
    # every rank simulated (tests/test_lockstep.py compares lock-step groups with it)
    ra, rb = simulate(a, s.hardware, lockstep=False), simulate(b, s.hardware)
    assert ra.spans == rb.spans
    assert ra.comm_start == rb.comm_start
    assert ra.last_arrival == rb.last_arrival
    assert (ra.end_time, ra.events, ra.link_busy) == (rb.end_time, rb.events, rb.link_busy)


@pytest.mark.parametrize(("name", "sets"), CASES, ids=[f"{n}-{len(s)}" for n, s in CASES])
def test_shared_programs_equal_every_rank_built(name: str, sets: tuple[str, ...]) -> None:
    s = load_scenario(SCENARIOS / f"{name}.yaml", list(sets))
    shared, per_rank = _both(s)
    assert shared.shared is not None and per_rank.shared is None
    assert isinstance(shared.tasks, TaskView) and isinstance(shared.programs, ProgramView)
    assert len(shared.tasks) == len(per_rank.tasks)
    assert digest(shared) == digest(per_rank)
    _same_run(shared, per_rank, s)


def _scenario(variability: dict[str, Any], **parallel: Any) -> Any:
    world = parallel["tp"] * parallel["pp"] * parallel["dp"] * parallel.get("cp", 1)
    return scenario_from_dict({
        "name": "shared", "model": GPT,
        "cluster": {"system": "dgx-a100-80gb", "nodes": world // 4, "gpus_per_node": 4},
        "parallel": parallel,
        "training": {"global_batch": 4 * parallel["dp"], "micro_batch": 1},
        "variability": variability})


@pytest.mark.parametrize("variability", [
    {"jitter": {"sigma": 0.2}, "seed": 3,
     "slow_gpus": [{"ranks": [3], "compute_slowdown": 1.25}]},
    {"slow_gpus": [{"ranks": [5], "compute_slowdown": 1.5}],
     "slow_links": [{"rank": 2, "link": "inter_node", "bandwidth_factor": 0.5}]},
], ids=["jitter-and-slow-gpu", "slow-gpu-and-nic"])
def test_shared_programs_keep_each_ranks_variability(variability: dict[str, Any]) -> None:
    """Slow GPUs and jitter scale one rank's durations, never its stage's prototype."""
    s = _scenario(variability, tp=2, pp=2, dp=2)
    shared, per_rank = _both(s)
    assert shared.shared is not None and shared.shared.factors
    assert digest(shared) == digest(per_rank)
    _same_run(shared, per_rank, s)


def test_shared_programs_with_context_parallel_and_tied_embeddings() -> None:
    s = _scenario({}, tp=2, pp=2, dp=1, cp=2, cp_comm_type="p2p")
    shared, per_rank = _both(s)
    assert shared.shared is not None
    assert digest(shared) == digest(per_rank)
    _same_run(shared, per_rank, s)


def _one_collective(group: tuple[int, ...], layout: Layout) -> Any:
    plan = make_plan("all_reduce", 1e6, GroupShape(len(group), 1), "ring",
                     load_scenario(SCENARIOS / "llama2-7b-8gpu-ddp.yaml").hardware)
    t = Task(id=0, rank=0, stream="compute", op="tp.all_reduce", kind="tp", name="ar",
             plan=plan, group=group, group_key=(group, 0), nbytes=1e6)
    return share(layout, [t], {0: Program(0, {"compute": [t]})})


def test_share_refuses_what_the_permutation_does_not_map() -> None:
    """A group whose image spans other nodes (its plan would differ), or that is no
    group the builder gives the rank, keeps every rank's program."""
    assert _one_collective((0, 1), Layout(tp=2, pp=1, dp=2, gpus_per_node=2)) is not None
    # TP pairs straddle nodes of three GPUs: (0, 1) spans one node, (2, 3) two
    assert _one_collective((0, 1), Layout(tp=2, pp=1, dp=3, gpus_per_node=3)) is None
    assert _one_collective((0, 3), Layout(tp=2, pp=1, dp=2, gpus_per_node=4)) is None


def test_moe_builds_every_rank() -> None:
    """Experts' token loads differ by EP rank: a mixture of experts never shares."""
    moe = {**GPT, "experts": 4, "experts_per_token": 2, "activation": "swiglu",
           "bias": False, "router_skew": {"concentration": 2.0, "seed": 1}}
    s = scenario_from_dict({
        "name": "moe", "model": moe,
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 4},
        "parallel": {"tp": 1, "pp": 2, "dp": 2, "ep": 2},
        "training": {"global_batch": 8, "micro_batch": 1}})
    w = build_workload(s, fidelity="full")
    assert w.shared is None and isinstance(w.tasks, list)
    assert simulate(w, s.hardware).end_time > 0


def test_a_changed_task_object_is_what_runs() -> None:
    """Code may edit the task objects of a shared workload, as of a list's: the engine
    runs the ranks whose objects were made from those objects, the rest from the
    prototypes, and matches every rank built with the same edit."""
    s = _scenario({}, tp=2, pp=2, dp=2)
    runs = []
    for share_stages in (True, False):
        w = build_workload(s, fidelity="full", share_stages=share_stages)
        slow = next(t for t in w.programs[5].streams["compute"] if t.kind == "forward")
        slow.duration += 1e-3
        runs.append((w, simulate(w, s.hardware)))
    (shared, a), (_, b) = runs
    assert isinstance(shared.tasks, TaskView) and set(shared.tasks.made()) == {5}
    assert a.spans == b.spans and a.comm_start == b.comm_start
    assert a.end_time == b.end_time > simulate(build_workload(s, fidelity="full"),
                                               s.hardware).end_time


def _same_columns(a: Workload, b: Workload) -> None:
    ca, cb = task_columns(a), task_columns(b)
    for attr in ca.codes:
        assert ca.values[attr] == cb.values[attr], attr
        assert np.array_equal(ca.codes[attr], cb.codes[attr]), attr
    for attr in ca.numbers:
        assert np.array_equal(ca.numbers[attr], cb.numbers[attr]), attr
    assert np.array_equal(ca.prev, cb.prev)
    assert np.array_equal(ca.plan_ids, cb.plan_ids)
    assert [id(p) for p in ca.plans] == [id(a.tasks[int(i)].plan) for i in ca.plan_ids]
    for rank in a.programs:
        assert np.array_equal(ca.compute(rank), cb.compute(rank))


@pytest.mark.parametrize("case", ["zb-h1-zero3", "jitter-slow-gpu", "cp"])
def test_columns_and_accounting_equal_every_rank_built(case: str) -> None:
    """The accounting reads a shared workload's attributes per stage prototype
    (simulator.builder.columns) and its tasks one at a time: every column, the breakdown,
    the critical path, the collectives and the span table equal the per-rank build's."""
    s = {"zb-h1-zero3": lambda: load_scenario(SCENARIOS / "llama2-7b-8gpu-pp4-1f1b.yaml",
                                              list(CASES[0][1])),
         "jitter-slow-gpu": lambda: _scenario(
             {"jitter": {"sigma": 0.2}, "seed": 3,
              "slow_gpus": [{"ranks": [3], "compute_slowdown": 1.25}]}, tp=2, pp=2, dp=2),
         "cp": lambda: _scenario({}, tp=2, pp=2, dp=1, cp=2, cp_comm_type="p2p")}[case]()
    shared, per_rank = _both(s)
    assert shared.shared is not None
    _same_columns(shared, per_rank)
    ra, rb = simulate(shared, s.hardware, lockstep=False), simulate(per_rank, s.hardware)
    ma, mb = engine_metrics(s, ra), engine_metrics(s, rb)
    assert ma.pop("sim_wall_s") > 0 and mb.pop("sim_wall_s") > 0  # the only clock read
    assert ma == mb
    assert isinstance(shared.tasks, TaskView) and not shared.tasks.made()  # none made
    pd.testing.assert_frame_equal(span_table(ra), span_table(rb))


def test_a_shared_task_alone_equals_its_ranks_objects() -> None:
    """Indexing a rank not made yet makes that one task; it equals the rank's own."""
    s = _scenario({"jitter": {"sigma": 0.2}, "seed": 3}, tp=2, pp=2, dp=2)
    w = build_workload(s, fidelity="full")
    assert isinstance(w.tasks, TaskView)
    singles = [w.tasks[i] for i in range(len(w.tasks))]
    assert not w.tasks.made()
    assert singles == [t for r in range(s.parallel.world) for t in w.tasks.of_rank(r)]
