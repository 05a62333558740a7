"""Calibration of every cost term, on synthetic timings with a known closed form: the
overhead intercept, curves net of it, a curve per cost class, interference, the spread
of each term, the busy-machine guard and which terms the profile marks as preset."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
from cpu_profile import profile_from

from calibration.microbench.bench_compute import KERNEL_CLASS
from calibration.microbench.bench_jobs import Job, run_jobs
from calibration.microbench.bench_results import ResultsStore
from calibration.microbench.bench_timing import budget_for
from calibration.microbench.busy_guard import DRIFT_LIMIT, SPREAD_LIMIT, judge
from calibration.microbench.fit import fit_efficiency, fit_intercept
from calibration.microbench.fit_profile import fit_compute
from calibration.microbench.fit_terms import CLASS_SOURCES
from calibration.microbench.profile_build import write_profile
from simulator.system.profiles import load_system
from simulator.system.units import COST_CLASSES

OVERHEAD_S = 7e-6
PEAK_FLOPS = 1e11  # 0.1 TFLOP/s
HBM_BPS = 20e9
# true efficiencies: GEMM layouts and attention passes differ; memory kernels by class
EFF = {"gemm": 0.8, "dgrad": 0.6, "wgrad": 0.5, "attention": 0.4, "attention_bwd": 0.3}
MEM_EFF = {"layer_norm": 0.5, "rms_norm": 0.5, "softmax": 0.3, "cross_entropy": 0.6,
           "gelu": 0.4, "swiglu": 0.4,
           "add": 0.4, "mul": 0.4, "sum": 0.9, "copy": 1.0, "adamw": 0.7}
SEL = {"device": "cpu", "threads": 1, "dtype": "fp32", "ok": True}


def _rec(kind: str, key: str, time_s: float, **meta: Any) -> dict[str, Any]:
    return {"key": f"cpu/fp32/t1/{kind}/{key}", "kind": kind, "time_s": time_s,
            "spread": 0.02, **SEL, **meta}


def _records(noise: float = 0.0, seed: int = 0) -> list[dict[str, Any]]:
    """Timings that follow t = size / (peak × efficiency) + 7 µs exactly (× noise)."""
    rng = random.Random(seed)

    def t(size: float, rate: float) -> float:
        return (size / rate + OVERHEAD_S) * (1 + rng.uniform(-noise, noise))

    out = []
    for i in range(12):
        flops = 1e6 * 2.0**i
        out.append(_rec("gemm", f"g{i}", t(flops, PEAK_FLOPS * EFF["gemm"]), flops=flops,
                        m=i, n=1, k=1))
        for layout in ("dgrad", "wgrad"):
            out.append(_rec("gemm_layout", f"{layout}{i}", t(flops, PEAK_FLOPS * EFF[layout]),
                            flops=flops, layout=layout))
        out.append(_rec("attention", f"a{i}", t(flops, PEAK_FLOPS * EFF["attention"]),
                        flops=flops))
        out.append(_rec("attention_bwd", f"b{i}", t(flops, PEAK_FLOPS * EFF["attention_bwd"]),
                        flops=flops))
    for kernel, eff in MEM_EFF.items():
        for i in range(6):
            nbytes = 64e3 * 4.0**i
            out.append(_rec("memory", f"{kernel}{i}", t(nbytes, HBM_BPS * eff), bytes=nbytes,
                            kernel=kernel))
    for kernel in ("add", "copy"):
        for i in range(8):
            nbytes = 4.0 * 4**i
            out.append(_rec("overhead", f"{kernel}{i}", t(nbytes, 5e9), bytes=nbytes,
                            kernel=kernel))
    return out


def test_intercept_of_a_straight_line_is_the_overhead() -> None:
    sizes = [4.0 * 4**i for i in range(9)]
    exact = fit_intercept(sizes, [OVERHEAD_S + x / 10e9 for x in sizes])
    assert exact.intercept_s == pytest.approx(OVERHEAD_S, rel=1e-6)
    assert exact.slope_s == pytest.approx(1 / 10e9, rel=1e-6)
    rng = random.Random(3)
    noisy = fit_intercept(sizes, [(OVERHEAD_S + x / 10e9) * (1 + rng.uniform(-0.05, 0.05))
                                  for x in sizes])
    assert noisy.intercept_s * 1e6 == pytest.approx(7.0, abs=0.5)
    assert noisy.intercept_rel_se is not None and 0 < noisy.intercept_rel_se < 0.2


def test_intercept_is_zero_when_time_is_proportional_to_size() -> None:
    sizes = [1e3 * 2**i for i in range(8)]
    fit = fit_intercept(sizes, [x / 1e9 for x in sizes])
    assert fit.intercept_s == pytest.approx(0.0, abs=1e-12)


def test_curve_net_of_the_overhead_recovers_the_true_efficiency() -> None:
    sizes = [1e5 * 2.0**i for i in range(16)]  # own work from 20% of the overhead up
    times = [x / (PEAK_FLOPS * 0.7) + OVERHEAD_S for x in sizes]
    net = fit_efficiency(sizes, times, PEAK_FLOPS, monotone=True, offset_s=OVERHEAD_S)
    assert all(e == pytest.approx(0.7, rel=1e-3) for _, e in net.points)
    assert net.holdout_error == pytest.approx(0.0, abs=1e-3)
    gross = fit_efficiency(sizes, times, PEAK_FLOPS, monotone=True)  # overhead inside the curve
    assert gross.points[0][1] < 0.5 * 0.7


def test_fit_compute_recovers_overhead_peaks_and_every_class() -> None:
    fits = fit_compute(_records(), "cpu", "fp32", 1, "test cpu")
    assert fits.terms.overhead_s == pytest.approx(OVERHEAD_S, rel=1e-3)
    # the best net rate is the GEMM's: peak = 0.8 × the synthetic peak
    assert fits.peak_tflops["fp32"] * 1e12 == pytest.approx(PEAK_FLOPS * 0.8, rel=1e-3)
    assert fits.hbm_GBps is not None
    assert fits.hbm_GBps * 1e9 == pytest.approx(HBM_BPS, rel=1e-3)  # the copy's rate
    assert set(fits.terms.classes) == set(COST_CLASSES) == set(CLASS_SOURCES)
    peak = PEAK_FLOPS * 0.8
    for cls, true in (("gemm_fwd", EFF["gemm"]), ("gemm_dgrad", EFF["dgrad"]),
                      ("gemm_wgrad", EFF["wgrad"]), ("attention_fwd", EFF["attention"]),
                      ("attention_bwd", EFF["attention_bwd"])):
        for _, e in fits.terms.classes[cls].points:
            assert e == pytest.approx(true * PEAK_FLOPS / peak, rel=1e-3), cls
    for kernel, eff in MEM_EFF.items():
        curve = fits.terms.classes[KERNEL_CLASS[kernel]]
        assert curve.efficiency(1e6) == pytest.approx(eff, rel=1e-3), kernel


def test_profile_states_measured_terms_and_marks_the_rest_preset(tmp_path: Path) -> None:
    recs = _records(noise=0.03, seed=1)
    recs.append({"key": "cpu/t1/interference/x", "kind": "interference", "ok": True,
                 "device": "cpu", "threads": 1, "link": "intra_node", "factor": 1.3,
                 "round_ratios": [1.25, 1.3, 1.35]})
    prof = profile_from(recs)
    written = write_profile(prof, tmp_path / "p.yaml")
    assert load_system(str(tmp_path / "p.yaml")) == written
    gpu = written.gpu
    assert gpu.kernel_overhead_us == pytest.approx(7.0, abs=0.5)
    assert gpu.interference_factor("intra_node") == 1.3
    assert gpu.interference_factor("inter_node") == 1.0
    assert gpu.efficiency("softmax", 1e6) == pytest.approx(0.3, rel=0.1)
    terms = written.provenance["terms"]
    for term in ("gemm", "gemm_wgrad", "softmax", "kernel_overhead", "interference"):
        assert terms[term]["source"] == "measured", term
        assert 0 < written.uncertainty[term] < 0.1, term
    for term in ("intra_node", "inter_node", "point_to_point"):  # no collectives here
        assert terms[term] == {"source": "preset", "from": "cpu-1thread"}
        assert term not in written.uncertainty
    assert written.uncertainty["interference"] == pytest.approx(
        0.05 / 1.3 / math.sqrt(3), rel=1e-2)


def test_unmeasured_overhead_and_interference_are_preset() -> None:
    recs = [r for r in _records() if r["kind"] not in ("overhead", "memory")]
    prof = profile_from(recs)
    terms = prof["provenance"]["terms"]
    assert terms["kernel_overhead"]["source"] == "preset"
    assert terms["interference"]["source"] == "preset"
    assert terms["softmax"]["source"] == "preset"
    assert "gpu.kernel_overhead_us" in prof["provenance"]["not_measured"]
    assert prof["gpu"]["kernel_overhead_us"] == 0.0  # no intercept: launch cost in the curves
    assert "softmax" not in prof["gpu"]["class_efficiency"]
    assert set(prof["uncertainty"]) >= {"gemm", "gemm_dgrad", "attention_bwd"}


def test_drift_widens_every_compute_spread() -> None:
    quiet = profile_from(_records(noise=0.03, seed=2))["uncertainty"]
    drifting = profile_from(_records(noise=0.03, seed=2), drift=0.3)["uncertainty"]
    for term in ("gemm", "memory", "softmax", "kernel_overhead"):
        assert drifting[term] > quiet[term] + 0.05, term


# ---------------------------------------------------------------- the busy guard


def _ref(time_s: float, spread: float = 0.02) -> dict[str, Any]:
    return {"kind": "reference", "time_s": time_s, "spread": spread}


def _measured(spread: float, n: int = 20) -> list[dict[str, Any]]:
    return [{"kind": "gemm", "ok": True, "spread": spread} for _ in range(n)]


def test_guard_is_quiet_on_steady_timings() -> None:
    verdict = judge([_ref(1.00e-3), _ref(1.05e-3)], _measured(0.03))
    assert not verdict.busy and verdict.warning() is None
    assert verdict.drift == pytest.approx(0.05)


def test_guard_fires_on_a_drifting_reference() -> None:
    verdict = judge([_ref(1.0e-3), _ref(1.3e-3)], _measured(0.03))
    assert verdict.busy and verdict.drift == pytest.approx(0.3) and DRIFT_LIMIT < 0.3
    text = verdict.warning()
    assert text is not None and text.startswith("WARNING") and "\n" not in text
    assert "1.000 ms" in text and "1.300 ms" in text and "30%" in text
    assert judge([_ref(1.3e-3), _ref(1.0e-3)], _measured(0.03)).busy  # a machine getting idle


def test_guard_fires_on_scattered_repeats() -> None:
    verdict = judge([_ref(1e-3), _ref(1e-3)], _measured(0.3))
    assert verdict.busy and verdict.spread == pytest.approx(0.3) and SPREAD_LIMIT < 0.3
    assert "30.0%" in (verdict.warning() or "")


def test_retry_retimes_every_job_once_per_attempt(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path / "r.jsonl")
    calls: list[str] = []

    def runner(key: str) -> Any:
        def run() -> tuple[float, dict[str, Any]]:
            calls.append(key)
            return 1e-3, {"spread": 0.01}
        return run

    meta = {"device": "cpu", "dtype": "fp32", "threads": 1}
    jobs = [Job(f"k{i}", "gemm", f"job {i}", 1e6 * (i + 1), "gemm", meta, runner(f"k{i}"))
            for i in range(3)]
    import dataclasses

    budget = dataclasses.replace(budget_for("cpu", "tiny"), recheck_passes=0)
    run_jobs("gemm", jobs, store, budget, "flops")
    run_jobs("gemm", jobs, store, budget, "flops")  # resumed: nothing again
    assert calls == ["k0", "k1", "k2"]
    retry = dataclasses.replace(budget, retry=1)
    run_jobs("gemm", jobs, store, retry, "flops")
    run_jobs("gemm", jobs, store, retry, "flops")  # the finished attempt is not redone
    assert calls == ["k0", "k1", "k2"] * 2
    run_jobs("gemm", jobs, store, dataclasses.replace(budget, retry=2), "flops")
    assert len(calls) == 9


@pytest.mark.parametrize(("refs", "retry_busy", "attempts", "warned"), [
    ([1.0, 1.05], 2, 0, False),  # steady: measured once, no warning
    ([1.0, 1.5, 1.0, 1.02], 2, 1, False),  # drifted, re-measured once, then quiet
    ([1.0, 1.5, 1.0, 1.4, 1.0, 1.3], 2, 2, True),  # busy throughout: two retries, warned
    ([1.0, 1.5], 0, 0, True),  # no --retry-busy: only the warning
])
def test_busy_machine_is_remeasured_until_quiet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        refs: list[float], retry_busy: int, attempts: int, warned: bool) -> None:
    from calibration.microbench import bench_terms
    from calibration.microbench import calibrate as cal

    times = iter(refs)
    monkeypatch.setattr(bench_terms, "time_reference", lambda *a: {
        "kind": "reference", "time_s": next(times) * 1e-3, "spread": 0.01})
    retries: list[int] = []

    def compute(o: Any, d: Any, budget: Any, s: Any) -> list[tuple[str, Any]]:
        return [("compute", lambda: retries.append(budget.retry))]  # measures nothing

    monkeypatch.setattr(cal, "compute_phases", compute)
    monkeypatch.setattr(cal, "phases", lambda o, d, budget, s, n: compute(o, d, budget, s))
    opts = cal.Options("cpu", "fp32", "tiny", 2, 1, tmp_path / "p.yaml", tmp_path / "r.jsonl",
                       (), frozenset(), "cpu-1thread", "t", 60.0, False, "cpu", retry_busy)
    guard = cal._guarded(opts, None, budget_for("cpu", "tiny"), ResultsStore(opts.results),
                         False)
    assert retries == list(range(attempts + 1))  # budget.retry: 0, then 1, 2, ...
    assert guard["retries"] == attempts and guard["busy"] is warned
    assert (guard["warning"] is not None) is warned
    err = capsys.readouterr().err
    assert ("WARNING: the machine looked busy" in err) is (warned or attempts > 0)
    if warned:  # the advice fits what was done: no --retry-busy after it was spent
        assert ("or with --retry-busy N" in guard["warning"]) is (attempts == 0)
        assert (f"still busy after {attempts} re-measure(s)" in guard["warning"]) is \
            (attempts > 0)
    if attempts:  # each re-measure is announced, without advice
        assert "Timings may read slow. Re-measuring the compute part" in err


def test_a_causal_attention_curve_charges_the_time_it_was_fitted_on() -> None:
    """Attention records count the full square of a causal call; the cost model charges a
    causal flash kernel ``compute_scale`` of the counted FLOPs (a backward 1.25 times
    that: it recomputes the scores). Fitted against the plain peak the skipped half was
    discounted twice: a calibrated shape cost half its time."""
    from simulator.model.inventory.ops import Op, flash_scale
    from simulator.system.costs import CostModel

    recs = [r if r["kind"] not in ("attention", "attention_bwd") else {**r, "causal": True}
            for r in _records()]
    prof = load_system_from(profile_from(recs))
    cost = CostModel(prof, "fp32")
    for kind, cls, pass_ in (("attention", "attention_fwd", "fwd"),
                             ("attention_bwd", "attention_bwd", "bwd_input")):
        for r in (r for r in recs if r["kind"] == kind and r["flops"] >= 1e8):
            op = Op("attn_core", "attention", r["flops"], 0.0, r["flops"], cls, 1, 0.0,
                    flash_scale(pass_))
            assert cost.op_time(op) == pytest.approx(r["time_s"], rel=1e-3), (cls, r["flops"])


def load_system_from(profile: dict[str, Any]) -> Any:
    from simulator.system.profiles import validate_profile

    return validate_profile(profile, "test")
