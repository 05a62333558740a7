"""Variability: stragglers, degraded links, jitter, folding by classes, many steps.

Oracles: with free communication a data-parallel step waits for its slowest
replica, so one replica k× slower makes the step k× the symmetric one; a ring
over a NIC at half bandwidth moves its bytes at half the rate. Folding by classes
is checked against full fidelity to 1e-9 on asymmetric scenarios of 16 to 64 GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.steps import straggler_wait
from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload
from simulator.cli.main import main
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.spec.variability import (
    JitterSpec,
    VariabilitySpec,
    classes,
    jitter_factors,
    odd_tp_indices,
    resolve,
)
from simulator.strategies.tensor.overlap import backward_resyncs
from simulator.system.layout import Layout

FREE = {"intra_node_bandwidth_GBps": 1e12, "inter_node_bandwidth_GBps": 1e12,
        "link_latency_us": 0}
GPT = {"layers": 8, "hidden": 128, "heads": 8, "vocab": 512, "seq_len": 64}
REL = 1e-9


MOE = {**GPT, "experts": 4, "experts_per_token": 2, "activation": "swiglu", "bias": False,
       "router_skew": {"concentration": 2.0, "seed": 1}}


def make(variability: dict[str, Any] | None = None, *, tp: int = 1, pp: int = 1, dp: int = 1,
         m: int = 4, gpus_per_node: int = 8, cluster: dict[str, Any] | None = None,
         model: dict[str, Any] | None = None, stack: dict[str, Any] | None = None,
         **parallel: Any) -> Scenario:
    world = tp * pp * dp
    gpn = min(world, gpus_per_node)
    return scenario_from_dict({
        "name": "variability",
        "model": model or GPT,
        "stack": stack or {"preset": "megatron-core"},
        "cluster": {"system": "dgx-a100-80gb", "nodes": world // gpn, "gpus_per_node": gpn,
                    **(cluster or {})},
        "parallel": {"tp": tp, "pp": pp, "dp": dp, **parallel},
        "training": {"global_batch": m * dp, "micro_batch": 1},
        "variability": variability or {},
    })


def slow(ranks: list[int], k: float) -> dict[str, Any]:
    return {"slow_gpus": [{"ranks": ranks, "compute_slowdown": k}]}


@pytest.mark.parametrize("k", [1.25, 2.0])
@pytest.mark.parametrize("method", ["engine", "analytic"])
def test_dp2_straggler_closed_form(k: float, method: str) -> None:
    """DP 2, one replica's compute k× slower, free communication: the step is the slow
    replica's compute, k× the symmetric step; the fast one waits the difference."""
    sym, _ = simulate_scenario(make(dp=2, cluster=FREE), method)
    res, spans = simulate_scenario(make(slow([1], k), dp=2, cluster=FREE), method)
    assert res["step_time_s"] == pytest.approx(k * sym["step_time_s"], rel=REL)
    if method == "engine":
        assert spans is not None
        compute = spans[(spans["rank"] == 1) & (spans["stream"] == "compute")]
        busy = (compute["end"] - compute["start"]).sum()
        assert res["step_time_s"] == pytest.approx(busy, rel=REL)
        by_rank = {e["rank"]: e for e in res["time_breakdown_s"]}
        assert straggler_wait(by_rank[1]) == pytest.approx(0.0, abs=1e-12)  # never waits
        assert straggler_wait(by_rank[0]) > 0.1 * (k - 1) * sym["step_time_s"]


def test_degraded_nic_halves_the_ring_rate() -> None:
    """DP 2 across two nodes (one GPU each): the gradient all-reduce's bandwidth term
    doubles when one NIC runs at half its rate."""
    def dp_time(var: dict[str, Any] | None) -> float:
        s = make(var, dp=2, gpus_per_node=1, cluster={"link_latency_us": 0})
        _, spans = simulate_scenario(s)
        assert spans is not None
        dp = spans[(spans["rank"] == 0) & (spans["op"].str.startswith("dp."))]
        return float((dp["end"] - dp["start"]).sum())
    base = dp_time(None)
    half = dp_time({"slow_links": [{"rank": 1, "link": "inter_node", "bandwidth_factor": 0.5}]})
    assert base > 0
    assert half == pytest.approx(2 * base, rel=1e-6)


ASYMMETRIC = [
    ({"tp": 4, "pp": 4, "dp": 4}, slow([21], 1.3)),
    ({"tp": 4, "pp": 4, "dp": 4}, slow([0], 1.5)),
    ({"tp": 4, "pp": 4, "dp": 4, "zero": 1},
     {"slow_links": [{"rank": 37, "link": "inter_node", "bandwidth_factor": 0.3}]}),
    ({"tp": 2, "pp": 2, "dp": 4, "sequence_parallel": True, "recompute": "full"},
     {"slow_links": [{"rank": 6, "link": "intra_node", "bandwidth_factor": 0.5}],
      **slow([9], 1.1)}),
    ({"tp": 2, "pp": 1, "dp": 8, "zero": 3}, {**slow([], 1.0), "slow_gpus":
                                              [{"random": 2, "compute_slowdown": 1.2}],
                                              "seed": 3}),
    ({"tp": 2, "pp": 4, "dp": 4, "schedule": "interleaved", "virtual_stages": 2}, slow([3], 1.4)),
    ({"tp": 1, "pp": 4, "dp": 4, "schedule": "zb-h1"}, slow([6], 1.2)),
    ({"tp": 4, "pp": 4, "dp": 4, "zero": 2}, {
        "slow_gpus": [{"ranks": [50], "compute_slowdown": 1.2},
                      {"ranks": [13], "compute_slowdown": 1.1}],
        "slow_links": [{"rank": 2, "link": "intra_node", "bandwidth_factor": 0.5}]}),
    # expert parallelism splits a replica index into (expert-data index, EP position)
    ({"tp": 2, "pp": 2, "dp": 8, "ep": 4, "sequence_parallel": True, "model": MOE},
     slow([13], 1.3)),
    ({"tp": 2, "pp": 2, "dp": 8, "ep": 2, "zero": 1, "sequence_parallel": True, "model": MOE},
     {"slow_links": [{"rank": 9, "link": "inter_node", "bandwidth_factor": 0.5}]}),
]


IN_LINE = {"preset": "megatron-core", "tp_overlap": "none"}
INTERLEAVED_SP = {**ASYMMETRIC[5][0], "sequence_parallel": True}
#: TP collectives beside the compute: folding holds where each backward block keeps one
#: on the compute stream (async with sequence parallelism, bulk: the output gradient's
#: all-gather) and, where none is (async without it, pipelined), because the straggler's
#: TP index is then odd on every stage (each of these failed before: a few microseconds
#: between one simulated rank's dp_wait and tail against the full run)
OVERLAPPED = [
    pytest.param(ASYMMETRIC[3][0], ASYMMETRIC[3][1], "async", id="sp-async"),
    pytest.param(ASYMMETRIC[5][0], ASYMMETRIC[5][1], "async", id="interleaved-async"),
    pytest.param(INTERLEAVED_SP, ASYMMETRIC[5][1], "async", id="interleaved-sp-async"),
    pytest.param(INTERLEAVED_SP, ASYMMETRIC[5][1], "bulk", id="interleaved-bulk"),
    pytest.param(INTERLEAVED_SP, ASYMMETRIC[5][1], "pipelined", id="interleaved-pipelined"),
    pytest.param(ASYMMETRIC[3][0], ASYMMETRIC[3][1], "pipelined", id="sp-pipelined"),
]


@pytest.mark.parametrize("oversubscribed", [False, True])
@pytest.mark.parametrize(("par", "var"), ASYMMETRIC)
def test_folded_equals_full_on_asymmetric_scenarios(par: dict[str, Any], var: dict[str, Any],
                                                    oversubscribed: bool,
                                                    stack: dict[str, Any] = IN_LINE) -> None:
    m = 8 if par.get("schedule") == "interleaved" else 4
    cluster = {"oversubscription": 4} if oversubscribed else {}
    s = make(var, m=m, cluster=cluster, stack=stack, **par)
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, _ = simulate_scenario(s, "engine", "full")
    assert folded["ranks_simulated"] < full["ranks_simulated"]
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=REL)
    for c, v in full["step_breakdown_s"].items():
        assert folded["step_breakdown_s"][c] == pytest.approx(v, rel=REL, abs=1e-15)
    assert folded["bubble_fraction"] == pytest.approx(full["bubble_fraction"], rel=REL)
    # each simulated rank's entry matches the full run's entry of the same rank
    by_rank = {e["rank"]: e for e in full["time_breakdown_s"]}
    for e in folded["time_breakdown_s"]:
        for c, v in by_rank[e["rank"]].items():
            if c not in ("rank", "stage", "ranks"):
                assert e[c] == pytest.approx(v, rel=REL, abs=1e-15)


@pytest.mark.parametrize(("par", "var", "mode"), OVERLAPPED)
def test_folded_equals_full_beside_overlapped_tp(par: dict[str, Any], var: dict[str, Any],
                                                 mode: str) -> None:
    test_folded_equals_full_on_asymmetric_scenarios(
        par, var, False, {"preset": "megatron-core", "tp_overlap": mode})


@pytest.mark.parametrize(("mode", "sp", "resyncs"), [
    ("none", False, True), ("async", True, True), ("async", False, False),
    ("bulk", True, True), ("pipelined", True, False)])
def test_which_overlaps_resynchronise_the_backward(mode: str, sp: bool, resyncs: bool) -> None:
    """A backward block keeps a TP collective on the compute stream (which every TP rank
    leaves together) in line, under bulk and under async with sequence parallelism."""
    s = make(None, m=4, stack={"preset": "megatron-core", "tp_overlap": mode}, tp=2, pp=2,
             dp=2, sequence_parallel=sp)
    assert backward_resyncs(s) is resyncs


def test_an_unsynchronised_backward_splits_the_index_on_every_stage() -> None:
    """Without a re-synchronising backward the straggler's TP index is odd on every
    stage, not only on its own and its neighbours'."""
    layout = Layout(2, 6, 2, 8)
    attrs = resolve(VariabilitySpec.model_validate(slow([layout.rank(2, 1, 1)], 1.3)),
                    layout.world)
    assert odd_tp_indices(layout, attrs) == {0: set(), 1: {1}, 2: {1}, 3: {1}, 4: set(),
                                             5: set()}
    assert odd_tp_indices(layout, attrs, resync=False) == {p: {1} for p in range(6)}
    assert sum(classes(layout, attrs, resync=False).values()) == layout.world
    assert len(classes(layout, attrs, resync=False)) > len(classes(layout, attrs))


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), pp=st.integers(1, 6), dp=st.integers(1, 9),
       odd=st.lists(st.integers(0, 10**6), max_size=4), resync=st.booleans())
def test_classes_partition_the_cluster(tp: int, pp: int, dp: int, odd: list[int],
                                       resync: bool) -> None:
    layout = Layout(tp, pp, dp, 8)
    ranks = sorted({r % layout.world for r in odd})
    attrs = resolve(VariabilitySpec.model_validate(slow(ranks, 1.5) if ranks else {}),
                    layout.world)
    reps = classes(layout, attrs, resync=resync)
    assert sum(reps.values()) == layout.world
    for r in attrs.asymmetric:  # an asymmetric rank is its own class, simulated
        assert reps[r] == 1
    if not ranks:
        assert tuple(reps) == layout.representatives()
        assert set(reps.values()) == {tp * dp}
    per_stage = len(reps) // pp
    assert per_stage <= (len(ranks) + 1) ** 2


def test_one_straggler_splits_its_replica_and_its_neighbourhood() -> None:
    """GPT-3's 1,024 GPUs (TP 8, PP 16, DP 8), rank 517 (stage 8, replica 0, TP index 5)
    slow: its replica apart on every stage, its TP index apart on stages 7 to 9."""
    layout = Layout(8, 16, 8, 8)
    reps = classes(layout, resolve(VariabilitySpec.model_validate(slow([517], 1.25)), 1024))
    assert len(reps) == 4 * 3 + 2 * 13
    assert sum(reps.values()) == 1024 and reps[517] == 1


def test_jitter_is_seeded_mean_one_and_per_step() -> None:
    spec = JitterSpec(sigma=0.1)
    a = jitter_factors(spec, 1, 0, 5, 200_000)
    assert np.array_equal(a, jitter_factors(spec, 1, 0, 5, 200_000))
    assert not np.array_equal(a[:10], jitter_factors(spec, 1, 1, 5, 10))
    assert a.mean() == pytest.approx(1.0, abs=2e-3)
    assert np.log(a).std() == pytest.approx(0.1, rel=0.02)
    emp = jitter_factors(JitterSpec(distribution="empirical", samples=[2.0, 4.0]), 0, 0, 0, 1000)
    assert set(np.round(emp, 12)) == {round(2 / 3, 12), round(4 / 3, 12)}


def test_jitter_same_rank_same_draws_in_both_fidelities() -> None:
    s = make({"jitter": {"sigma": 0.2}, "seed": 7}, tp=2, pp=2, dp=2)
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, _ = simulate_scenario(s, "engine", "full")
    # stage 0's representative (rank 0) draws the same factors in both runs
    f0 = next(e for e in folded["time_breakdown_s"] if e["rank"] == 0)
    g0 = next(e for e in full["time_breakdown_s"] if e["rank"] == 0)
    assert f0["forward"] == pytest.approx(g0["forward"], rel=REL)
    nominal, _ = simulate_scenario(make(tp=2, pp=2, dp=2), "engine", "full")
    assert full["step_time_s"] != nominal["step_time_s"]


def _scenario_file(tmp_path: Path, var: dict[str, Any]) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({
        "name": "steps", "model": GPT,
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 8},
        "parallel": {"tp": 2, "pp": 2, "dp": 2},
        "training": {"global_batch": 8}, "variability": var}))
    return path


@pytest.mark.parametrize(("var", "field"), [
    (slow([99], 1.2), "variability.slow_gpus[0].ranks = 99"),
    ({"slow_gpus": [{"ranks": [1], "random": 1, "compute_slowdown": 1.2}]},
     "variability.slow_gpus[0] = "),
    ({"slow_gpus": [{"random": 9, "compute_slowdown": 1.2}]}, "variability.slow_gpus[0].random"),
    ({"slow_links": [{"rank": 8, "link": "inter_node", "bandwidth_factor": 0.5}]},
     "variability.slow_links[0].rank = 8"),
    ({"slow_links": [{"rank": 1, "link": "inter_node", "bandwidth_factor": 2}]},
     "variability.slow_links.0.bandwidth_factor"),
    ({"jitter": {"distribution": "empirical"}}, "variability.jitter.samples"),
    ({"jitter": {"sigma": 0.1, "samples": [1.0]}}, "variability.jitter.samples"),
    ({"stragglers": 1}, "variability.stragglers"),
])
def test_bad_variability_is_one_line(var: dict[str, Any], field: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(_scenario_file(tmp_path, var))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err


def test_steps_distribution_through_the_cli(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = _scenario_file(tmp_path, {"jitter": {"sigma": 0.1}, **slow([3], 1.2), "seed": 2})
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--steps", "6", "--no-plots"]) == 0
    steps = json.loads((out / "results.json").read_text())["steps"]
    times = steps["per_step_s"]
    assert steps["count"] == 6 and len(times) == 6 and len(set(times)) == 6
    d = steps["step_time_s"]
    assert d["min"] <= d["p50"] <= d["p95"] <= d["p99"] <= d["max"] == max(times)
    assert steps["total_s"] == pytest.approx(sum(times))
    assert steps["straggler_wait_s"]["mean"] > 0
    assert "6 steps (fresh jitter each)" in capsys.readouterr().out


def test_steps_without_jitter_are_equal_and_need_the_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _scenario_file(tmp_path, slow([3], 1.2))
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--steps", "3", "--no-plots"]) == 0
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert len(set(steps["per_step_s"])) == 1 and steps["jitter"] is False
    assert main(["run", str(path), "--out", str(tmp_path / "a"), "--steps", "3",
                 "--method", "analytic"]) == 2
    assert "--steps = 3" in capsys.readouterr().err


def test_expert_grid_unlike_the_dense_one_simulates_every_rank() -> None:
    """Experts with their own TP degree regroup a stage in a grid that does not factor
    into (replica, TP index): with variability, folding keeps every rank."""
    s = make(slow([3], 1.2), tp=2, pp=1, dp=4, ep=4, expert_tp=1, sequence_parallel=True,
             model=MOE)
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, _ = simulate_scenario(s, "engine", "full")
    assert folded["ranks_simulated"] == full["ranks_simulated"] == 8
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=REL)


# ------------------------------------------------------------ mixed generations


def _durations(s: Scenario, stage: int) -> list[float]:
    w = build_workload(s, fidelity="folded")
    rank = w.layout.rank(stage, 0, 0)
    return [t.duration for t in w.programs[rank].streams["compute"] if t.plan is None]


def test_mixed_generation_prices_each_stage_on_its_system() -> None:
    """Stages 2 and 3 on A100, 0 and 1 on H100: each stage's compute tasks take exactly
    what they take on a cluster of its own system; folded equals full."""
    def on(system: str, var: dict[str, Any] | None = None) -> Scenario:
        return scenario_from_dict({
            "name": "mixed", "model": GPT, "cluster": {"system": system, "nodes": 1},
            "parallel": {"tp": 2, "pp": 4}, "training": {"global_batch": 4},
            "variability": var or {}})
    mixed = on("dgx-h100", {"stage_systems": [{"stages": [2, 3], "system": "dgx-a100-80gb"}]})
    h100, a100 = on("dgx-h100"), on("dgx-a100-80gb")
    assert _durations(mixed, 0) == _durations(h100, 0)
    assert _durations(mixed, 3) == _durations(a100, 3)
    assert _durations(a100, 3) != _durations(h100, 3)
    folded, _ = simulate_scenario(mixed, "engine", "folded")
    full, _ = simulate_scenario(mixed, "engine", "full")
    assert folded["ranks_simulated"] == 4
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=REL)
    fast, _ = simulate_scenario(h100)
    assert folded["step_time_s"] > fast["step_time_s"]
    peaks = [on(x).hardware.gpu.peak_flops("bf16") for x in ("dgx-h100", "dgx-a100-80gb")]
    assert folded["mfu"] == pytest.approx(folded["model_tflops_per_gpu"] * 1e12
                                          / (sum(peaks) / 2), rel=REL)
    caps = {m["stage"]: m["capacity"] for m in folded["memory"]}
    assert caps[0] == h100.hardware.gpu.memory_GB * 1e9
    assert caps[3] == a100.hardware.gpu.memory_GB * 1e9


@pytest.mark.parametrize(("entries", "needle"), [
    ([{"stages": [5], "system": "dgx-a100-80gb"}], "variability.stage_systems[0].stages = 5"),
    ([{"stages": [1], "system": "dgx-a100-80gb"}, {"stages": [1], "system": "dgx-h100"}],
     "variability.stage_systems[1].stages = 1"),
    ([{"stages": [1], "system": "dgx-a101"}], "variability.stage_systems[0].system = 'dgx-a101'"),
])
def test_bad_stage_systems_are_one_line(entries: list[dict[str, Any]], needle: str,
                                        tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({
        "name": "bad", "model": GPT, "cluster": {"system": "dgx-h100", "nodes": 1},
        "parallel": {"tp": 2, "pp": 4}, "training": {"global_batch": 4},
        "variability": {"stage_systems": entries}}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_steps_are_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _scenario_file(tmp_path, {"jitter": {"sigma": 0.1}})
    assert main(["run", str(path), "--out", str(tmp_path / "o"), "--steps", "1000000"]) == 2
    assert "--steps = 1000000: at most 100,000 steps" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
