"""Lock-step groups (:mod:`simulator.engine.lockstep`) against simulating every rank.

At full fidelity the engine runs one process per TP group where its ranks provably
run alike, and gives every rank its group's spans. Every span, collective start and
report figure must equal the per-rank run's bit for bit, over the layouts that shape
a TP group's traffic; so must the last arrival, but among a TP group's simultaneous
arrivals (SimPy's queue order names one); link busy time (sums over links in another
order) to 1e-12.
Each condition that tells a group's ranks apart makes the engine simulate every
rank (a test each).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import simpy

from simulator.analysis.report import engine_metrics
from simulator.builder.workload import build_workload
from simulator.engine.engine import Engine, simulate
from simulator.engine.lockstep import lockstep_size
from simulator.spec.load import scenario_from_dict
from simulator.system.curves import BurstCurve
from simulator.system.layout import Layout

GPT = {"layers": 4, "hidden": 128, "heads": 8, "vocab": 512, "seq_len": 64}


def _scenario(gpus_per_node: int = 4, variability: dict[str, Any] | None = None,
              cluster: dict[str, Any] | None = None, batch: int = 4,
              **parallel: Any) -> Any:
    world = parallel["tp"] * parallel["pp"] * parallel["dp"] * parallel.get("cp", 1)
    return scenario_from_dict({
        "name": "lockstep", "model": GPT,
        "cluster": {"system": "dgx-a100-80gb", "nodes": max(world // gpus_per_node, 1),
                    "gpus_per_node": gpus_per_node, **(cluster or {})},
        "parallel": parallel,
        "training": {"global_batch": batch * parallel["dp"], "micro_batch": 1},
        "variability": variability or {}})


def _equal(s: Any, a: Any, b: Any) -> None:
    """Two runs of one workload give the same per-rank results and report figures."""
    assert a.end_time == b.end_time
    for field in ("start", "end", "begin"):
        assert np.array_equal(getattr(a, field), getattr(b, field), equal_nan=True), field
    assert a.spans == b.spans and a.comm_start == b.comm_start
    _same_last(a, b)
    assert a.link_busy.keys() == b.link_busy.keys()
    for key, secs in b.link_busy.items():
        assert a.link_busy[key] == pytest.approx(secs, rel=1e-12)
    fa, fb = engine_metrics(s, a), engine_metrics(s, b)
    assert fa.pop("lockstep_groups") == a.lockstep_groups and "lockstep_groups" not in fb
    for key in ("sim_wall_s", "sim_events", "link_busy_s"):
        fa.pop(key), fb.pop(key)
    assert fa == fb  # breakdown, critical path, collectives


def _same_last(a: Any, b: Any) -> None:
    """The member each collective waited for, the same in both runs; where a TP
    group's members arrive at the same instant (every collective of its own), the
    per-rank run names whichever registered last (an order of SimPy's queue, not a
    time): there any member of the collective that arrived then counts."""
    w = a.workload
    differ = np.flatnonzero(a.last != b.last)
    for i in differ.tolist():
        mine, theirs = w.tasks[i], [w.tasks[int(x)] for x in (a.last[i], b.last[i]) if x >= 0]
        assert mine.group == w.layout.tp_group(mine.rank)
        for t in theirs:
            assert t.group == mine.group and t.group_key == mine.group_key
            assert a.start[t.id] == a.start[i] == a.begin[i]


LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2-sp-pp2-dp2-1f1b": {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True},
    "tp4-pp2-interleaved": {"tp": 4, "pp": 2, "dp": 1, "schedule": "interleaved",
                            "virtual_stages": 2},
    "tp2-pp2-zb-h1-recompute": {"tp": 2, "pp": 2, "dp": 2, "schedule": "zb-h1",
                                "recompute": "full"},
    "tp2-dp4-zero3": {"tp": 2, "pp": 1, "dp": 4, "zero": 3},
    "tp2-dp2-zero1-buckets": {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "dp_bucket_MB": 1},
    "tp2-cp2-p2p": {"tp": 2, "pp": 2, "dp": 1, "cp": 2, "cp_comm_type": "p2p"},
    "tp2-cp2-allgather-sp": {"tp": 2, "pp": 1, "dp": 2, "cp": 2,
                             "cp_comm_type": "allgather", "sequence_parallel": True},
    "tp2-cp2-a2a": {"tp": 2, "pp": 2, "dp": 1, "cp": 2, "cp_comm_type": "a2a"},
    "tp2-cp4-a2a+p2p-two-nodes": {"tp": 2, "pp": 1, "dp": 1, "cp": 4,
                                  "cp_comm_type": "a2a+p2p", "cp_a2a": 2},
    "tp4-over-two-nodes": {"tp": 4, "pp": 2, "dp": 2, "gpus_per_node": 2},
    "tp2-oversubscribed": {"tp": 2, "pp": 2, "dp": 4,
                           "cluster": {"oversubscription": 4.0}},
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_lockstep_groups_equal_every_rank_simulated(name: str) -> None:
    spec = dict(LAYOUTS[name])
    s = _scenario(spec.pop("gpus_per_node", 4), cluster=spec.pop("cluster", None), **spec)
    w = build_workload(s, fidelity="full")
    a = simulate(w, s.hardware)
    b = simulate(w, s.hardware, lockstep=False)
    assert a.lockstep_groups == s.parallel.world // s.parallel.tp and b.lockstep_groups == 0
    assert a.events < b.events
    _equal(s, a, b)


def test_lockstep_keeps_interference_and_burst_sync() -> None:
    """Compute slowed by its rank's transfers and a sync cost that grows with the
    compute burst: both per rank, alike in a group."""
    s = _scenario(tp=2, pp=2, dp=2, sequence_parallel=True)
    gpu = s.hardware.gpu.model_copy(update={
        "interference": {"intra_node": 1.3, "inter_node": 1.1},
        "collective_sync_burst": {cls: BurstCurve(points=((1e-5, -5.0), (1e-4, 0.0),
                                                          (1e-3, 60.0)))
                                  for cls in ("intra_node", "inter_node")}})
    hw = s.hardware.model_copy(update={"gpu": gpu})
    w = build_workload(s, fidelity="full")
    a, b = simulate(w, hw), simulate(w, hw, lockstep=False)
    assert a.lockstep_groups == 4
    assert a.end_time > simulate(w, s.hardware).end_time  # both slowed it
    _equal(s, a, b)


@pytest.mark.parametrize("variability", [
    {"jitter": {"sigma": 0.1}, "seed": 2},
    {"slow_gpus": [{"ranks": [3], "compute_slowdown": 1.2}]},
    {"slow_links": [{"rank": 2, "link": "inter_node", "bandwidth_factor": 0.5}]},
    {"stage_systems": [{"stages": [1], "system": "dgx-h100"}]},
], ids=["jitter", "slow-gpu", "slow-link", "mixed-generation"])
def test_ranks_that_differ_are_simulated_each(variability: dict[str, Any]) -> None:
    s = _scenario(tp=2, pp=2, dp=2, variability=variability)
    w = build_workload(s, fidelity="full")
    a = simulate(w, s.hardware)
    assert a.lockstep_groups == 0
    assert a.events == simulate(w, s.hardware, lockstep=False).events


def test_edited_task_objects_are_simulated_each() -> None:
    """Task objects made for a rank (code may edit them) run as that rank's own."""
    s = _scenario(tp=2, pp=2, dp=2)
    w = build_workload(s, fidelity="full")
    assert lockstep_size(w, alone=True) == 2
    w.programs[5].streams["compute"][0].duration += 1e-3
    assert lockstep_size(w, alone=True) == 1
    assert simulate(w, s.hardware).lockstep_groups == 0


def test_folded_moe_and_tp1_have_no_lockstep_groups() -> None:
    s = _scenario(tp=2, pp=2, dp=2)
    assert lockstep_size(build_workload(s, fidelity="folded"), alone=True) == 1
    assert lockstep_size(build_workload(_scenario(tp=1, pp=2, dp=2), fidelity="full"),
                         alone=True) == 1
    moe = scenario_from_dict({
        "name": "moe", "model": {**GPT, "experts": 4, "experts_per_token": 2,
                                 "activation": "swiglu", "bias": False},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 8},
        "parallel": {"tp": 2, "pp": 2, "dp": 2, "ep": 2},
        "training": {"global_batch": 8, "micro_batch": 1}})
    assert lockstep_size(build_workload(moe, fidelity="full"), alone=True) == 1


def test_a_network_shared_with_other_jobs_simulates_every_rank() -> None:
    """Colocated jobs (:mod:`simulator.engine.together`) give the engine their
    environment and network: other flows may meet one rank of a group only."""
    s = _scenario(tp=2, pp=2, dp=2)
    w = build_workload(s, fidelity="full")
    assert Engine(w, s.hardware).lock == 2
    assert Engine(w, s.hardware, env=simpy.Environment()).lock == 1


def test_a_domain_boundary_inside_a_tp_group_simulates_every_rank() -> None:
    s = _scenario(tp=2, pp=2, dp=2)
    w = build_workload(s, fidelity="full")
    assert w.shared is not None
    w.shared.layout = Layout(tp=2, pp=2, dp=2, gpus_per_node=3)
    assert lockstep_size(w, alone=True) == 1
