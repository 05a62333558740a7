"""The send sync cost: what a point-to-point send after compute costs beyond its
back-to-back time (``gpu.send_sync_us``).

- the fit, from synthetic ping-pong timings whose excess is known: per send
  (with − 2·alone − 2·b2b) / 2, the ranks' mean, median over rounds, then over sizes;
  its spread;
- the cost model charges it exactly once per send: one engine send, a two-stage
  pipeline whose sends all lie on the critical path, and the analytic estimate,
  which grows by its own count of exposed transfers × the cost;
- the profile: round trip, provenance when measured and when absent, the
  calibration's summary, a bad value refused by name, the uncertainty draw;
- the microbenchmark itself, two gloo processes on the CPU (slow).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from cpu_profile import profile_from

from calibration.microbench.profile_build import write_profile
from calibration.microbench.report_tables import summary_text
from calibration.microbench.terms import send_sync as ss
from calibration.microbench.terms.send_sync import uncertainty as send_sync_spread
from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.uncertainty import perturbed, step_time_of, with_hardware
from simulator.builder.workload import build_workload
from simulator.engine.engine import Engine
from simulator.errors import UserError
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.system.hardware import HardwareProfile
from simulator.system.profiles import load_system, validate_profile
from simulator.system.units import UNCERTAINTY_TERMS

# µs per send beyond back to back, per round (rank 0, rank 1), by message size
EXCESS_US = {
    4096: [(100, 120), (90, 110), (130, 150), (80, 60), (105, 95)],
    262144: [(200, 220), (180, 160), (190, 210), (190, 250), (100, 120)],
    1048576: [(300, 280), (320, 340), (290, 310), (305, 295), (330, 350)],
}
# the ranks' mean, median over rounds: 100, 200, 300; median over sizes: 200
BY_SIZE_US = {4096: 100.0, 262144: 200.0, 1048576: 300.0}
SYNC_US = 200.0
ROUND_FIGURES_US = [210.0, 170.0, 200.0, 220.0, 110.0]  # each round's median over sizes


def _record(excess_us: dict[int, list[tuple[float, float]]] | None = None) -> dict[str, Any]:
    """A record as the microbenchmark writes it: bursts of 1.0 / 1.1 ms (the ranks
    differ), back to back 0.2 ms + S / 2 GB/s, and each iteration two bursts, two
    sends and twice the excess per send."""
    excess_us = excess_us or EXCESS_US
    rounds = []
    for r in range(len(next(iter(excess_us.values())))):
        rows = []
        for size, per_round in excess_us.items():
            alone = [1.0e-3, 1.1e-3]
            b2b = [2e-4 + size / 2e9] * 2
            rows.append({"bytes": size, "alone_s": alone, "b2b_s": b2b,
                         "with_s": [2 * a + 2 * c + 2 * e * 1e-6 for a, c, e in
                                    zip(alone, b2b, per_round[r], strict=True)]})
        rounds.append(rows)
    return {"key": ss.sync_key("cpu", 1), "kind": "send_sync", "ok": True,
            "device": "cpu", "threads": 1, "link": "intra_node", "op": "send_recv",
            "nranks": 2, "burst_s": 1e-3, "gemms": 2, "iterations": 16,
            "sizes": list(excess_us), "rounds": rounds}


# ---------------------------------------------------------------- the fit


def test_the_figure_is_half_the_ping_pongs_excess_over_two_bursts_and_two_sends() -> None:
    rec = _record()
    assert {s: t * 1e6 for s, t in ss.excess_by_size(rec).items()} == pytest.approx(BY_SIZE_US)
    assert ss.sync_seconds(rec) * 1e6 == pytest.approx(SYNC_US)
    assert [t * 1e6 for t in ss.round_figures(rec)] == pytest.approx(ROUND_FIGURES_US)
    assert send_sync_spread(rec) == pytest.approx(
        statistics.stdev(ROUND_FIGURES_US) / SYNC_US / len(ROUND_FIGURES_US) ** 0.5, abs=1e-4)


def test_one_row_in_closed_form() -> None:
    row = {"bytes": 4096, "alone_s": [1e-3, 2e-3], "b2b_s": [1e-4, 3e-4],
           "with_s": [7e-3, 6e-3]}
    # rank 0: (7 − 2 − 0.2) / 2 = 2.4 ms; rank 1: (6 − 4 − 0.6) / 2 = 0.7 ms
    assert ss.round_excess(row) == pytest.approx((2.4e-3 + 0.7e-3) / 2)


def test_a_negative_excess_gives_no_cost_and_no_spread() -> None:
    rec = _record({4096: [(-20, -30), (-10, -40), (-25, -5)]})
    assert ss.sync_seconds(rec) == 0.0
    assert send_sync_spread(rec) is None


def test_the_excess_is_over_the_quiet_back_to_back_send_not_each_rounds_own() -> None:
    # a ping-pong of two 1 ms bursts and two sends costing 2 x 1.5 ms after compute;
    # the ring shift back to back swings between 1 and 2 ms by round: the charged
    # send is the quiet 1 ms (as the collective benchmark keeps), 0.5 ms per send more
    rounds = [[{"bytes": 4096, "alone_s": [1e-3, 1e-3], "b2b_s": [c * 1e-3] * 2,
                "with_s": [5e-3, 5e-3]}] for c in (2.0, 1.0, 2.1, 1.0, 1.9)]
    rec = {**_record(), "sizes": [4096], "rounds": rounds}
    assert ss.sync_seconds(rec) * 1e3 == pytest.approx(0.5)


# ---------------------------------------------------------------- the cost model


def _with_sync(hw: HardwareProfile, **us: float) -> HardwareProfile:
    return hw.model_copy(update={"gpu": hw.gpu.model_copy(update={"send_sync_us": us})})


def _pipeline(sync_us: float, m: int = 1, nodes: int = 1) -> Scenario:
    """Two stages, one GPU each (on one node, or one per node)."""
    s = scenario_from_dict({
        "name": "send-sync", "model": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024,
                                       "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": nodes, "gpus_per_node": 2 // nodes},
        "parallel": {"tp": 1, "pp": 2, "dp": 1, "schedule": "gpipe"},
        "training": {"global_batch": m, "micro_batch": 1}})
    link = "intra_node" if nodes == 1 else "inter_node"
    return with_hardware(s, _with_sync(s.hardware, **{link: sync_us}))


@pytest.mark.parametrize("nodes", [1, 2])
def test_one_engine_send_pays_the_sync_of_its_link_class_once(nodes: int) -> None:
    base, synced = _pipeline(0.0, nodes=nodes), _pipeline(40.0, nodes=nodes)
    ends = []
    for s in (base, synced):
        engine = Engine(build_workload(s), s.hardware)
        done = engine.send(0, 1, 1e6)
        engine.env.run(done)
        ends.append(engine.env.now)
    assert ends[1] - ends[0] == pytest.approx(40e-6, rel=1e-9)


def test_the_other_link_class_sync_is_not_charged() -> None:
    s = _pipeline(0.0)
    other = with_hardware(s, _with_sync(s.hardware, inter_node=500.0))
    for method in ("engine", "analytic"):
        assert step_time_of(other, method, None) == step_time_of(s, method, None)


@pytest.mark.parametrize("m", [1, 4])
def test_a_pipeline_step_grows_by_its_sends_times_the_sync_in_engine_and_analytic(m: int) -> None:
    """GPipe over two stages with blocking sends (on the compute stream): stage 0
    alternates forward and send, then stage 1 alternates backward and send, so all 2m
    sends lie on the engine's critical path. The analytic estimate charges the sync on
    each transfer it counts as exposed: 2(p − 1)·v on fill and drain plus, sends being
    blocking, v·m in the steady state (its approximation of the exchanges, which the
    sync leaves as it was)."""
    sync_us = 300.0
    base, synced = _pipeline(0.0, m=m), _pipeline(sync_us, m=m)
    wl = build_workload(base)
    sends = [t for p in wl.programs.values() for ts in p.streams.values() for t in ts
             if t.dst >= 0]
    assert len(sends) == 2 * m and {t.stream for t in sends} == {"compute"}
    grown = step_time_of(synced, "engine", None) - step_time_of(base, "engine", None)
    assert grown == pytest.approx(len(sends) * sync_us * 1e-6, rel=1e-9)
    exposed = 2 * (2 - 1) + m
    grown = step_time_of(synced, "analytic", None) - step_time_of(base, "analytic", None)
    assert grown == pytest.approx(exposed * sync_us * 1e-6, rel=1e-9)
    moved = (analytic_estimate(synced)["step_breakdown_s"]["pp_transfer"]
             - analytic_estimate(base)["step_breakdown_s"]["pp_transfer"])
    assert moved == pytest.approx(grown, rel=1e-9)


# ---------------------------------------------------------------- the profile


def test_measured_sync_round_trips_with_its_provenance_and_spread(tmp_path: Path) -> None:
    written = write_profile(profile_from([_record()]), tmp_path / "p.yaml")
    assert load_system(str(tmp_path / "p.yaml")) == written
    assert written.gpu.send_sync_s("intra_node") == pytest.approx(SYNC_US * 1e-6)
    assert written.gpu.send_sync_s("inter_node") == 0.0
    assert written.gpu.collective_sync_us == {}  # the two terms are apart
    term = written.provenance["terms"]["send_sync"]
    assert term["source"] == "measured" and term["samples"] == 5
    assert {int(s): us for s, us in term["by_size_us"].items()} == BY_SIZE_US
    assert written.uncertainty["send_sync"] == pytest.approx(send_sync_spread(_record()),
                                                             abs=1e-4)
    assert written.provenance["fit"]["send_sync"]["sizes"] == list(BY_SIZE_US)


def test_the_calibration_summary_says_it() -> None:
    text = summary_text(profile_from([_record()]), [], 1.0)
    assert "send sync (intra_node): 200.0 us per point-to-point send" in text


def test_without_a_measurement_the_sync_is_the_presets_none() -> None:
    prof = profile_from([{**_record(), "ok": False}])
    assert prof["provenance"]["terms"]["send_sync"] == {"source": "preset",
                                                       "from": "cpu-1thread"}
    assert prof["gpu"]["send_sync_us"] == {}
    assert "send_sync" not in prof["uncertainty"]
    assert load_system("cpu-1thread").gpu.send_sync_s("intra_node") == 0.0
    assert "send_sync" in UNCERTAINTY_TERMS


@pytest.mark.parametrize(("value", "fix"), [({"nvlink": 10.0}, "unknown link class 'nvlink'"),
                                            ({"intra_node": -1.0}, "greater than or equal to 0")])
def test_a_bad_sync_is_refused_by_name(value: dict[str, float], fix: str) -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"]["send_sync_us"] = value
    with pytest.raises(UserError, match=fix) as err:
        validate_profile(data, "p.yaml")
    assert "send_sync_us" in str(err.value)


def test_a_profile_without_the_field_loads_with_none() -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    del data["gpu"]["send_sync_us"]
    assert validate_profile(data, "p.yaml").gpu.send_sync_us == {}


def test_the_uncertainty_draw_scales_the_sync() -> None:
    hw = _with_sync(load_system("dgx-h100"), intra_node=100.0)
    out = perturbed(hw, {"send_sync": 1.5})
    assert out.gpu.send_sync_us == {"intra_node": pytest.approx(150.0)}
    assert out.gpu.collective_sync_us == hw.gpu.collective_sync_us


# ---------------------------------------------------------------- the microbenchmark


def _worker(rank: int, init: str, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ss.cs.SIZES["cpu"] = (1024, 8192)
    ss.cs.BURST_S = 1e-4
    ss.ITERATIONS, ss.ROUNDS = 2, 2
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        rec = ss.rounds("cpu", dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rec))


@pytest.mark.slow
def test_the_microbenchmark_runs_on_two_cpu_processes(tmp_path: Path) -> None:
    """Two gloo processes ping-pong: every loop is timed on both ranks and the record is
    what the fit reads (about 5-10 s for starting torch twice: slow; the tiny calibration
    in ``test_calibration.py`` runs it in the fast suite, in the torchrun launch)."""
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
            assert all(len(row[k]) == 2 and min(row[k]) > 0 for k in ("alone_s", "with_s",
                                                                       "b2b_s"))
            # no timing comparison between loops: a 2-vCPU machine's noise is larger than
            # one burst (a run read alone 1.8 ms against with 1.2 ms)
    assert set(ss.excess_by_size(rec)) == {1024, 8192}
    assert ss.sync_seconds(rec) >= 0.0
