"""The rank spread: the slowest of n ranks takes ``1 + c · e_n`` times as long
(``gpu.rank_spread``).

- e_n, the expected maximum of n standard normals, against its closed forms;
- the figure, from synthetic burst times whose excess is known;
- the cost model stretches every op of an n-rank step by the factor and nothing of a
  rank alone; a workload's compute tasks grow by exactly that, its collectives not;
- the profile: round trip with provenance and spread, a preset without it, a bad
  value refused by name, the uncertainty draw;
- a GPU population's measured excess of the slowest of n (``gpu.rank_excess``, the A100
  presets): it replaces c · e_n, read in log n and flat beyond its counts; the presets'
  curve against the jobs it was read from; a calibration's own spread drops it.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from cpu_profile import profile_from
from hypothesis import given
from hypothesis import strategies as st

from calibration.microbench.profile_build import write_profile
from calibration.microbench.terms import rank_spread as rs
from calibration.microbench.terms.rank_spread import uncertainty as rank_spread_spread
from simulator.analysis.uncertainty import perturbed, with_hardware
from simulator.builder.workload import build_workload
from simulator.errors import UserError
from simulator.model.inventory.ops import gemm, mem
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.system.costs import CostModel, expected_max_normal
from simulator.system.curves import SpreadCurve
from simulator.system.hardware import HardwareProfile
from simulator.system.profiles import load_system, validate_profile


def test_the_expected_maximum_of_normals_has_its_closed_forms() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-9)
    # n = 4 and 5 (Teichroew's tables): 1.0293754, 1.1629645
    assert expected_max_normal(4) == pytest.approx(1.0293754, abs=1e-6)
    assert expected_max_normal(5) == pytest.approx(1.1629645, abs=1e-6)
    many = [expected_max_normal(n) for n in (8, 64, 1024, 16384, 10**7)]
    assert many == sorted(many) and all(math.isfinite(e) for e in many)
    # Blom's approximation Φ⁻¹((n − 0.375) / (n + 0.25)), within 1% for large n
    for n, e in zip((1024, 16384, 10**7), many[2:], strict=True):
        assert e == pytest.approx(statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25)),
                                  rel=0.01)


# ---------------------------------------------------------------- the figure


def _record(pairs_ms: list[list[tuple[float, float]]]) -> dict[str, Any]:
    """A record as the microbenchmark writes it: per round, per rank, burst seconds."""
    rounds = [[[a * 1e-3 for a, _ in rnd], [b * 1e-3 for _, b in rnd]] for rnd in pairs_ms]
    return {"key": rs.spread_key("cpu", 1), "kind": "rank_spread", "ok": True, "device": "cpu",
            "threads": 1, "nranks": 2, "op": "compute", "link": "intra_node",
            "burst_s": 16e-3, "gemms": 8, "iterations": len(pairs_ms[0]), "rounds": rounds}


# two rounds: one where the ranks differ by 2 ms in 16-18 ms (the slower 1/17 and
# 1/16 over the mean), one quiet spell... and one round where rank 1 runs 10% behind
ROUNDS_MS = [[(16.0, 18.0), (17.0, 15.0)], [(16.0, 16.0), (16.0, 16.0)],
             [(20.0, 22.0), (20.0, 22.0)]]
ROUND_EXCESSES = [statistics.fmean([1 / 17, 1 / 16]), 0.0, 1 / 21]


def test_the_figure_is_the_slower_ranks_mean_excess_over_e2() -> None:
    rec = _record(ROUNDS_MS)
    assert rs.round_excesses(rec) == pytest.approx(ROUND_EXCESSES)
    assert rs.excess(rec) == pytest.approx(statistics.fmean(ROUND_EXCESSES))  # the mean
    assert rs.spread(rec) == pytest.approx(statistics.fmean(ROUND_EXCESSES) * math.sqrt(math.pi))
    assert rank_spread_spread(rec) == pytest.approx(
        statistics.stdev(ROUND_EXCESSES) / statistics.fmean(ROUND_EXCESSES) / math.sqrt(3),
        abs=1e-4)


def test_ranks_in_step_give_no_spread() -> None:
    rec = _record([[(16.0, 16.0)] * 3] * 4)
    assert rs.spread(rec) == 0.0
    assert rank_spread_spread(rec) is None


# ---------------------------------------------------------------- the cost model


def _with_spread(hw: HardwareProfile, c: float) -> HardwareProfile:
    """``hw`` with spread c and no population curve (the A100 presets carry one, which
    would take precedence over c)."""
    return hw.model_copy(update={"gpu": hw.gpu.model_copy(update={"rank_spread": c,
                                                                  "rank_excess": None})})


def _scenario(c: float, tp: int = 2, dp: int = 2) -> Scenario:
    s = scenario_from_dict({
        "name": "spread", "model": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024,
                                    "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": tp * dp},
        "parallel": {"tp": tp, "pp": 1, "dp": dp},
        "training": {"global_batch": 2 * dp, "micro_batch": 1}})
    return with_hardware(s, _with_spread(s.hardware, c))


def test_the_cost_model_stretches_an_n_rank_steps_ops_by_one_plus_c_en() -> None:
    s = _scenario(0.0)
    ops = [gemm("qkv", 2048, 4096, 12288, 2, "gemm_fwd"), mem("act", 1e7, 2, "elementwise")]
    hw = _with_spread(s.hardware, 0.1)
    alone = CostModel(s.hardware, "bf16", host_us=s.stack.host_us, ranks=4)
    for ranks, factor in ((1, 1.0), (2, 1 + 0.1 / math.sqrt(math.pi)),
                          (4, 1 + 0.1 * expected_max_normal(4))):
        spread = CostModel(hw, "bf16", host_us=s.stack.host_us, ranks=ranks)
        assert spread.rank_stretch == pytest.approx(factor)
        for op in ops:
            assert spread.op_time(op) == pytest.approx(alone.op_time(op) * factor, rel=1e-12)
        assert spread.memory_time(1e9) == pytest.approx(alone.memory_time(1e9) * factor)


def _durations(s: Scenario) -> tuple[float, float]:
    """Rank 0's compute-task and collective-task seconds."""
    prog = build_workload(s).programs[0]
    tasks = [t for ts in prog.streams.values() for t in ts]
    work = sum(t.duration for t in tasks if t.plan is None and t.dst < 0)
    comm = sum(t.duration for t in tasks if t.plan is not None)
    return work, comm


def test_a_workloads_compute_grows_by_the_factor_of_its_world_its_collectives_not() -> None:
    c = 0.08
    base, spread = _durations(_scenario(0.0)), _durations(_scenario(c))
    assert spread[0] == pytest.approx(base[0] * (1 + c * expected_max_normal(4)), rel=1e-9)
    assert spread[1] == pytest.approx(base[1], rel=1e-12)
    one = _scenario(c, tp=1, dp=1)  # a rank alone waits for nobody
    assert _durations(one)[0] == pytest.approx(_durations(_scenario(0.0, 1, 1))[0], rel=1e-12)


# ---------------------------------------------------------------- the profile


def test_a_measured_spread_round_trips_with_its_provenance_and_spread(tmp_path: Path) -> None:
    rec = _record(ROUNDS_MS)
    written = write_profile(profile_from([rec]), tmp_path / "p.yaml")
    assert load_system(str(tmp_path / "p.yaml")) == written
    assert written.gpu.rank_spread == pytest.approx(rs.spread(rec), rel=1e-3)
    term = written.provenance["terms"]["rank_spread"]
    assert term["source"] == "measured" and term["samples"] == 3
    assert written.uncertainty["rank_spread"] == pytest.approx(rank_spread_spread(rec), abs=1e-4)


def test_without_a_measurement_the_spread_is_the_presets_none() -> None:
    prof = profile_from([{**_record(ROUNDS_MS), "ok": False}])
    assert prof["provenance"]["terms"]["rank_spread"] == {"source": "preset",
                                                         "from": "cpu-1thread"}
    assert prof["gpu"].get("rank_spread", 0.0) == 0.0 and "rank_spread" not in prof["uncertainty"]
    assert load_system("dgx-h100").gpu.rank_spread == 0.0


@pytest.mark.parametrize(("value", "fix"), [(-0.1, "greater than or equal to 0"),
                                            (1.5, "less than or equal to 1")])
def test_a_bad_spread_is_refused_by_name(value: float, fix: str) -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"]["rank_spread"] = value
    with pytest.raises(UserError, match=f"rank_spread.*{fix}"):
        validate_profile(data, "p.yaml")


def test_the_uncertainty_draw_scales_the_spread() -> None:
    hw = _with_spread(load_system("dgx-h100"), 0.05)
    assert perturbed(hw, {"rank_spread": 1.5}).gpu.rank_spread == pytest.approx(0.075)
    assert perturbed(hw, {"rank_spread": 100.0}).gpu.rank_spread == 1.0


# ---------------------------------------------------------------- a population's curve

#: the 64- and 256-GPU Perlmutter jobs' own slowest GPU over their mean (mean over 51 and
#: 98 jobs of the sample the A100 presets' curve was read from), and the sample's spread
PERLMUTTER_JOBS = {64: 0.0283, 256: 0.0484}
PERLMUTTER_SPREAD = 0.0106


def _with_curve(hw: HardwareProfile, points: list[tuple[float, float]]) -> HardwareProfile:
    curve = SpreadCurve(points=tuple(points))
    return hw.model_copy(update={"gpu": hw.gpu.model_copy(update={"rank_excess": curve})})


def test_a_population_curve_replaces_c_en_read_in_log_n_and_flat_beyond() -> None:
    hw = _with_spread(load_system("dgx-h100"), 0.5)  # a spread the curve must override
    hw = _with_curve(hw, [(2, 0.01), (8, 0.02), (128, 0.04)])
    for ranks, want in ((1, 0.0), (2, 0.01), (4, 0.015), (8, 0.02), (32, 0.03),
                        (128, 0.04), (4096, 0.04)):
        assert CostModel(hw, "bf16", ranks=ranks).rank_stretch == pytest.approx(1 + want)
    op = gemm("qkv", 2048, 4096, 12288, 2, "gemm_fwd")
    alone = CostModel(hw, "bf16", ranks=1).op_time(op)
    assert CostModel(hw, "bf16", ranks=32).op_time(op) == pytest.approx(alone * 1.03)


@pytest.mark.parametrize("bad", [[(2, -0.01)], [(2, 1.5)], [(8, 0.01), (2, 0.02)]])
def test_a_bad_curve_is_refused_by_name(bad: list[tuple[float, float]]) -> None:
    data = load_system("dgx-h100").model_dump(mode="json")
    data["gpu"]["rank_excess"] = {"points": [list(p) for p in bad]}
    with pytest.raises(UserError, match="rank_excess"):
        validate_profile(data, "p.yaml")


def test_the_a100_presets_carry_perlmutters_heavier_than_normal_tail() -> None:
    """The curve (each GPU's time over its job's mean, E[max of n] by order statistics)
    agrees with the jobs it was read from, sits above a normal of the sample's own spread
    from 64 GPUs on (the slow tail is heavier), rises with n, and is the same on both
    A100 presets; the H100 has none (no per-GPU distribution published)."""
    a40, a80 = load_system("dgx-a100-40gb").gpu, load_system("dgx-a100-80gb").gpu
    assert a40.rank_excess is not None and a40.rank_excess == a80.rank_excess
    for n, jobs in PERLMUTTER_JOBS.items():
        assert a40.rank_excess(n) == pytest.approx(jobs, abs=0.004)
        assert a40.rank_excess(n) > PERLMUTTER_SPREAD * expected_max_normal(n)
    counts = [2 ** k for k in range(1, 15)]
    values = [a40.rank_excess(n) for n in counts]
    assert values == sorted(values) and values[-1] == values[counts.index(1024)]
    assert load_system("dgx-h100").gpu.rank_excess is None


@given(st.integers(1, 100_000), st.integers(1, 100_000))
def test_more_ranks_never_wait_less_on_the_a100(a: int, b: int) -> None:
    hw = load_system("dgx-a100-80gb")
    lo, hi = sorted((a, b))
    assert 1.0 <= CostModel(hw, "bf16", ranks=lo).rank_stretch \
        <= CostModel(hw, "bf16", ranks=hi).rank_stretch <= 1.0 + 0.06425


def test_a_calibrated_spread_drops_the_bases_population_curve() -> None:
    """A calibration over an A100 preset that measured its own two ranks' spread keeps
    that, not the base's population curve; one that did not keeps the base's curve."""
    from calibration.microbench.fit_profile import fit_compute
    from calibration.microbench.profile_build import build_profile

    def built(ok: bool) -> dict[str, Any]:
        fits = fit_compute([{**_record(ROUNDS_MS), "ok": ok}], "cpu", "fp32", 1, "test cpu",
                           None)
        return build_profile(fits, load_system("dgx-a100-80gb"), name="t", device="cpu",
                             device_name="test cpu", gpus_per_node=2, memory_GB=8.0,
                             provenance={}, datasheet=False)

    measured, kept = built(True), built(False)
    assert measured["gpu"]["rank_spread"] > 0 and "rank_excess" not in measured["gpu"]
    assert kept["gpu"]["rank_excess"] == load_system("dgx-a100-80gb").gpu.model_dump(
        mode="json")["rank_excess"]
    # the calibration's summary says which one the profile carries
    from calibration.microbench.report_tables import summary_text

    assert "rank excess" not in summary_text(measured, [], 1.0)
    assert "rank excess (the base's GPU population): the slowest of n 2: +0.58%, 4: +1.08%" \
        in summary_text(kept, [], 1.0)
