"""NCCL's kernels hold SMs: one thread block per channel (``src/enqueue.cc``), as many
channels as NCCL's rule gives the op, size and algorithm, so compute overlapped with a
collective runs on gpu.sms minus those SMs, in the engine and the closed form alike
(:mod:`simulator.system.collectives.channels`)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_chains import same_figures
from test_engine import EXACT, _compute_beside_all_reduce, make_scenario

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.builder.workload import build_workload
from simulator.engine.engine import Engine, simulate
from simulator.spec.scenario import Scenario
from simulator.strategies.timing import interference, stretch
from simulator.system.collectives.channels import (
    MAX_THREADS,
    THREAD_THRESHOLD,
    channels,
    sm_factor,
)
from simulator.system.collectives.choice import make_plan
from simulator.system.collectives.plan import GroupShape
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout


def nccl_loop(algorithm: str, protocol: str, n: int, nbytes: int, nchannels: int) -> int:
    """``getAlgoInfo``'s ring/tree channel tuning (NCCL 2.18.1 ``src/enqueue.cc``) as
    written there: drop a channel while the buffer is under nc · nt · threshold, at one
    channel halve the threads instead; LL's ring threshold × nRanks (tuning.cc)."""
    nc, nt = nchannels, MAX_THREADS[protocol]
    threshold = THREAD_THRESHOLD[protocol] * (n if (algorithm, protocol) == ("ring", "LL")
                                              else 1)
    while nbytes < nc * nt * threshold:
        if nc >= 2:
            nc -= 1
        elif nt % 128 == 0:
            nt //= 2
        else:
            break
    return nc


@settings(max_examples=300, deadline=None)
@given(algorithm=st.sampled_from(["ring", "tree", "pat"]),
       protocol=st.sampled_from(["LL", "LL128", "Simple"]), n=st.integers(2, 4096),
       nbytes=st.integers(1, 1 << 34), nchannels=st.integers(1, 64))
def test_channels_follow_nccls_loop(algorithm, protocol, n, nbytes, nchannels):
    assert channels(algorithm, protocol, n, float(nbytes), nchannels) \
        == nccl_loop(algorithm, protocol, n, nbytes, nchannels)


def test_channels_at_the_rules_corners():
    """Ring/Simple: 512 threads × 64 B a channel, so every channel from 512 KiB; NVLS
    takes NCCL_NVLS_NCHANNELS (16) whatever the size; no communicator, no channels."""
    assert channels("ring", "Simple", 8, 512 * 1024, 16) == 16
    assert channels("ring", "Simple", 8, 512 * 1024 - 1, 16) == 15
    assert channels("ring", "Simple", 8, 1.0, 16) == 1
    assert channels("ring", "LL", 8, 8 * 512 * 8 * 3, 16) == 3  # × nRanks for LL rings
    assert channels("nvls", "Simple", 8, 1.0, 32) == 16
    assert channels("nvls", "Simple", 8, 1e9, 8) == 8
    assert channels("ring", "Simple", 8, 1e9, 0) == 0


def _hw(system: str = "dgx-h100", **gpu: Any) -> HardwareProfile:
    hw = make_scenario(dp=2, cluster={"system": system}).hardware
    if "runtime" in gpu:
        gpu["runtime"] = hw.gpu.runtime_memory().model_copy(update=gpu["runtime"])
    return hw.model_copy(update={"gpu": hw.gpu.model_copy(update=gpu)})


def test_nccl_plans_hold_their_channels():
    """``make_plan`` gives NCCL's collectives their channels (auto and named), the
    communicator's at most; all-to-all and send/recv (NCCL's point-to-point) none; a
    CPU profile (no channels) none."""
    hw, shape = _hw(), GroupShape(8, 8)
    assert make_plan("all_reduce", 1e9, shape, "auto", hw).sms == 16
    assert make_plan("all_gather", 1e9, GroupShape(16, 8), "ring", hw).sms == 16
    assert make_plan("reduce_scatter", 64e3, shape, "ring", hw).sms == 1
    assert make_plan("all_to_all", 1e9, shape, "auto", hw).sms == 0
    assert make_plan("all_reduce", 1e9, shape, "auto",
                     _hw(runtime={"nccl_channels": 4})).sms == 4
    cpu = make_scenario(dp=2, cluster={"system": "cpu-1thread"}).hardware
    assert make_plan("all_reduce", 1e9, shape, "ring", cpu).sms == 0


def test_sm_factor_and_which_wins():
    """132 SMs less 16 held: compute at 116/132; a calibrated ``gpu.interference``
    (measured beside NCCL's kernels) replaces it for NCCL's plans, never both, and
    leaves DeepEP's; no SMs stated, or transfers in line, nothing."""
    hw = _hw()
    plan = make_plan("all_reduce", 1e9, GroupShape(8, 8), "ring", hw)
    assert sm_factor(plan, hw.gpu) == pytest.approx(132 / 116)
    assert sm_factor(plan, _hw(interference={"intra_node": 1.05}).gpu) == 1.0
    assert sm_factor(plan, _hw(sms=None, gemm_tiles=[]).gpu) == 1.0
    assert sm_factor(plan, _hw(comm_overlaps_compute=False).gpu) == 1.0
    deepep = plan.__class__("all_to_all", "deepep", 1e9, 8, (), sms=20)
    assert sm_factor(deepep, _hw(interference={"intra_node": 1.05}).gpu) \
        == pytest.approx(132 / 112)


def test_engine_slows_compute_beside_nccl_as_the_closed_form():
    """Compute ``b`` and ``c`` (2 s) beside a ring all-reduce of T seconds on an H100
    (16 channels held): the engine ends them (f − 1) · min(2, T / f) later, f = 132 / 116,
    which is the closed form's stretch with the closed form's factor."""
    w, _ = _compute_beside_all_reduce()
    hw = _hw()
    plan = make_plan("all_reduce", 500e9, GroupShape(2, 2), "ring", hw)
    for t in w.tasks:
        if t.plan is not None:
            t.plan = plan
    w.holds_sms = True
    plain = Engine(w, _hw(comm_overlaps_compute=False)).run()
    got = Engine(w, hw).run()
    t_ar = got.end[3] - got.begin[3]
    factor = interference(make_scenario(dp=2, m=1), Layout(tp=1, pp=1, dp=2, gpus_per_node=2),
                          "all_reduce", 500e9, (0, 1), hw)
    assert factor == pytest.approx(132 / 116)
    assert 0.5 < t_ar / factor < 2.0  # the transfer ends inside the run (a real test)
    for r in (0, 1):
        grown = got.end[4 * r + 2] - plain.end[4 * r + 2]
        assert grown == pytest.approx(stretch(t_ar, 2.0, factor), abs=EXACT)


@pytest.fixture(scope="module")
def systems(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The H100 preset as a profile file with ``nccl_channels`` set."""
    base = tmp_path_factory.mktemp("systems")

    def system(nchannels: int) -> str:
        path = base / f"h100-{nchannels}.yaml"
        if not path.exists():
            hw = _hw(runtime={"nccl_channels": nchannels})
            path.write_text(yaml.safe_dump(hw.model_dump(mode="json", exclude_none=True)))
        return str(path)
    return system


def _dp_scenario(system: str, zero: int = 0) -> Scenario:
    return make_scenario(dp=4, m=2, gpus_per_node=4, cluster={"system": system},
                         parallel={"overlap": {"dp": True}, "zero": zero},
                         model={"layers": 4, "hidden": 1024, "heads": 8, "vocab": 8000,
                                "seq_len": 512})


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fewer=st.integers(1, 16), more=st.integers(1, 16),
       fidelity=st.sampled_from(["full", "folded"]), zero=st.sampled_from([0, 3]))
def test_more_channels_never_make_a_step_faster(systems, fewer, more, fidelity, zero):
    """On one node (no ring plateau, the only other use of the channel count) a
    communicator of more channels holds as many SMs or more: neither the engine's step
    nor the closed form's gets shorter, with DP reductions or ZeRO-3's gathers beside
    the compute."""
    fewer, more = sorted((fewer, more))
    lo, hi = _dp_scenario(systems(fewer), zero), _dp_scenario(systems(more), zero)
    t_lo = simulate(build_workload(lo, fidelity=fidelity), lo.hardware).end_time
    t_hi = simulate(build_workload(hi, fidelity=fidelity), hi.hardware).end_time
    assert t_lo - EXACT <= t_hi
    assert analytic_estimate(lo)["step_time_s"] <= analytic_estimate(hi)["step_time_s"] \
        + EXACT


@pytest.mark.parametrize("zero", [0, 3])
def test_channels_slow_the_step(systems, zero):
    """The mechanism reaches the step: 16 channels held against 1 lengthen both the
    engine's and the closed form's step (the DP reduction overlaps the backward, ZeRO-3's
    gathers the layer before)."""
    lo, hi = _dp_scenario(systems(1), zero), _dp_scenario(systems(16), zero)
    assert simulate(build_workload(lo), lo.hardware).end_time \
        < simulate(build_workload(hi), hi.hardware).end_time
    assert analytic_estimate(lo)["step_time_s"] < analytic_estimate(hi)["step_time_s"]


def test_chains_stay_where_no_held_sms_reach_the_compute():
    """DP reductions beside the backward hold SMs on every rank: the compute stream
    still chains while each gated stream waits for a compute event of its own rank
    (none can start before the chain's end), and the figures are the per-step run's,
    bit for bit."""
    s = make_scenario(tp=2, pp=2, dp=2, m=4, gpus_per_node=2,
                      stack={"preset": "megatron-core", "tp_overlap": "none"},
                      parallel={"overlap": {"dp": True}, "dp_bucket_MB": 0.05},
                      model={"layers": 8, "hidden": 512, "heads": 8, "vocab": 512,
                             "seq_len": 256})
    w = build_workload(s, fidelity="folded")
    chained, per_step = Engine(w, s.hardware), Engine(w, s.hardware, chains=False)
    a, b = chained.run(), per_step.run()
    assert chained.gates and chained._sm_slow  # SMs held beside the compute
    assert a.merged_events > 0
    same_figures(s, chained, a, per_step, b)
