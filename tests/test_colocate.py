"""Several jobs on one fabric (``clustersim colocate``): the α-β arithmetic of two jobs
sharing a link, exact equality with running alone where no link is shared, the order
of oversubscriptions, the placement policies and the refused cluster files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import simpy
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.colocate.placement import POLICIES
from simulator.colocate.run import Colocation, colocate
from simulator.errors import UserError
from simulator.spec.cluster_file import ClusterFile, load_cluster_file
from simulator.spec.load import load_scenario
from simulator.system.network import FlowNetwork, Route

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "scenarios" / "colocate" / "two-jobs-dgx-h100.yaml"

# TP 4 inside a node, DP 2 across two nodes: every rail's gradient all-reduce is a
# two-member ring over the NICs, its members on two nodes
DP_JOB = {"name": "dp", "model": {"preset": "tiny-gpt"},
          "cluster": {"system": "dgx-h100", "nodes": 2, "gpus_per_node": 4},
          "parallel": {"tp": 4, "pp": 1, "dp": 2},
          "training": {"global_batch": 8, "micro_batch": 2, "dtype": "bf16"},
          "simulation": {"collective_algorithm": "ring"}}


def _cluster(tmp_path: Path, **over: Any) -> Path:
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(DP_JOB))
    spec = {"name": "two", "system": "dgx-h100", "nodes": 4,
            "fabric": {"nodes_per_leaf": 2, "oversubscription": 2.0},
            "placement": "interleaved",
            "jobs": [{"scenario": "dp.yaml", "name": "a", "steps": 2},
                     {"scenario": "dp.yaml", "name": "b", "steps": 2}]}
    for key, value in over.items():
        if key == "fabric":
            spec["fabric"] = {**spec["fabric"], **value}
        else:
            spec[key] = value
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(path: Path) -> Colocation:
    return colocate(*load_cluster_file(path))


def _slowdowns(c: Colocation) -> list[float]:
    return [sum(c.together.steps[i].times) / sum(c.alone[i].steps[0].times)
            for i in range(len(c.jobs))]


def test_two_jobs_sharing_each_uplink_one_to_one_move_at_half_bandwidth(tmp_path: Path) -> None:
    # interleaved: a on nodes 0 and 2, b on 1 and 3, leaves {0, 1} and {2, 3}; a rail's
    # uplink (2 nodes × 46 GB/s / 2) carries one job's ring member at the NIC's rate,
    # two jobs' at half of it
    c = _run(_cluster(tmp_path))
    assert [j.nodes for j in c.jobs] == [[0, 2], [1, 3]]
    hw = c.jobs[0].scenario.hardware
    alone, together = c.alone[0].steps[0].first, c.together.steps[0].first
    assert alone is not None and together is not None
    tasks = [t for t in alone.workload.tasks if t.op == "dp.all_reduce"]
    assert len(tasks) == 8  # 8 ranks, one bucket each
    for t in tasks:
        n = len(t.group)
        beta = 2 * (n - 1) / n * t.nbytes / hw.inter_node.bytes_per_s  # ring, alone
        took_alone = alone.end[t.id] - alone.comm_start[t.id]
        took_together = together.end[t.id] - together.comm_start[t.id]
        # latency unchanged, the bytes at half the bandwidth: β twice
        assert took_together == pytest.approx(took_alone + beta, rel=1e-12)
    assert all(s > 1 for s in _slowdowns(c))
    # every uplink carried both jobs for as long as it was busy (they run in lock-step)
    up = {link: s for link, s in c.together.busy.items() if link[0] == "up"}
    assert c.contention.contended == pytest.approx(up)
    assert set(c.contention.contended) == {("up", leaf, rail) for leaf in (0, 1)
                                           for rail in range(4)}


@pytest.mark.parametrize("over", [
    {"placement": "packed"},  # each job inside its own leaf: no uplink at all
    {"fabric": {"oversubscription": 1.0}},  # interleaved on a non-blocking fabric
])
def test_jobs_placed_apart_run_exactly_as_alone(tmp_path: Path, over: dict[str, Any]) -> None:
    c = _run(_cluster(tmp_path, **over))
    for i in range(2):
        assert c.together.steps[i].times == c.alone[i].steps[0].times
    assert _slowdowns(c) == [1.0, 1.0]
    assert c.contention.contended == {}


def test_each_step_draws_its_own_jitter_alone_and_together_alike(tmp_path: Path) -> None:
    path = _cluster(tmp_path, placement="packed")
    jittery = {**DP_JOB, "variability": {"jitter": {"sigma": 0.2}}}
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(jittery))
    c = _run(path)
    times = c.alone[0].steps[0].times
    assert len(set(times)) == len(times) == 2  # step 1's draws are not step 0's
    assert c.together.steps[0].times == times


def test_a_scenario_given_as_the_cluster_file_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _cluster(tmp_path)
    assert main(["colocate", str(tmp_path / "dp.yaml")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "is a scenario (it has model)" in line


def test_a_job_alone_on_the_cluster_is_the_single_job_simulation(tmp_path: Path) -> None:
    c = _run(_cluster(tmp_path, placement="packed"))
    s = load_scenario(tmp_path / "dp.yaml", ["simulation.fidelity=full"])
    results, _ = simulate_scenario(s)
    assert c.alone[0].steps[0].times[0] == results["step_time_s"]


@settings(max_examples=6, deadline=None)
@given(st.floats(1.05, 8.0), st.floats(1.05, 8.0))
def test_more_oversubscription_never_speeds_a_job_up(low: float, high: float) -> None:
    import tempfile

    low, high = sorted((low, high))
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_run(_cluster(Path(tmp), fabric={"oversubscription": x})) for x in (low, high)]
    for i in range(2):
        slow, fast = runs[1].together.steps[i].times, runs[0].together.steps[i].times
        assert all(a >= b for a, b in zip(slow, fast, strict=True))
    assert all(s > 1 for run in runs for s in _slowdowns(run))


def test_a_route_loads_each_link_with_its_own_count() -> None:
    # one flow standing for 2 on link x (capacity 10 B/s) and 1 on y: x bounds it at 5 B/s
    env = simpy.Environment()
    net = FlowNetwork(env, lambda link: 10.0, lambda link: True)
    done = net.transfer(10.0, Route((("x",), ("y",)), (2.0, 1.0)))
    env.run(done)
    assert env.now == pytest.approx(2.0)
    with pytest.raises(ValueError, match="2 links but 1 loads"):
        Route((("x",), ("y",)), (1.0,))


@pytest.mark.parametrize(("policy", "expected"), [
    ("packed", [[0, 1, 2], [3, 4]]),
    ("interleaved", [[0, 2, 4], [1, 3]]),
    ("spread", [[0, 2, 4], [1, 3]]),
])
def test_placement_policies(policy: str, expected: list[list[int]]) -> None:
    assert POLICIES[policy](range(6), [3, 2], 2) == expected


def test_spread_takes_one_node_per_leaf_in_turn() -> None:
    assert POLICIES["spread"](range(8), [2, 2], 4) == [[0, 4], [1, 5]]


def test_listed_nodes_and_ranges_in_order(tmp_path: Path) -> None:
    path = _cluster(tmp_path, nodes=6, jobs=[
        {"scenario": "dp.yaml", "name": "a", "nodes": ["4-5"], "steps": 1},
        {"scenario": "dp.yaml", "name": "b", "steps": 1}])
    c = _run(path)
    assert [j.nodes for j in c.jobs] == [[4, 5], [0, 1]]


def _job(nodes: Any = None, scenario: str = "dp.yaml") -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": scenario}
    if nodes is not None:
        out["nodes"] = nodes
    return out


@pytest.mark.parametrize(("over", "says"), [
    ({"jobs": [_job([0, 1]), _job(["1-2"])]}, "jobs[1].nodes = 1: also held by job"),
    ({"nodes": 3}, "nodes = 3: the jobs need 4 nodes"),
    ({"jobs": [_job([0, 7]), _job()]}, "jobs[0].nodes = 7: the cluster has nodes 0-3"),
    ({"jobs": [_job(), _job(scenario="nope.yaml")]}, "jobs[1].scenario = 'nope.yaml': no such"),
    ({"jobs": [_job([0]), _job()]}, "jobs[0].nodes = [0]: lists 1 node(s)"),
    ({"jobs": [_job(["3-1"]), _job()]}, "nodes = '3-1': a range runs low-high"),
    ({"placement": "random"}, "placement = 'random': must be one of"),
    ({"fabric": {"leaf": 2}}, "fabric.leaf = 2: unknown key"),
])
def test_a_bad_cluster_file_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], over: dict[str, Any],
        says: str) -> None:
    path = _cluster(tmp_path, **over)
    assert main(["colocate", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert says in err[0], err[0]
    assert not (tmp_path / "out" / "jobs.csv").exists()


def test_a_bad_job_scenario_names_the_job(tmp_path: Path) -> None:
    path = _cluster(tmp_path)
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump({**DP_JOB, "parallel": {"tp": 3}}))
    with pytest.raises(UserError, match=r"^jobs\[0\] \(dp.yaml\): "):
        _run(path)


def test_the_example_shows_a_slowdown_that_vanishes_when_the_jobs_are_apart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, _ = load_cluster_file(EXAMPLE)
    assert isinstance(spec, ClusterFile) and spec.placement == "interleaved"
    for placement, out in (("interleaved", "shared"), ("packed", "apart")):
        assert main(["colocate", str(EXAMPLE), "--placement", placement, "--steps", "1",
                     "--out", str(tmp_path / out)]) == 0
    import pandas as pd

    shared = pd.read_csv(tmp_path / "shared" / "jobs.csv")
    apart = pd.read_csv(tmp_path / "apart" / "jobs.csv")
    assert (shared["slowdown"] > 1).all()
    assert (apart["slowdown"] == 1.0).all()
    assert (pd.read_csv(tmp_path / "shared" / "links.csv")["contended_s"] > 0).any()
    assert pd.read_csv(tmp_path / "apart" / "links.csv").empty
    text = (tmp_path / "shared" / "colocate.md").read_text()
    assert "## Jobs" in text and "slowdown" in text
    assert "slowdown" in capsys.readouterr().out
