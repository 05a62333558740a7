"""DTensor's redistribution cost after compute beyond a plain collective
(``gpu.funcol_sync_us``, calibration/microbench/funcol_sync.py).

- the fit, from synthetic timings whose excess is known: the ranks' mean of
  ``dtensor − plain``, median over rounds, then over sizes, at least 0; its spread;
- the cost model: where the profile has it, each TP collective of a DTensor stack pays
  it once on the critical path instead of the one-rank host figure
  (``gpu.funcol_overhead_us``), the figure of the TP group's own link class; nothing
  without DTensor;
- the profile: round trip, provenance when measured and when absent, the calibration's
  summary, a bad value refused by name, the uncertainty draw;
- the microbenchmark itself, two gloo processes on the CPU (slow).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from cpu_profile import profile_from

from calibration.microbench import funcol_sync as fs
from calibration.microbench.fit_profile import write_profile
from calibration.microbench.fit_terms import funcol_sync_spread
from calibration.microbench.report_tables import summary_text
from simulator.errors import UserError
from simulator.hardware import UNCERTAINTY_TERMS, HardwareProfile, load_system, validate_profile
from simulator.scenario import Scenario, scenario_from_dict
from simulator.uncertainty import perturbed, step_time_of, with_hardware
from simulator.workload import build_workload

# µs the DTensor path adds per collective, per round (rank 0, rank 1), by message size
EXCESS_US = {
    4096: [(700, 900), (600, 800), (1000, 1200), (100, 300), (750, 850)],
    262144: [(1000, 1200), (1500, 1300), (900, 1100), (1200, 1400), (100, 300)],
    1048576: [(1500, 1700), (1400, 1600), (2900, 3100), (1450, 1550), (1300, 1500)],
}
# the ranks' mean, median over rounds: 800, 1100, 1500; median over sizes: 1100
BY_SIZE_US = {4096: 800.0, 262144: 1100.0, 1048576: 1500.0}
SYNC_US = 1100.0
ROUND_FIGURES_US = [1100.0, 1400.0, 1100.0, 1300.0, 800.0]  # each round's median over sizes


def _record(excess_us: dict[int, list[tuple[float, float]]] | None = None) -> dict[str, Any]:
    """A record as the microbenchmark writes it: a plain all-reduce after the burst of
    1.0 / 1.1 ms + 0.2 ms + S / 2 GB/s (the ranks differ), the DTensor one that plus the
    excess."""
    excess_us = excess_us or EXCESS_US
    rounds = []
    for r in range(len(next(iter(excess_us.values())))):
        rows = []
        for size, per_round in excess_us.items():
            plain = [a + 2e-4 + size / 2e9 for a in (1.0e-3, 1.1e-3)]
            rows.append({"bytes": size, "plain_s": plain,
                         "dtensor_s": [p + e * 1e-6 for p, e in
                                       zip(plain, per_round[r], strict=True)]})
        rounds.append(rows)
    return {"key": fs.sync_key("cpu", 1), "kind": "funcol_sync", "ok": True,
            "device": "cpu", "threads": 1, "link": "intra_node", "op": "all_reduce",
            "nranks": 2, "burst_s": 1e-3, "gemms": 2, "iterations": 16,
            "sizes": list(excess_us), "rounds": rounds}


# ---------------------------------------------------------------- the fit


def test_the_figure_is_the_median_over_sizes_of_the_median_round_of_the_ranks_mean() -> None:
    rec = _record()
    assert {s: us * 1e6 for s, us in fs.excess_by_size(rec).items()} == \
        pytest.approx(BY_SIZE_US)
    assert fs.sync_seconds(rec) * 1e6 == pytest.approx(SYNC_US)
    assert [x * 1e6 for x in fs.round_figures(rec)] == pytest.approx(ROUND_FIGURES_US)
    sigma = statistics.stdev(ROUND_FIGURES_US) / SYNC_US / len(ROUND_FIGURES_US) ** 0.5
    assert funcol_sync_spread(rec) == pytest.approx(sigma, abs=1e-4)


def test_a_dtensor_path_no_slower_gives_no_cost_and_no_spread() -> None:
    rec = _record({4096: [(-50, -30), (-20, -40)], 262144: [(-10, -30), (-60, -20)]})
    assert fs.sync_seconds(rec) == 0.0
    assert funcol_sync_spread(rec) is None


# ---------------------------------------------------------------- the cost model


def _tp(pair: dict[str, float] | None, one_rank: float | None = 80.0, stack: Any = "pytorch-eager",
        sp: bool = False, nodes: int = 1) -> Scenario:
    """TP 2 on one node (or across two), the profile's two funcol figures as given."""
    s = scenario_from_dict({
        "name": "funcol-sync", "stack": stack,
        "model": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": nodes, "gpus_per_node": 2 // nodes},
        "parallel": {"tp": 2, "pp": 1, "dp": 1, "sequence_parallel": sp},
        "training": {"global_batch": 2, "micro_batch": 1}})
    gpu = s.hardware.gpu.model_copy(update={"funcol_overhead_us": one_rank,
                                            "funcol_sync_us": pair or {}})
    return with_hardware(s, s.hardware.model_copy(update={"gpu": gpu}))


@pytest.mark.parametrize("sp", [False, True])
def test_each_tp_collective_pays_the_pair_figure_instead_of_the_one_rank_one(sp: bool) -> None:
    one_rank, pair = _tp(None, sp=sp), _tp({"intra_node": SYNC_US}, sp=sp)
    stream = build_workload(pair).programs[0].streams["compute"]
    issues = [t for t in stream if t.name == "tp.funcol issue"]
    collectives = [t for t in stream if t.kind == "tp"]
    assert len(issues) == len(collectives) > 0
    assert [t.duration for t in issues] == pytest.approx([SYNC_US * 1e-6] * len(issues))
    grown = step_time_of(pair, "engine", None) - step_time_of(one_rank, "engine", None)
    assert grown == pytest.approx(len(collectives) * (SYNC_US - 80.0) * 1e-6, rel=1e-6)
    assert step_time_of(pair, "analytic", None) > step_time_of(one_rank, "analytic", None)


def test_the_figure_of_the_tp_groups_own_link_class() -> None:
    """TP 2 across two nodes pays the inter-node figure; a profile with only the
    intra-node one falls back to the one-rank figure."""
    across = _tp({"intra_node": SYNC_US, "inter_node": 2 * SYNC_US}, nodes=2)
    issues = {t.duration for t in build_workload(across).programs[0].streams["compute"]
              if t.name == "tp.funcol issue"}
    assert list(issues) == pytest.approx([2 * SYNC_US * 1e-6])
    intra_only = _tp({"intra_node": SYNC_US}, nodes=2)
    issues = {t.duration for t in build_workload(intra_only).programs[0].streams["compute"]
              if t.name == "tp.funcol issue"}
    assert list(issues) == pytest.approx([80e-6])


@pytest.mark.parametrize("stack", ["megatron-core", {"preset": "pytorch-eager",
                                                     "cuda_graphs": True}])
def test_no_charge_without_dtensor_or_a_host_cost(stack: Any) -> None:
    base, charged = _tp(None, None, stack), _tp({"intra_node": SYNC_US}, None, stack)
    for method in ("engine", "analytic"):
        assert step_time_of(charged, method, None) == step_time_of(base, method, None)


# ---------------------------------------------------------------- the profile


def test_measured_sync_round_trips_with_its_provenance_and_spread(tmp_path: Path) -> None:
    written = write_profile(profile_from([_record()]), tmp_path / "p.yaml")
    assert load_system(str(tmp_path / "p.yaml")) == written
    assert written.gpu.funcol_sync_us == {"intra_node": pytest.approx(SYNC_US)}
    assert written.gpu.collective_sync_us == {} and written.gpu.send_sync_us == {}
    term = written.provenance["terms"]["funcol_sync"]
    assert term["source"] == "measured" and term["samples"] == 5
    assert {int(s): us for s, us in term["by_size_us"].items()} == BY_SIZE_US
    assert written.uncertainty["funcol_sync"] == pytest.approx(funcol_sync_spread(_record()),
                                                               abs=1e-4)
    assert written.provenance["fit"]["funcol_sync"]["sizes"] == list(BY_SIZE_US)


def test_the_calibration_summary_says_it() -> None:
    text = summary_text(profile_from([_record()]), [], 1.0)
    assert "funcol sync (intra_node): 1100.0 us per DTensor redistribution" in text


def test_without_a_measurement_the_presets_have_none() -> None:
    prof = profile_from([{**_record(), "ok": False}])
    assert prof["provenance"]["terms"]["funcol_sync"] == {"source": "preset",
                                                         "from": "cpu-1thread"}
    assert prof["gpu"]["funcol_sync_us"] == {}
    assert "funcol_sync" not in prof["uncertainty"]
    assert load_system("cpu-1thread").gpu.funcol_sync_us == {}
    assert "funcol_sync" in UNCERTAINTY_TERMS


@pytest.mark.parametrize(("value", "fix"), [({"nvlink": 10.0}, "unknown link class 'nvlink'"),
                                            ({"intra_node": -1.0}, "greater than or equal to 0")])
def test_a_bad_figure_is_refused_by_name(value: dict[str, float], fix: str) -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"]["funcol_sync_us"] = value
    with pytest.raises(UserError, match=fix) as err:
        validate_profile(data, "p.yaml")
    assert "funcol_sync_us" in str(err.value)


def test_a_profile_without_the_field_loads_with_none() -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    del data["gpu"]["funcol_sync_us"]
    assert validate_profile(data, "p.yaml").gpu.funcol_sync_us == {}


def test_the_uncertainty_draw_scales_the_figure() -> None:
    hw = load_system("dgx-h100")
    hw = hw.model_copy(update={"gpu": hw.gpu.model_copy(
        update={"funcol_sync_us": {"intra_node": 100.0}})})
    out = perturbed(hw, {"funcol_sync": 1.5})
    assert out.gpu.funcol_sync_us == {"intra_node": pytest.approx(150.0)}
    assert out.gpu.collective_sync_us == hw.gpu.collective_sync_us
    assert isinstance(out, HardwareProfile)


# ---------------------------------------------------------------- the microbenchmark


def _worker(rank: int, init: str, out: str) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    fs.cs.SIZES["cpu"] = (1024, 8192)
    fs.cs.BURST_S = 1e-4
    fs.ITERATIONS, fs.ROUNDS = 2, 2
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        rec = fs.rounds("cpu", dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rec))
    # About one spawned child in ten that used a DeviceMesh aborted ("terminate called
    # without an active exception", SIGABRT) after this function had returned, in the
    # interpreter's teardown with no Python frame left (torch 2.13, gloo; cf.
    # pytorch/pytorch#190489). Everything is written: leave without the teardown.
    os._exit(0)


@pytest.mark.slow
def test_the_microbenchmark_runs_on_two_cpu_processes(tmp_path: Path) -> None:
    """Two gloo processes, the plain all-reduce and DTensor's redistribution after the
    same burst: every loop timed on both ranks and the record what the fit reads (the
    tiny calibration in ``test_calibration.py`` runs it in the fast suite, in the
    torchrun launch)."""
    pytest.importorskip("torch")
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "rec.json"
    mp.spawn(_worker, args=(f"file://{tmp_path / 'store'}", str(out)), nprocs=2)
    rec = json.loads(out.read_text())
    assert rec["sizes"] == [1024, 8192] and len(rec["rounds"]) == 2
    for rnd in rec["rounds"]:
        assert [row["bytes"] for row in rnd] == [1024, 8192]
        for row in rnd:
            assert all(len(row[k]) == 2 and min(row[k]) > 0 for k in ("plain_s", "dtensor_s"))
    assert set(fs.excess_by_size(rec)) == {1024, 8192}
    assert fs.sync_seconds(rec) >= 0.0
