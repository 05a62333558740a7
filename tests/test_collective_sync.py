"""The collective sync cost: what a collective after compute costs beyond its back-to-back
α-β time (``gpu.collective_sync_us``).

- the fit, from synthetic timings whose excess is known: the slowest rank's
  with − alone − back to back, median over rounds, then over sizes; its spread;
- the cost model charges it exactly once per collective: a plan's estimate, its
  step-by-step form, and a TP-only step in the engine and the analytic estimate,
  which grow by (collectives on the critical path, counted from the workload) × the
  cost;
- the profile: round trip, provenance when measured and when absent, the
  uncertainty draw;
- a smoke of the microbenchmark itself in one process (the two-rank run is part of
  the tiny calibration in ``test_calibration.py``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from cpu_profile import profile_from

from calibration.microbench.profile_build import write_profile
from calibration.microbench.report_tables import summary_text
from calibration.microbench.terms import collective_sync as cs
from calibration.microbench.terms.collective_sync import uncertainty as collective_sync_spread
from simulator.analysis.uncertainty import perturbed, step_time_of, with_hardware
from simulator.builder.workload import build_workload
from simulator.errors import UserError
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.system.collectives.choice import make_plan
from simulator.system.collectives.cost import estimate, expand, phase_latencies
from simulator.system.collectives.plan import GroupShape
from simulator.system.curves import BurstCurve, SyncCurve
from simulator.system.hardware import HardwareProfile
from simulator.system.profiles import load_system, validate_profile

# µs per round (rank 0, rank 1) beyond back to back, by message size
EXCESS_US = {
    4096: [(300, 250), (320, 280), (310, 260), (290, 350), (305, 200)],
    262144: [(400, 380), (390, 420), (410, 300), (405, 395), (380, 100)],
    1048576: [(500, 450), (520, 600), (480, 470), (510, 505), (490, 495)],
}
# the slowest rank's, median over rounds: 310, 405, 500; median over sizes: 405
BY_SIZE_US = {4096: 310.0, 262144: 405.0, 1048576: 500.0}
SYNC_US = 405.0
ROUND_FIGURES_US = [400.0, 420.0, 410.0, 405.0, 380.0]  # each round's median over sizes


def _record(excess_us: dict[int, list[tuple[float, float]]] | None = None) -> dict[str, Any]:
    """A record as the microbenchmark writes it: bursts of 1.0 / 1.1 ms (the ranks
    differ), back to back 0.2 ms + S / 2 GB/s, and the excess on top."""
    excess_us = excess_us or EXCESS_US
    rounds = []
    for r in range(len(next(iter(excess_us.values())))):
        rows = []
        for size, per_round in excess_us.items():
            alone = [1.0e-3, 1.1e-3]
            b2b = [2e-4 + size / 2e9] * 2
            rows.append({"bytes": size, "alone_s": alone, "b2b_s": b2b,
                         "with_s": [a + c + e * 1e-6 for a, c, e in
                                    zip(alone, b2b, per_round[r], strict=True)]})
        rounds.append(rows)
    return {"key": cs.sync_key("cpu", 1), "kind": "collective_sync", "ok": True,
            "device": "cpu", "threads": 1, "link": "intra_node", "op": "all_reduce",
            "nranks": 2, "burst_s": 1e-3, "gemms": 2, "iterations": 16,
            "sizes": list(excess_us), "rounds": rounds}


# ---------------------------------------------------------------- the fit


def test_the_figure_is_the_median_over_sizes_of_the_slowest_ranks_median_excess() -> None:
    rec = _record()
    assert {s: t * 1e6 for s, t in cs.excess_by_size(rec).items()} == pytest.approx(BY_SIZE_US)
    assert cs.sync_seconds(rec) * 1e6 == pytest.approx(SYNC_US)
    assert [t * 1e6 for t in cs.round_figures(rec)] == pytest.approx(ROUND_FIGURES_US)
    assert collective_sync_spread(rec) == pytest.approx(
        statistics.stdev(ROUND_FIGURES_US) / SYNC_US / len(ROUND_FIGURES_US) ** 0.5, abs=1e-4)


def test_a_negative_excess_gives_no_cost_and_no_spread() -> None:
    rec = _record({4096: [(-20, -30), (-10, -40), (-25, -5)]})
    assert cs.sync_seconds(rec) == 0.0
    assert collective_sync_spread(rec) is None


def _swinging_record(b2b_ms: list[float], after_ms: float) -> dict[str, Any]:
    """One size (1 MiB) whose back-to-back time swings from round to round while the
    all-reduce after a 1 ms burst always costs ``after_ms``, on both ranks."""
    rounds = [[{"bytes": 1 << 20, "alone_s": [1e-3, 1e-3], "b2b_s": [c * 1e-3] * 2,
                "with_s": [(1 + after_ms) * 1e-3] * 2}] for c in b2b_ms]
    return {**_record(), "sizes": [1 << 20], "rounds": rounds}


def test_the_excess_is_over_the_quiet_back_to_back_time_not_each_rounds_own() -> None:
    # gloo on a 2-core VM: b2b at 1 MiB swings between ~1 and ~3 ms by round, the
    # all-reduce after compute stays at 2.5 ms. The simulator charges the collective
    # benchmark's quiet time (the second-best round), ~1 ms, so the sync cost is
    # 2.5 - 1 = 1.5 ms; subtracting each round's own b2b read 2.5 - 3 < 0 in the slow
    # majority of rounds, the figure 0
    rec = _swinging_record([3.0, 1.0, 3.1, 1.0, 2.9], after_ms=2.5)
    assert cs.charged_b2b(rec) == {1 << 20: pytest.approx([1e-3, 1e-3])}
    assert cs.sync_seconds(rec) * 1e3 == pytest.approx(1.5)
    assert [t * 1e3 for t in cs.round_figures(rec)] == pytest.approx([1.5] * 5)
    # one round only: its own b2b is the quiet time
    assert cs.sync_seconds(_swinging_record([1.2], after_ms=2.5)) * 1e3 == pytest.approx(1.3)


# ---------------------------------------------------------------- the cost model


def _with_sync(hw: HardwareProfile, **us: float) -> HardwareProfile:
    return hw.model_copy(update={"gpu": hw.gpu.model_copy(update={"collective_sync_us": us})})


@pytest.mark.parametrize("algorithm", ["ring", "auto", "hierarchical"])
def test_a_collective_pays_the_sync_once_however_its_plan_is_split(algorithm: str) -> None:
    hw = load_system("dgx-a100-80gb")  # no NVLS: every plan has several steps to split
    synced = _with_sync(hw, intra_node=30.0, inter_node=70.0)
    one_node = make_plan("all_reduce", 64e6, GroupShape(8, 8), algorithm, hw)
    two_nodes = make_plan("all_reduce", 64e6, GroupShape(16, 8), algorithm, hw)
    for plan, sync_us in ((one_node, 30.0), (two_nodes, 70.0)):  # the slowest class's
        assert estimate(plan, synced) - estimate(plan, hw) == pytest.approx(sync_us * 1e-6)
        steps = expand(plan)
        assert len(steps.phases) > 1
        assert sum(phase_latencies(steps, synced)) - sum(phase_latencies(steps, hw)) \
            == pytest.approx(sync_us * 1e-6)


def test_a_group_of_one_pays_nothing() -> None:
    hw = load_system("dgx-h100")
    plan = make_plan("all_reduce", 1e6, GroupShape(1, 1), "ring", hw)
    assert estimate(plan, _with_sync(hw, intra_node=30.0)) == estimate(plan, hw)


def _tp_only(sync_us: float) -> Scenario:
    """TP 2 on one node, nothing overlapped (not Megatron's async backward either): every
    collective is on the compute stream."""
    s = scenario_from_dict({
        "name": "sync", "stack": {"preset": "megatron-core", "tp_overlap": "none"},
        "model": {"layers": 3, "hidden": 256, "heads": 4, "vocab": 1024,
                                  "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 2},
        "parallel": {"tp": 2, "pp": 1, "dp": 1},
        "training": {"global_batch": 3, "micro_batch": 1}})
    return with_hardware(s, _with_sync(s.hardware, intra_node=sync_us))


def test_a_tp_step_grows_by_its_collectives_times_the_sync_in_engine_and_analytic() -> None:
    """The engine and the analytic estimate pay it for every collective task of a rank
    (all on the compute stream, so all on the critical path): the layers' TP collectives
    and the vocab-parallel ends' (embedding, output layer, loss)."""
    sync_us = 250.0
    base, synced = _tp_only(0.0), _tp_only(sync_us)
    wl = build_workload(base)
    colls = [t for tasks in wl.programs[0].streams.values() for t in tasks if t.plan is not None]
    assert colls and {t.stream for t in colls} == {"compute"}
    layer_colls = [t for t in colls if t.layer >= 0]
    assert len(layer_colls) == 4 * base.model.layers * base.microbatches  # 2 fwd, 2 bwd
    assert len(colls) == len(layer_colls) + 5 * base.microbatches  # embedding, head, 3 loss
    for method in ("engine", "analytic"):
        grown = step_time_of(synced, method, None) - step_time_of(base, method, None)
        assert grown == pytest.approx(len(colls) * sync_us * 1e-6, rel=1e-9), method


# ---------------------------------------------------------------- the profile


def test_measured_sync_round_trips_with_its_provenance_and_spread(tmp_path: Path) -> None:
    written = write_profile(profile_from([_record()]), tmp_path / "p.yaml")
    assert load_system(str(tmp_path / "p.yaml")) == written
    assert written.gpu.collective_sync_s("intra_node") == pytest.approx(SYNC_US * 1e-6)
    assert written.gpu.collective_sync_s("inter_node") == 0.0
    term = written.provenance["terms"]["collective_sync"]
    assert term["source"] == "measured" and term["samples"] == 5
    assert {int(s): us for s, us in term["by_size_us"].items()} == BY_SIZE_US
    assert written.uncertainty["collective_sync"] == pytest.approx(
        collective_sync_spread(_record()), abs=1e-4)


def test_without_a_measurement_the_sync_is_the_presets_none() -> None:
    prof = profile_from([{**_record(), "ok": False}])
    assert prof["provenance"]["terms"]["collective_sync"] == {"source": "preset",
                                                             "from": "cpu-1thread"}
    assert prof["gpu"]["collective_sync_us"] == {}
    assert "collective_sync" not in prof["uncertainty"]
    assert load_system("cpu-1thread").gpu.collective_sync_s("intra_node") == 0.0


@pytest.mark.parametrize(("value", "fix"), [({"nvlink": 10.0}, "unknown link class 'nvlink'"),
                                            ({"intra_node": -1.0}, "greater than or equal to 0")])
def test_a_bad_sync_is_refused_by_name(value: dict[str, float], fix: str) -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"]["collective_sync_us"] = value
    with pytest.raises(UserError, match=fix):
        validate_profile(data, "p.yaml")


def test_the_uncertainty_draw_scales_the_sync() -> None:
    hw = _with_sync(load_system("dgx-h100"), intra_node=100.0)
    out = perturbed(hw, {"collective_sync": 1.5})
    assert out.gpu.collective_sync_us == {"intra_node": pytest.approx(150.0)}


# ---------------------------------------------------------------- the cost by size


def test_the_curve_is_each_sizes_median_excess_at_least_zero() -> None:
    curve = cs.sync_curve(_record())
    assert [b for b, _ in curve] == list(BY_SIZE_US)
    assert [t * 1e6 for _, t in curve] == pytest.approx(list(BY_SIZE_US.values()))
    negative = _record({4096: [(-20, -30)] * 3, 65536: [(100, 90)] * 3})
    assert [b for b, _ in cs.sync_curve(negative)] == [4096, 65536]
    assert [t * 1e6 for _, t in cs.sync_curve(negative)] == pytest.approx([0.0, 100.0])


def _with_curve(hw: HardwareProfile, points: list[list[float]]) -> HardwareProfile:
    gpu = hw.gpu.model_copy(update={
        "collective_sync_us": {"intra_node": 405.0},
        "collective_sync_curve": {"intra_node": SyncCurve(points=tuple(map(tuple, points)))}})
    return hw.model_copy(update={"gpu": gpu})


def test_a_collective_pays_the_curve_at_its_bytes_log_interpolated_flat_beyond() -> None:
    """Between two measured sizes the cost is linear in log(bytes); below the smallest
    and above the largest it is theirs; without a size (or a curve) it is the figure."""
    hw = _with_curve(load_system("dgx-a100-80gb"), [[4096, 310.0], [1048576, 500.0]])
    gpu = hw.gpu
    assert gpu.collective_sync_s("intra_node", 4096) == pytest.approx(310e-6)
    assert gpu.collective_sync_s("intra_node", 65536) == pytest.approx(
        (310 + 190 * 0.5) * 1e-6)  # 64 KiB: halfway in log between 4 KiB and 1 MiB
    assert gpu.collective_sync_s("intra_node", 1024) == pytest.approx(310e-6)
    assert gpu.collective_sync_s("intra_node", 64e6) == pytest.approx(500e-6)
    assert gpu.collective_sync_s("intra_node") == pytest.approx(405e-6)
    assert gpu.collective_sync_s("inter_node", 65536) == 0.0
    for size, us in ((4096, 310.0), (65536, 405.0), (64e6, 500.0)):
        plan = make_plan("all_reduce", size, GroupShape(8, 8), "ring", hw)
        base = make_plan("all_reduce", size, GroupShape(8, 8), "ring", load_system(
            "dgx-a100-80gb"))
        assert estimate(plan, hw) - estimate(base, load_system("dgx-a100-80gb")) \
            == pytest.approx(us * 1e-6)


def test_the_profile_keeps_the_curve_and_the_draw_scales_it(tmp_path: Path) -> None:
    written = write_profile(profile_from([_record()]), tmp_path / "p.yaml")
    curve = written.gpu.collective_sync_curve["intra_node"]
    assert [b for b, _ in curve.points] == list(BY_SIZE_US)
    assert [us for _, us in curve.points] == pytest.approx(list(BY_SIZE_US.values()))
    assert written.gpu.collective_sync_s("intra_node", 1 << 20) == pytest.approx(500e-6)
    out = perturbed(written, {"collective_sync": 2.0})
    assert out.gpu.collective_sync_s("intra_node", 4096) == pytest.approx(620e-6)
    one_size = write_profile(profile_from([_record({4096: EXCESS_US[4096]})]),
                             tmp_path / "q.yaml")
    assert one_size.gpu.collective_sync_curve == {}  # one size: the figure alone


@pytest.mark.parametrize(("points", "fix"), [([[4096, -1.0]], "sync costs .µs. must lie"),
                                             ([[4096, 1.0], [4096, 2.0]], "strictly increase")])
def test_a_bad_curve_is_refused(points: list[list[float]], fix: str) -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"]["collective_sync_curve"] = {"intra_node": {"points": points}}
    with pytest.raises(UserError, match=fix):
        validate_profile(data, "p.yaml")


# ---------------------------------------------------------------- the microbenchmark


def test_the_microbenchmark_runs_on_a_cpu_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """One gloo process (the two-rank run is the tiny calibration's): every loop is timed
    and the record is what the fit reads."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    monkeypatch.setitem(cs.SYNC_SIZES, "cpu", (1024, 8192))
    monkeypatch.setattr(cs, "ITERATIONS", 2)
    monkeypatch.setattr(cs, "ROUNDS", 2)
    monkeypatch.setattr(cs, "BURST_S", 1e-4)
    monkeypatch.setitem(cs.BURSTS, "cpu", (2e-2,))  # many GEMMs: longer than the base
    monkeypatch.setitem(cs.BURST_SIZES, "cpu", (8192,))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rec = cs.rounds("cpu", dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()
    assert rec["sizes"] == [1024, 8192] and len(rec["rounds"]) == 2
    for rnd in rec["rounds"]:
        assert [row["bytes"] for row in rnd] == [1024, 8192]
        for row in rnd:
            assert all(len(row[k]) == 1 and row[k][0] > 0 for k in ("alone_s", "with_s",
                                                                     "b2b_s"))
    assert set(cs.excess_by_size(rec)) == {1024, 8192}
    assert cs.sync_seconds(rec) >= 0.0
    assert [b for b, _ in cs.sync_curve(rec)] == [1024, 8192]
    assert len(rec["burst_rounds"]) == 2  # the longer burst, per round, at its one size
    for rnd in rec["burst_rounds"]:
        assert [(row["bytes"], len(row["alone_s"]), len(row["with_s"])) for row in rnd] \
            == [(8192, 1, 1)]
        assert rnd[0]["burst_s"] > rec["burst_s"]
    assert list(cs.burst_excess(rec)) == [rec["burst_rounds"][0][0]["burst_s"]]


# ---------------------------------------------------------------- the cost by burst

# µs per round (rank 0, rank 1) beyond back to back after the longer bursts, by burst
# and size; the base burst's (1 ms) by size is BY_SIZE_US: 405 at 256 KiB, 500 at 1 MiB
BURST_EXCESS_US = {
    4e-3: {262144: [(900, 100), (1000, 990), (950, 0)],  # slowest: median 950 (+545)
           1048576: [(1200, 1), (1100, 2), (1150, 3)]},  # 1150 (+650)
    16e-3: {262144: [(1500, 1500)] * 3,  # +1095
            1048576: [(1800, 1700)] * 3},  # +1300
}
# the growth, median over the two sizes: +597.5 us after 4 ms, +1197.5 us after 16 ms
BURST_CURVE_US = [(1e-3, 0.0), (4e-3, 597.5), (16e-3, 1197.5)]


def _burst_record(excess_us: dict[float, dict[int, list[tuple[float, float]]]] | None = None,
                  ) -> dict[str, Any]:
    """:func:`_record` with the longer bursts' rounds, charged the base rounds' b2b."""
    rec = _record()
    rounds: list[list[dict[str, Any]]] = [[] for _ in range(3)]
    for burst, by_size in (excess_us or BURST_EXCESS_US).items():
        for size, per_round in by_size.items():
            for r, excess in enumerate(per_round):
                alone = [burst, burst * 1.05]
                b2b = 2e-4 + size / 2e9
                rounds[r].append({"bytes": size, "burst_s": burst, "alone_s": alone,
                                  "with_s": [a + b2b + e * 1e-6 for a, e in
                                             zip(alone, excess, strict=True)]})
    return {**rec, "burst_rounds": rounds}


def test_the_burst_growth_is_the_median_over_sizes_of_the_excess_over_the_base_bursts() -> None:
    rec = _burst_record()
    assert {b: t * 1e6 for b, t in cs.burst_excess(rec).items()} == pytest.approx(
        {4e-3: 597.5, 16e-3: 1197.5})
    curve = cs.burst_curve(rec)
    assert [b for b, _ in curve] == pytest.approx([b for b, _ in BURST_CURVE_US])
    assert [t * 1e6 for _, t in curve] == pytest.approx([t for _, t in BURST_CURVE_US])
    assert "after 4 ms +598 us; after 16 ms +1198 us" in cs.summary(rec)
    # less than after the base burst: no growth, never a discount
    shrunk = _burst_record({4e-3: {262144: [(100, 100)] * 3, 1048576: [(200, 200)] * 3}})
    assert [t for _, t in cs.burst_curve(shrunk)] == [0.0, 0.0]
    assert cs.burst_curve(_record()) == [] and cs.burst_excess(_record()) == {}


def test_the_profile_keeps_the_burst_curve_and_a_record_without_has_none(
        tmp_path: Path) -> None:
    written = write_profile(profile_from([_burst_record()]), tmp_path / "p.yaml")
    assert load_system(str(tmp_path / "p.yaml")) == written
    curve = written.gpu.collective_sync_burst["intra_node"]
    assert [b for b, _ in curve.points] == pytest.approx([b for b, _ in BURST_CURVE_US])
    assert [us for _, us in curve.points] == pytest.approx([t for _, t in BURST_CURVE_US],
                                                           rel=1e-3)
    out = perturbed(written, {"collective_sync": 2.0})
    assert out.gpu.collective_sync_burst_s("intra_node", 16e-3) == pytest.approx(
        2 * 1197.5e-6, rel=1e-3)
    assert written.provenance["terms"]["collective_sync"]["growth_by_burst_us"] == {
        "4 ms": 597.5, "16 ms": 1197.5}
    plain = write_profile(profile_from([_record()]), tmp_path / "q.yaml")
    assert plain.gpu.collective_sync_burst == {}
    text = summary_text(written.model_dump(mode="json"), [], 1.0)
    assert "collective sync (intra_node) by the compute before it, us: 1 ms +0, 4 ms +597" \
        in text


def _with_burst(hw: HardwareProfile, points: list[tuple[float, float]]) -> HardwareProfile:
    gpu = hw.gpu.model_copy(update={
        "collective_sync_burst": {"intra_node": BurstCurve(points=tuple(points))}})
    return hw.model_copy(update={"gpu": gpu})


def test_the_growth_is_log_interpolated_in_the_burst_flat_beyond() -> None:
    gpu = _with_burst(load_system("dgx-a100-80gb"), BURST_CURVE_US).gpu
    assert gpu.collective_sync_burst_s("intra_node", 2e-3) == pytest.approx(
        597.5e-6 / 2)  # halfway in log between 1 and 4 ms
    assert gpu.collective_sync_burst_s("intra_node", 8e-3) == pytest.approx(
        (597.5 + 1197.5) / 2 * 1e-6)
    assert gpu.collective_sync_burst_s("intra_node", 0.2e-3) == 0.0
    assert gpu.collective_sync_burst_s("intra_node", 1.0) == pytest.approx(1197.5e-6)
    assert gpu.collective_sync_burst_s("intra_node", 0.0) == 0.0
    assert gpu.collective_sync_burst_s("inter_node", 16e-3) == 0.0


def test_the_engine_charges_the_growth_at_each_collective_that_follows_compute() -> None:
    """A flat curve of X: a TP step in the engine grows by X for every collective with
    compute before it since the rank's previous one (one after another pays none); the
    analytic estimate, with no bursts of its own, does not grow."""
    x_us = 700.0
    base = _tp_only(0.0)
    # 0 after no compute (the curve's first point, flat below it), X after any
    burst = with_hardware(base, _with_burst(base.hardware, [(1e-12, 0.0), (1e-9, x_us)]))
    wl = build_workload(base)
    after_compute, colls, since = 0, 0, False
    for t in wl.programs[0].streams["compute"]:
        if t.plan is None and t.dst < 0:
            since = since or t.duration > 0
        elif t.plan is not None:
            colls += 1
            after_compute += since
            since = False
    assert 0 < after_compute < colls  # 45 of 51: some follow another collective
    grown = step_time_of(burst, "engine", None) - step_time_of(base, "engine", None)
    assert grown == pytest.approx(after_compute * x_us * 1e-6, rel=1e-9)
    assert step_time_of(burst, "analytic", None) == step_time_of(base, "analytic", None)


@pytest.mark.parametrize(("points", "fix"), [([[1e-3, -2e6]], "sync costs .µs. must lie"),
                                             ([[4e-3, 1.0], [1e-3, 2.0]], "strictly increase")])
def test_a_bad_burst_curve_is_refused(points: list[list[float]], fix: str) -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"]["collective_sync_burst"] = {"intra_node": {"points": points}}
    with pytest.raises(UserError, match=fix):
        validate_profile(data, "p.yaml")


def test_shorter_bursts_enter_the_curve_as_a_discount_never_a_surcharge() -> None:
    """Bursts shorter than the base one (0.1 and 0.3 ms) come before it in the curve with
    their change from the base, at most 0; the rank spread's wait over the shorter
    burst, c · e_2 · (B − B₀) < 0, comes off as it does for longer ones."""
    from simulator.system.costs import expected_max_normal

    rec = _burst_record({1e-4: {262144: [(100, 100)] * 3, 1048576: [(200, 200)] * 3},
                         3e-4: {262144: [(450, 400)] * 3, 1048576: [(900, 900)] * 3},
                         **BURST_EXCESS_US})
    # base by size 405 / 500 us: 0.1 ms -305 / -300 (median -302.5); 0.3 ms +45 / +400
    assert {b: t * 1e6 for b, t in cs.burst_excess(rec).items()} == pytest.approx(
        {1e-4: -302.5, 3e-4: 222.5, 4e-3: 597.5, 16e-3: 1197.5})
    curve = cs.burst_curve(rec)
    assert [b for b, _ in curve] == pytest.approx([1e-4, 3e-4, 1e-3, 4e-3, 16e-3])
    assert [t * 1e6 for _, t in curve] == pytest.approx([-302.5, 0.0, 0.0, 597.5, 1197.5])
    c, e2 = 0.05, expected_max_normal(2)
    assert cs.burst_curve(rec, c)[0][1] == pytest.approx(-302.5e-6 + c * e2 * 0.9e-3)
    assert "after 0.1 ms -302 us; after 0.3 ms +223 us" in cs.summary(rec)


def test_the_engine_takes_a_short_bursts_discount_off_the_sync_never_below_none() -> None:
    """A TP step whose collectives all follow less compute than the calibration's burst:
    with a curve of −D below it, each pays sync − D; with D beyond the sync cost, none of
    it (never less than back to back); the analytic estimate keeps the full sync."""
    sync_us, d_us = 250.0, 100.0
    base, synced = _tp_only(0.0), _tp_only(sync_us)
    colls = sum(t.plan is not None for t in build_workload(base).programs[0].streams["compute"])
    for cut, paid in ((d_us, sync_us - d_us), (10 * sync_us, 0.0)):
        short = with_hardware(synced, _with_burst(synced.hardware, [(10.0, -cut), (20.0, 0.0)]))
        grown = step_time_of(short, "engine", None) - step_time_of(base, "engine", None)
        assert grown == pytest.approx(colls * paid * 1e-6, rel=1e-9, abs=1e-12), cut
        assert step_time_of(short, "analytic", None) == step_time_of(synced, "analytic", None)


def test_the_growth_leaves_out_the_wait_the_rank_spread_already_charges() -> None:
    """The burst's ``with`` holds the wait for the slower rank, which the rank spread c
    charges as compute (1 + c · e_2 per op): c · e_2 · (B − 1 ms) comes off the growth,
    never below 0."""
    from calibration.microbench.terms.collective_sync import burst_by_link as collective_sync_burst
    from simulator.system.costs import expected_max_normal

    c, e2 = 0.05, expected_max_normal(2)
    curve = cs.burst_curve(_burst_record(), c)
    want = [(b, max(us * 1e-6 - c * e2 * (b - 1e-3), 0.0)) for b, us in BURST_CURVE_US]
    assert [b for b, _ in curve] == pytest.approx([b for b, _ in want])
    assert [t for _, t in curve] == pytest.approx([t for _, t in want])
    assert curve[1][1] == pytest.approx(597.5e-6 - c * e2 * 3e-3)  # 4 ms: 597.5 − 84.6 µs
    assert [t for _, t in cs.burst_curve(_burst_record(), 1.0)] == [0.0, 0.0, 0.0]
    assert collective_sync_burst([_burst_record()], c) == {"intra_node": curve}


def test_the_curve_never_falls_with_more_compute() -> None:
    """Each side of the base burst is the non-decreasing least-squares fit to its
    figures: a shorter burst read as dearer than a longer one pools with it (their
    mean), then the bounds (a discount at most 0, a growth at least 0)."""
    assert cs.monotone([0.0, -632.0]) == pytest.approx([-316.0, -316.0])
    assert cs.monotone([1.0, 3.0, 2.0, 5.0]) == pytest.approx([1.0, 2.5, 2.5, 5.0])
    assert cs.monotone([]) == []
    rec = _burst_record({1e-4: {262144: [(405, 405)] * 3, 1048576: [(500, 500)] * 3},  # 0
                         3e-4: {262144: [(0, 0)] * 3, 1048576: [(0, 0)] * 3},  # -452.5
                         4e-3: {262144: [(1405, 1405)] * 3, 1048576: [(1500, 1500)] * 3},
                         16e-3: {262144: [(905, 905)] * 3, 1048576: [(1000, 1000)] * 3}})
    curve = cs.burst_curve(rec)
    assert [b for b, _ in curve] == pytest.approx([1e-4, 3e-4, 1e-3, 4e-3, 16e-3])
    assert [t * 1e6 for _, t in curve] == pytest.approx([-226.25, -226.25, 0.0, 750.0, 750.0])
