"""The accounting: each rank's step is a partition, the critical path covers the step,
and the bubble means the same thing in the engine and the analytic method.

- Every ``time_breakdown_s`` entry and ``critical_path_s`` sum to ``step_time_s``
  (1e-9 relative), for bundled scenarios and for hypothesis-generated small ones in
  both fidelities, for the engine and for the analytic method.
- A collective's members that arrive early wait for their peers: that time is
  ``<kind>_wait``, the transfer after the last arrival ``<kind>_transfer``.
- The critical path of a compute-only rank is its compute; through a pipeline it
  never contains idle time when communication is free.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import balanced, make_scenario, run_engine

from simulator.analysis.accounting.vocabulary import (
    CATEGORIES,
    COMM_CATEGORIES,
    COMPUTE_CATEGORIES,
    IDLE_CATEGORIES,
    label,
)
from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.api import simulate_scenario
from simulator.spec.load import load_scenario

SCENARIOS = sorted((Path(__file__).resolve().parent.parent / "scenarios").glob("*.yaml"))
REL = 1e-9


def assert_partition(results: dict[str, Any]) -> None:
    step = results["step_time_s"]
    assert results["time_breakdown_s"], "one entry per simulated rank"
    for entry in results["time_breakdown_s"]:
        # "ranks": how many ranks the entry stands for (asymmetric folding)
        assert set(entry) - {"ranks"} == {"rank", "stage", *CATEGORIES}
        values = [entry[c] for c in CATEGORIES]
        assert min(values) >= -REL * step, entry
        assert sum(values) == pytest.approx(step, rel=REL)
    assert sum(results["step_breakdown_s"].values()) == pytest.approx(step, rel=REL)
    if "critical_path_s" in results:
        assert sum(results["critical_path_s"].values()) == pytest.approx(step, rel=REL)
        path = results["critical_path"]
        assert path[0]["start"] == pytest.approx(0.0, abs=REL * step)
        assert path[-1]["end"] == pytest.approx(step, rel=REL)
        for before, after in itertools.pairwise(path):
            assert after["start"] == pytest.approx(before["end"], rel=REL, abs=1e-15)


@pytest.mark.parametrize("path", [p for p in SCENARIOS if not p.stem.startswith("gpt3-175b-1024")],
                         ids=lambda p: p.stem)
def test_bundled_scenarios_partition_the_step(path: Path) -> None:
    s = load_scenario(path)
    for method in ("engine", "analytic"):
        results, _ = simulate_scenario(s, method=method)
        assert_partition(results)


@pytest.mark.slow
def test_gpt3_partitions_the_step() -> None:
    results, _ = simulate_scenario(load_scenario(SCENARIOS[0].parent / "gpt3-175b-1024.yaml"))
    assert_partition(results)
    assert len(results["time_breakdown_s"]) == 16


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 3]), dp=st.sampled_from([1, 2]),
       m=st.integers(1, 6), schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
       zero=st.sampled_from([0, 1, 2, 3]), recompute=st.sampled_from(["none", "full"]),
       fidelity=st.sampled_from(["folded", "full"]), tied=st.booleans(),
       overlap=st.booleans())
def test_generated_scenarios_partition_the_step(tp: int, pp: int, dp: int, m: int,
                                                schedule: str, zero: int, recompute: str,
                                                fidelity: str, tied: bool,
                                                overlap: bool) -> None:
    s = make_scenario(tp=tp, pp=pp, dp=dp, m=m * dp, schedule=schedule, gpus_per_node=2,
                      model={"layers": 2 * pp, "hidden": 256, "heads": 8, "vocab": 1024,
                             "seq_len": 64, "tied_embeddings": tied},
                      parallel={"zero": zero, "recompute": recompute,
                                "overlap": {"dp": overlap, "pp": overlap}})
    results, _ = simulate_scenario(s, method="engine", fidelity=fidelity)
    assert_partition(results)
    assert_partition(analytic_estimate(s))


def test_single_rank_is_all_compute_and_optimizer() -> None:
    met, _ = run_engine(make_scenario(m=3), costs=balanced(1e-3, 2e-3))
    (entry,) = met["time_breakdown_s"]
    assert entry["forward"] == pytest.approx(3e-3)
    assert entry["backward_input"] == pytest.approx(6e-3)
    idle = sum(entry[c] for c in IDLE_CATEGORIES + COMM_CATEGORIES)
    assert idle == pytest.approx(0.0, abs=1e-12)
    assert met["critical_path_s"] == pytest.approx(
        {c: entry[c] for c in CATEGORIES}, abs=1e-12)


def test_fused_backward_splits_input_and_weight() -> None:
    met, _ = run_engine(make_scenario(m=2), costs=balanced(1e-3, 2e-3, 1.5e-3))
    (entry,) = met["time_breakdown_s"]
    assert entry["backward_input"] == pytest.approx(4e-3)
    assert entry["backward_weight"] == pytest.approx(3e-3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_free_pipeline_bubble_is_the_closed_form(schedule: str) -> None:
    p, m = 4, 6
    met, _ = run_engine(make_scenario(pp=p, m=m, schedule=schedule, free=True),
                        costs=balanced())
    for entry in met["time_breakdown_s"]:
        # a middle stage runs its (microsecond) optimizer step inside the drain
        assert entry["pipeline_bubble"] + entry["optimizer"] >= (p - 1) * 3.0 * (1 - 1e-9)
        assert entry["pipeline_bubble"] == pytest.approx((p - 1) * 3.0, rel=1e-5)
        assert entry["imbalance_idle"] == pytest.approx(0.0, abs=1e-9)
    # with free communication the critical path is compute, end to end
    path = met["critical_path_s"]
    compute = sum(path[c] for c in COMPUTE_CATEGORIES)
    assert compute == pytest.approx(met["step_time_s"], rel=1e-9)
    assert met["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)


def test_tied_embedding_sync_waits_are_not_transfers() -> None:
    """The last stage finishes its backward first and waits at the tied-embedding
    all-reduce for stage 0: the old report drew that wait as a long 'pp' transfer.
    Here it is drain time of the pipeline (the rank's work is done, the pipeline's
    is not), and the transfer is only the all-reduce itself."""
    s = make_scenario(pp=2, m=4, model={"layers": 4, "hidden": 512, "heads": 8,
                                        "vocab": 32000, "seq_len": 128,
                                        "tied_embeddings": True})
    met, result = run_engine(s)
    last = next(e for e in met["time_breakdown_s"] if e["stage"] == 1)
    tie = [t for t in result.workload.tasks if t.kind == "embedding_tie" and t.rank == last["rank"]]
    (task,) = tie
    start, end = next((a, b) for tid, a, b in result.spans if tid == task.id)
    begin = result.comm_start[task.id]
    assert begin > start  # it arrived first and waited
    assert last["embedding_tie_transfer"] == pytest.approx(end - begin, rel=1e-9)
    assert last["embedding_tie_wait"] + last["pipeline_bubble"] + last["imbalance_idle"] \
        >= begin - start - 1e-12
    assert last["pp_transfer"] < begin - start  # not a pipeline transfer


def test_peer_wait_of_a_collective_is_wait() -> None:
    """DP all-reduce between two replicas where one arrives late: the early one waits."""
    from simulator.analysis.report import engine_metrics
    from simulator.builder.workload import build_workload
    from simulator.engine.engine import simulate

    s = make_scenario(dp=2, m=2, parallel={"overlap": {"dp": False}})
    w = build_workload(s, fidelity="full")
    late = [t for t in w.tasks if t.rank == 1 and t.kind == "forward"]
    late[0].duration += 0.5  # rank 1's first forward is 0.5 s slower
    result = simulate(w, s.hardware)
    met = engine_metrics(s, result)
    early = next(e for e in met["time_breakdown_s"] if e["rank"] == 0)
    assert early["dp_wait"] == pytest.approx(0.5, rel=1e-6)
    slow = next(e for e in met["time_breakdown_s"] if e["rank"] == 1)
    assert slow["dp_wait"] == pytest.approx(0.0, abs=1e-12)
    # the critical path runs through the slow rank's compute, not through the wait
    assert met["critical_path_s"]["dp_wait"] == 0.0
    assert any(seg["rank"] == 1 for seg in met["critical_path"])
    assert_partition(met)


def test_categories_and_labels() -> None:
    assert len(set(CATEGORIES)) == len(CATEGORIES)
    for kind in ("tp", "pp", "dp", "zero", "offload", "embedding_tie", "ep", "cp"):
        assert f"{kind}_transfer" in CATEGORIES and f"{kind}_wait" in CATEGORIES
    assert label("embedding_tie_wait") == "embedding-tie wait"
    assert label("pipeline_bubble") == "pipeline bubble"


def test_the_walks_read_views_of_the_result() -> None:
    """The walks' scalar reads are views of the engine's arrays, not copies (8 bytes a
    task each: 1 GB at 31 million tasks), and the last arrival is the engine's ``last``."""
    import numpy as np

    from simulator.analysis.accounting.timing import Timing
    from simulator.builder.columns import task_columns
    from simulator.builder.workload import build_workload
    from simulator.engine.engine import simulate

    s = make_scenario(tp=2, pp=2, dp=2, m=4)
    result = simulate(build_workload(s, fidelity="full"), s.hardware)
    columns = task_columns(result.workload)
    timing = Timing.of(result.workload.tasks, result.start, result.end, result.begin,
                       result.last, columns.prev)
    assert np.shares_memory(np.asarray(timing.start), result.start)
    assert np.shares_memory(np.asarray(timing.prev), columns.prev)
    waited = np.flatnonzero(result.last >= 0)
    assert len(waited) and all(timing.arrived(int(i)) == result.last[i] for i in waited)
    assert timing.arrived(int(np.flatnonzero(result.last < 0)[0])) == \
        int(np.flatnonzero(result.last < 0)[0])
