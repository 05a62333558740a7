"""Chains (:mod:`simulator.engine.chains`) against running every step with its own events.

A chain computes the spans of consecutive steps that nothing else observes (compute
runs, and collectives of one simulated member alone on links no other stream uses) in
the floating-point operations SimPy's clock and the flow network would do, and holds
one event. Every span, collective start, last arrival, each link's busy seconds (in
the network's order, which the busy table sums in) and every report figure must
equal the per-step run's bit for bit, on random small workloads: folded and full,
pipeline schedules, TP with sequence parallelism, DP, ZeRO, CP, NVLink domains that
TP or DP crosses, an oversubscribed core, slow GPUs, jitter, degraded ports, and the
cases where the engine keeps the per-step path (interference, a burst-dependent
sync cost, a network shared with other jobs), each pinned.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import simpy
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from simulator.analysis.report import engine_metrics
from simulator.builder import tasks
from simulator.builder.workload import build_workload
from simulator.engine.engine import Engine
from simulator.errors import UserError
from simulator.spec.load import scenario_from_dict
from simulator.system.curves import BurstCurve

GPT = {"layers": 4, "hidden": 128, "heads": 8, "vocab": 512, "seq_len": 64}


def _scenario(parallel: dict[str, Any], gpus_per_node: int = 4, batch: int = 4,
              variability: dict[str, Any] | None = None,
              cluster: dict[str, Any] | None = None, tp_overlap: str = "none") -> Any:
    """The default stack with its TP collectives in line (``tp_overlap``: Megatron's
    ``async`` backward puts them on a stream of their own, beside the compute)."""
    world = parallel["tp"] * parallel["pp"] * parallel["dp"] * parallel.get("cp", 1)
    return scenario_from_dict({
        "name": "chains", "model": GPT, "stack": {"preset": "megatron-core",
                                                  "tp_overlap": tp_overlap},
        "cluster": {"system": "dgx-a100-80gb", "nodes": max(world // gpus_per_node, 1),
                    "gpus_per_node": min(gpus_per_node, world), **(cluster or {})},
        "parallel": parallel,
        "training": {"global_batch": batch * parallel["dp"], "micro_batch": 1},
        "variability": variability or {}})


def _runs(w: Any, hw: Any) -> tuple[Engine, Any, Engine, Any]:
    chained, per_step = Engine(w, hw), Engine(w, hw, chains=False)
    return chained, chained.run(), per_step, per_step.run()


def _identical(s: Any, ea: Engine, a: Any, eb: Engine, b: Any) -> None:
    """A chained run and a per-step run of one workload: the same numbers, to the bit,
    and figures; the second merged no events."""
    same_figures(s, ea, a, eb, b)
    assert b.merged_events == 0 and not eb.chains


def same_figures(s: Any, ea: Engine, a: Any, eb: Engine, b: Any) -> None:
    """Two runs of one workload: the same numbers, to the bit, and figures."""
    assert a.end_time == b.end_time
    for field in ("start", "end", "begin", "last"):
        assert np.array_equal(getattr(a, field), getattr(b, field), equal_nan=True), field
    assert list(ea.net.busy.items()) == list(eb.net.busy.items())  # order: sums' order
    assert a.link_busy == b.link_busy
    assert ea.net.flows_started == eb.net.flows_started
    fa, fb = engine_metrics(s, a), engine_metrics(s, b)
    for key in ("sim_wall_s", "sim_events"):
        fa.pop(key), fb.pop(key)
    assert fa == fb


LAYOUTS = st.sampled_from([
    {"tp": 2, "pp": 2, "dp": 2},
    {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True},
    {"tp": 4, "pp": 2, "dp": 1, "schedule": "interleaved", "virtual_stages": 2},
    {"tp": 2, "pp": 2, "dp": 2, "schedule": "zb-h1", "recompute": "full"},
    {"tp": 2, "pp": 1, "dp": 4, "zero": 3},
    {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "dp_bucket_MB": 1},
    {"tp": 2, "pp": 2, "dp": 1, "cp": 2, "cp_comm_type": "p2p"},
    {"tp": 2, "pp": 1, "dp": 2, "cp": 2, "cp_comm_type": "allgather"},
    {"tp": 1, "pp": 4, "dp": 2, "schedule": "gpipe"},
    {"tp": 4, "pp": 1, "dp": 2, "overlap": {"dp": True}},
    {"tp": 4, "pp": 1, "dp": 2, "sequence_parallel": True, "overlap": {"dp": True}},
])
VARIABILITY = st.sampled_from([
    None,
    {"jitter": {"sigma": 0.1}, "seed": 3},
    {"slow_gpus": [{"ranks": [1], "compute_slowdown": 1.3}]},
    {"slow_links": [{"rank": 0, "link": "intra_node", "bandwidth_factor": 0.5}]},
    {"slow_links": [{"rank": 2, "link": "inter_node", "bandwidth_factor": 0.5}]},
])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parallel=LAYOUTS, gpus_per_node=st.sampled_from([2, 4, 8]),
       batch=st.integers(1, 6), fidelity=st.sampled_from(["folded", "full"]),
       variability=VARIABILITY, oversubscription=st.sampled_from([1.0, 4.0]),
       tp_overlap=st.sampled_from(["none", "async", "bulk", "pipelined"]))
def test_chains_equal_every_step_run(parallel: dict[str, Any], gpus_per_node: int,
                                     batch: int, fidelity: str,
                                     variability: dict[str, Any] | None,
                                     oversubscription: float, tp_overlap: str) -> None:
    try:
        s = _scenario(parallel, gpus_per_node, batch, variability,
                      {"oversubscription": oversubscription}, tp_overlap)
        w = build_workload(s, fidelity=fidelity)
    except UserError:
        assume(False)
        raise
    ea, a, eb, b = _runs(w, s.hardware)
    _identical(s, ea, a, eb, b)


def test_folded_tp_collectives_run_as_chains() -> None:
    """TP on its own NVLink ports (two GPUs a node: PP and DP cross nodes): each rank's
    all-reduces chain with the compute between them, in far fewer SimPy events."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2, batch=4)
    w = build_workload(s, fidelity="folded")
    ea, a, eb, b = _runs(w, s.hardware)
    assert all(inst.chain for inst in ea.instances)
    assert a.merged_events > 0 and a.events < b.events / 2
    _identical(s, ea, a, eb, b)


def test_full_fidelity_lockstep_groups_chain_too() -> None:
    """A lock-step group's TP collectives have one simulated member on its own port."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True}, gpus_per_node=2)
    w = build_workload(s, fidelity="full")
    ea, a, eb, b = _runs(w, s.hardware)
    assert ea.lock == 2 and a.merged_events > 0
    _identical(s, ea, a, eb, b)


def test_in_line_tp_collectives_chain_beside_the_async_tp_stream() -> None:
    """Megatron's async backward puts each block's input-gradient reduce-scatter on a tp
    stream, whose NCCL kernels hold SMs (so it is gated) and which shares the NVLink port
    with the forward's all-gathers and reduce-scatters on the compute stream. Those chain
    while the tp stream is calm (waiting for a compute event, no flow running): the same
    spans, to the bit, as every step run on its own, in fewer events than when the
    shared port kept them step by step."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True}, gpus_per_node=2,
                  batch=4, tp_overlap="async")
    w = build_workload(s, fidelity="folded")
    ea, a, eb, b = _runs(w, s.hardware)
    assert ea.gates and all("tp" in g for g in ea.gates.values())
    compute = [i for i, name in enumerate(ea.instances[0].template.stream_names)
               if name == "compute"]
    chained = set(ea.instances[0].chain or {})  # id(phases) of each collective it prices
    assert any(sid in compute and id(phases) in chained
               for sid, _, phases in ea.instances[0].template.flows)
    assert a.merged_events > 0 and a.events < 0.6 * b.events  # 398 of 761 (681 when the
    _identical(s, ea, a, eb, b)                                  # port kept them apart)


def test_in_line_tp_collectives_chain_beside_a_userbuffers_tp_stream() -> None:
    """Under TE's userbuffers (``bulk``) the tp stream's collectives hold no SMs, so it is
    not gated; it is a sharer of the compute stream's NVLink port (the forward's
    all-gathers and reduce-scatters stay in line): those chain while it is calm, the
    compute stream's runs whatever it does. The same spans, to the bit, in fewer events."""
    s = _scenario({"tp": 4, "pp": 1, "dp": 2, "sequence_parallel": True,
                   "overlap": {"dp": True}}, gpus_per_node=8, batch=3, tp_overlap="bulk")
    w = build_workload(s, fidelity="folded")
    ea, a, eb, b = _runs(w, s.hardware)
    assert all(set(g) == {"tp"} for g in ea.sharers.values()) and ea.sharers
    assert all("tp" not in g for g in ea.gates.values())
    shared = [entry for inst in ea.instances for entry in (inst.chain or {}).values()
              if entry[8]]
    assert shared  # collectives over the tp stream's links, priced while it is calm
    assert a.merged_events > 0 and a.events < 0.5 * b.events  # 188 of 486
    _identical(s, ea, a, eb, b)


def test_a_link_another_stream_uses_keeps_every_step() -> None:
    """DP and PP on the same NVLink ports as TP (eight GPUs a node): the DP stream's
    flows may overlap a TP all-reduce's, so no collective is priced in closed form."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=8)
    w = build_workload(s, fidelity="folded")
    ea, a, eb, b = _runs(w, s.hardware)
    assert ea.chains and all(inst.chain is None for inst in ea.instances)
    assert a.merged_events == 0
    _identical(s, ea, a, eb, b)


def _slowed(hw: Any, interference: bool, bursts: bool) -> Any:
    update: dict[str, Any] = {}
    if interference:
        update["interference"] = {"intra_node": 1.3, "inter_node": 1.1}
    if bursts:
        update["collective_sync_burst"] = {
            cls: BurstCurve(points=((1e-5, -5.0), (1e-4, 0.0), (1e-3, 60.0)))
            for cls in ("intra_node", "inter_node")}
    return hw.model_copy(update={"gpu": hw.gpu.model_copy(update=update)})


@pytest.mark.parametrize(("interference", "bursts"), [(True, False), (False, True)],
                         ids=["interference", "burst-sync"])
def test_a_changing_pace_or_burst_cost_keeps_every_step(interference: bool,
                                                        bursts: bool) -> None:
    """Interference changes a run's pace mid-run and the burst-dependent sync cost
    reads each rank's compute so far: the engine keeps the per-step path, and its
    figures are the per-step run's."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2)
    hw = _slowed(s.hardware, interference, bursts)
    w = build_workload(s, fidelity="folded")
    ea, a, eb, b = _runs(w, hw)
    assert not ea.chains and a.merged_events == 0
    assert a.end_time > simulate_plain(w, s.hardware)
    _identical(s, ea, a, eb, b)


def simulate_plain(w: Any, hw: Any) -> float:
    return Engine(w, hw).run().end_time


def test_a_network_shared_with_other_jobs_keeps_every_step() -> None:
    """Colocated jobs give the engine their environment and network: another job's
    flows may cross any link."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2)
    w = build_workload(s, fidelity="folded")
    assert Engine(w, s.hardware).chains
    assert not Engine(w, s.hardware, env=simpy.Environment()).chains


def test_a_build_and_its_run_are_freed_without_the_collector() -> None:
    """No reference cycle keeps a workload or an engine alive (the passes' hooks, the
    compiled programs' plan lookup did): they are freed when the last reference goes,
    not at the collector's next full pass (which paused building skips)."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 2}, gpus_per_node=2, batch=6)
    gc.collect()
    w = build_workload(s, fidelity="folded")
    n = len(w.tasks)
    del w
    assert gc.collect() == 0
    w = build_workload(s, fidelity="folded")
    Engine(w, s.hardware).run()
    del w
    assert gc.collect() < n / 4  # SimPy's environment and processes only


#: the collection check, in a fresh interpreter: the suite's own heap and collector
#: state (hundreds of thousands of objects, other tests' pauses) are not this test's
CYCLES = """
import gc
from simulator.builder import tasks

class Node:
    me = None

gc.collect()
base = max(len(gc.get_objects()), 500_000)
for _ in range(8):
    with tasks.gc_paused():
        for _ in range(base // 2):
            node = Node()
            node.me = node
objects = len(gc.get_objects())
assert objects < 4 * base, (objects, base)
"""


def test_cycles_made_under_a_pause_are_still_collected() -> None:
    """What a pause made skips the young collections; once the tracked objects have
    doubled, a full collection takes the cyclic garbage among them (eight pauses of
    base/2 self-referencing objects each leave fewer than 4 × base alive)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CYCLES], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_objects_someone_froze_stay_frozen() -> None:
    """A program that froze its objects (``gc.freeze`` before a fork) keeps them
    frozen: the pause promotes nothing then (the frozen count does not grow; it may
    shrink, as frozen objects that die leave the permanent generation: in a full test
    run something frees a couple of them during the block now and then)."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with tasks.gc_paused():
            made = [[i] for i in range(1000)]
        assert gc.get_freeze_count() <= frozen and len(made) == 1000
    finally:
        gc.unfreeze()


def test_an_interrupt_in_the_promotion_leaves_the_collector_enabled(monkeypatch: Any) -> None:
    """A SIGINT that lands while the pause promotes what it made (a KeyboardInterrupt out
    of ``gc.freeze`` or ``gc.collect``) must not leave automatic collection off for the
    rest of the process."""
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tasks, "_promote", interrupted)
    assert gc.isenabled()
    made: list[list[int]] = []
    with pytest.raises(KeyboardInterrupt), tasks.gc_paused():
        made.append([0])  # work under the pause; the interrupt comes on the way out
    assert gc.isenabled() and made == [[0]]
