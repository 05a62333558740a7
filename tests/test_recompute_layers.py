"""Recomputing only some layers (``parallel.recompute_num_layers``, Megatron-LM's block
method; ``parallel.recompute_every``, torchtitan's every k-th layer): which layers, and
that memory, hardware FLOPs, the engine and the analytic estimate all count those.

Oracles: the layer choice is the frameworks' (the first N of each model chunk; the
k-th, 2k-th, ... of each pipeline rank over its chunks); a stage's activations with N
of its L layers recomputed are N · (full's per-layer bytes) + (L − N) · (none's) plus
what the embedding and the head keep, times the micro-batches in flight; the hardware
FLOPs add exactly the recomputed layers' forward; N = 0 is no recomputation, N at a
chunk's layers and k = 1 are full recomputation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cpu_profile import in_line_scenario
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.analytic.stage import pipeline_time
from simulator.analysis.report import engine_metrics
from simulator.builder.workload import BlockCosts, build_workload
from simulator.engine.engine import simulate
from simulator.errors import ScenarioError
from simulator.model import device_memory as dm
from simulator.model import memory as mem
from simulator.model import transformer as mdl
from simulator.spec.load import scenario_from_dict
from simulator.spec.placement import stage_layers
from simulator.spec.recompute import (
    layer_mode,
    model_modes,
    recompute_problems,
    stage_modes,
)
from simulator.spec.scenario import Scenario

FREE = {"intra_node_bandwidth_GBps": 1e12, "inter_node_bandwidth_GBps": 1e12,
        "link_latency_us": 0}
EXACT = 1e-6


def scenario(layers: int = 8, pp: int = 2, v: int = 1, m: int = 4, schedule: str = "1f1b",
             free: bool = False, **parallel: Any) -> Scenario:
    return scenario_from_dict({
        "name": "partial-recompute",
        "model": {"layers": layers, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": pp,
                    **(FREE if free else {})},
        "parallel": {"pp": pp, "schedule": schedule, "virtual_stages": v, **parallel},
        "training": {"global_batch": m, "micro_batch": 1}})


def full_layers(s: Scenario) -> list[int]:
    return [i for i in range(s.model.layers)
            if layer_mode(s.parallel, s.model.layers, i) == "full"]


# ------------------------------------------------------------------ which layers


@pytest.mark.parametrize(("kwargs", "chosen"), [
    # Megatron block: the first N layers of each pipeline stage
    ({"pp": 2, "recompute_num_layers": 1}, [0, 4]),
    ({"pp": 2, "recompute_num_layers": 3}, [0, 1, 2, 4, 5, 6]),
    ({"pp": 2, "recompute_num_layers": 9}, list(range(8))),
    # ... of each model chunk when interleaved (chunks of 2 layers)
    ({"pp": 2, "v": 2, "schedule": "interleaved", "recompute_num_layers": 1}, [0, 2, 4, 6]),
    # torchtitan every k-th: counted from 1 over each rank's layers
    ({"pp": 1, "recompute_every": 3}, [2, 5]),
    ({"pp": 2, "recompute_every": 2}, [1, 3, 5, 7]),
    ({"pp": 2, "recompute_every": 3}, [2, 6]),
    # rank 0 holds layers 0-1 and 4-5 (chunks 0 and 2): its 3rd layer is layer 4
    ({"pp": 2, "v": 2, "schedule": "interleaved", "recompute_every": 3}, [4, 6]),
    # uneven placement: chunk starts at 0, 3, 8
    ({"pp": 2, "layers_per_stage": [3, 5], "recompute_num_layers": 2}, [0, 1, 3, 4]),
])
def test_the_frameworks_layers_are_chosen(kwargs: dict[str, Any], chosen: list[int]) -> None:
    pp, v = kwargs.pop("pp"), kwargs.pop("v", 1)
    s = scenario(pp=pp, v=v, recompute="full", **kwargs)
    assert full_layers(s) == chosen


@settings(max_examples=40, deadline=None)
@given(pp=st.sampled_from([1, 2, 3]), v=st.sampled_from([1, 2]), per=st.integers(1, 7),
       k=st.integers(1, 9), block=st.booleans(), zbv=st.booleans())
def test_the_closed_form_runs_are_the_layers_modes(pp: int, v: int, per: int, k: int,
                                                   block: bool, zbv: bool) -> None:
    """mode_runs' ranges (stepped for every k-th layer) hold each layer once, in the mode
    layer_mode gives it, on every rank's chunks under both placements."""
    schedule = ("zbv" if zbv else "interleaved") if v == 2 else "1f1b"
    field = {"recompute_num_layers": k - 1} if block else {"recompute_every": k}
    s = scenario(layers=pp * v * per, pp=pp, v=v, m=pp * 2, schedule=schedule, recompute="full",
                 **field)
    par, layers = s.parallel, s.model.layers
    for rank in range(pp):
        seen = {i: mode for mode, runs in stage_modes(par, layers, rank) for r in runs
                for i in r}
        mine = [i for r in stage_layers(layers, par, rank) for i in r]
        assert sorted(seen) == sorted(mine)
        assert seen == {i: layer_mode(par, layers, i) for i in mine}


def test_the_runs_stay_few_on_a_billion_layers() -> None:
    """Every 2nd or every 40,000th of 10⁹ layers: a few ranges, not a loop per layer."""
    for k in (2, 40_000):
        par = scenario(recompute="full", recompute_every=k).parallel.model_copy(
            update={"pp": 1})
        runs = [r for _, rs in model_modes(par, 10**9) for r in rs]
        assert len(runs) <= 2 * (10**9) ** 0.5 and sum(len(r) for r in runs) == 10**9


def test_without_the_fields_every_layer_has_the_mode() -> None:
    s = scenario(recompute="selective")
    assert {layer_mode(s.parallel, 8, i) for i in range(8)} == {"selective"}
    assert model_modes(s.parallel, 8) == (("selective", (range(8),)),)


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_stage_memory_is_n_full_layers_plus_the_rest_none(n: int) -> None:
    s = scenario(recompute="full", recompute_num_layers=n)
    none, full = (scenario(recompute=mode) for mode in ("none", "full"))
    spec, b = s.model, s.training.micro_batch
    per_full = mem.activation_bytes_per_layer(spec, b, recompute="full", stack=s.stack)
    per_none = mem.activation_bytes_per_layer(spec, b, recompute="none", stack=s.stack)
    for stage in range(2):
        in_flight = mem.in_flight_microbatches("1f1b", 2, s.microbatches, 1, stage)
        # what the embedding and the head keep: the same under every mode
        extras = mem.activations(none, stage) - 4 * per_none * in_flight
        expected = (n * per_full + (4 - n) * per_none) * in_flight + extras
        assert mem.activations(s, stage) == pytest.approx(expected, rel=1e-12)
    assert mem.activations(full, 0) < mem.activations(s, 0) or n == 4


@pytest.mark.parametrize(("field", "value", "recomputed"), [
    ("recompute_num_layers", 1, 2), ("recompute_num_layers", 3, 6),
    ("recompute_every", 2, 4), ("recompute_every", 4, 2)])
def test_hardware_flops_add_the_recomputed_layers_forward(field: str, value: int,
                                                         recomputed: int) -> None:
    s = scenario(recompute="full", **{field: value})
    spec, batch = s.model, s.training.global_batch
    modes = model_modes(s.parallel, spec.layers)
    forward = mdl.ops_flops(mdl.layer_ops(spec, batch, 1, False, "bf16", "fwd", 0))
    added = mdl.hardware_flops_per_step(spec, batch, "full", modes) \
        - mdl.model_flops_per_step(spec, batch)
    assert added == pytest.approx(recomputed * forward, rel=1e-12)


@pytest.mark.parametrize(("v", "schedule", "field", "value", "alike"), [
    (1, "1f1b", "recompute_num_layers", 1, True), (1, "gpipe", "recompute_every", 2, True),
    (2, "interleaved", "recompute_num_layers", 1, True),
    (2, "interleaved", "recompute_every", 3, False)])
def test_engine_and_analytic_agree_when_exact(v: int, schedule: str, field: str,
                                              value: int, alike: bool) -> None:
    """Free communication and balanced block costs with a recompute cost: the recomputed
    layers' tasks on the engine are the closed form's (test_engine.py's exact case). When
    every chunk recomputes alike (``alike``) that is the schedule's closed form at the
    stage's times; every 3rd layer of a rank's two chunks of 2 recomputes in its second
    chunk only, which the analytic places action by action as the engine does."""
    s = scenario(layers=4 * v, pp=2, v=v, schedule=schedule, free=True, recompute="full",
                 **{field: value})
    costs = BlockCosts(fwd=(5e-4, 5e-4), bwd_input=(1e-3, 1e-3), bwd_weight=(0.0, 0.0),
                       recompute=(4e-4, 4e-4), embed=(0.0, 0.0, 0.0), head=(0.0, 0.0, 0.0))
    result = simulate(build_workload(s, costs=costs), s.hardware)
    met = engine_metrics(s, result)
    ana = analytic_estimate(s, costs=costs)
    assert ana["step_time_s"] == pytest.approx(met["step_time_s"], rel=EXACT)
    none = analytic_estimate(scenario(layers=4 * v, pp=2, v=v, schedule=schedule, free=True),
                             costs=costs)
    recomputed = len(full_layers(s)) // 2  # per stage: both stages alike here
    f, b, m = 2 * v * 1e-3, 2 * v * 2e-3, s.microbatches  # a stage's F and B per micro-batch
    extra = pipeline_time(schedule, 2, m, v, f, b + recomputed * 8e-4, 0.0) \
        - pipeline_time(schedule, 2, m, v, f, b, 0.0)
    closed = ana["step_time_s"] - none["step_time_s"] == pytest.approx(extra, rel=1e-9)
    assert closed == alike


# ------------------------------------------------------------------ the limits


def _figures(s: Scenario) -> tuple[float, ...]:
    ana = analytic_estimate(s)
    mem_stages = tuple(f(s, st) for st in range(s.parallel.pp)
                       for f in (mem.activations, dm.allocator_rounding))
    flops = mdl.hardware_flops_per_step(s.model, s.training.global_batch, s.parallel.recompute,
                                        model_modes(s.parallel, s.model.layers))
    return (ana["step_time_s"], flops, *mem_stages)


@settings(max_examples=12, deadline=None)
@given(pp=st.sampled_from([1, 2, 4]), per=st.integers(1, 3), tp=st.sampled_from([1, 2]),
       m=st.integers(1, 6), extra=st.integers(0, 3))
def test_the_limits_are_none_and_full(pp: int, per: int, tp: int, m: int, extra: int) -> None:
    """N = 0 is recompute: none, N ≥ layers per stage, k = 1 and groups of 1 are
    recompute: full."""
    def make(**par: Any) -> Scenario:
        return scenario_from_dict({
            "name": "limits",
            "model": {"layers": pp * per, "hidden": 256, "heads": 8, "vocab": 1024,
                      "seq_len": 128},
            "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": pp * tp},
            "parallel": {"pp": pp, "tp": tp, **par},
            "training": {"global_batch": m, "micro_batch": 1}})
    none, full = _figures(make(recompute="none")), _figures(make(recompute="full"))
    assert _figures(make(recompute="full", recompute_num_layers=0)) == pytest.approx(none)
    assert _figures(make(recompute="full", recompute_num_layers=per + extra)) \
        == pytest.approx(full)
    assert _figures(make(recompute="full", recompute_every=1)) == pytest.approx(full)
    assert _figures(make(recompute="full", recompute_group=1)) == pytest.approx(full)


def test_the_engine_limits_are_none_and_full() -> None:
    s = {n: scenario(recompute="full", recompute_num_layers=n) for n in (0, 4)}
    ref = {0: scenario(recompute="none"), 4: scenario(recompute="full")}
    for n in (0, 4):
        got, want = (simulate(build_workload(x), x.hardware) for x in (s[n], ref[n]))
        assert engine_metrics(s[n], got)["step_time_s"] == \
            pytest.approx(engine_metrics(ref[n], want)["step_time_s"], rel=1e-12)


# ------------------------------------------------------------------ the rules


@pytest.mark.parametrize(("parallel", "words"), [
    ({"recompute": "none", "recompute_num_layers": 2},
     ["parallel.recompute_num_layers = 2", "needs parallel.recompute: full", "(it is none)"]),
    ({"recompute": "selective", "recompute_every": 2},
     ["parallel.recompute_every = 2", "(it is selective)"]),
    ({"recompute": "full", "recompute_num_layers": 1, "recompute_every": 2},
     ["parallel.recompute_every = 2", "contradicts parallel.recompute_num_layers",
      "keep one"]),
    ({"recompute": "none", "recompute_group": 2},
     ["parallel.recompute_group = 2", "needs parallel.recompute: full"]),
    ({"recompute": "full", "recompute_every": 2, "recompute_group": 3},
     ["parallel.recompute_group = 3", "contradicts parallel.recompute_every", "keep one"]),
])
def test_rules_name_field_value_and_fix(parallel: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ScenarioError) as caught:
        scenario(**parallel)
    assert len(caught.value.problems) == 1
    text = str(caught.value)
    assert "\n" not in text
    for word in words:
        assert word in text


def test_the_rules_pass_the_fields_with_full() -> None:
    assert recompute_problems(scenario(recompute="full", recompute_every=2).parallel) == []


# ------------------------------------------------------------------ the command line


def test_memory_command_names_the_layers_and_refuses_a_bad_field(
        capsys: pytest.CaptureFixture[str]) -> None:
    from simulator.cli.main import main

    path = str(Path(__file__).resolve().parent.parent / "scenarios"
               / "llama2-7b-8gpu-pp4-1f1b.yaml")
    assert main(["memory", path, "--set", "parallel.recompute=full", "--set",
                 "parallel.recompute_num_layers=3"]) == 0
    assert "recompute full (first 3 layers of each chunk)" in capsys.readouterr().out
    assert main(["memory", path, "--set", "parallel.recompute_every=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parallel.recompute_every = 2" in err


@pytest.mark.parametrize("parallel", [
    {"recompute_num_layers": 1, "schedule": "1f1b"},
    {"recompute_every": 2, "schedule": "gpipe"}])
def test_memory_timeline_peak_is_memory_py(parallel: dict[str, Any]) -> None:
    """The engine-timed memory curve holds, at its peak, what memory.py sums: the
    recomputed layers' inputs and the other layers' whole activations."""
    from simulator.analysis.memory import stage_breakdown
    from simulator.analysis.memory_timeline import memory_timeline, stage_peaks

    s = scenario(layers=8, pp=2, m=4, recompute="full", **parallel)
    got = stage_peaks(memory_timeline(s, simulate(build_workload(s), s.hardware)))
    for stage in range(2):
        assert got[stage] == pytest.approx(stage_breakdown(s, stage).total, rel=1e-9), stage


@settings(max_examples=60, deadline=None)
@given(first_dense=st.integers(0, 5), freq=st.integers(1, 4), start=st.integers(0, 12),
       length=st.integers(0, 30), step=st.integers(1, 7))
def test_run_kinds_of_a_stepped_run_count_its_moe_layers(first_dense: int, freq: int,
                                                         start: int, length: int,
                                                         step: int) -> None:
    """The closed form against the layers one by one: as many dense and MoE layers, and
    each representative of its kind."""
    from simulator.model.moe import run_kinds
    from simulator.spec.model_spec import ModelSpec

    spec = ModelSpec(layers=64, hidden=256, heads=8, vocab=1024, seq_len=128, experts=8,
                     experts_per_token=2, first_dense_layers=first_dense, moe_layer_freq=freq)
    run = range(start, start + length, step)
    kinds = run_kinds(spec, run)
    routed = [i for i in run if spec.is_moe_layer(i)]
    want = {False: len(run) - len(routed), True: len(routed)}
    assert {spec.is_moe_layer(i): n for i, n in kinds} == {k: n for k, n in want.items() if n}
    assert all(i in run for i, _ in kinds)


def test_a_mixture_of_experts_limits_are_none_and_full() -> None:
    """MoE layers (every 2nd past the first) and every k-th layer recomputed: k = 1 is
    full recomputation, N = 0 none, in memory, hardware FLOPs and the analytic step."""
    def make(**par: Any) -> Scenario:
        return scenario_from_dict({
            "name": "moe-limits",
            "model": {"layers": 8, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 128,
                      "experts": 4, "experts_per_token": 2, "first_dense_layers": 1,
                      "moe_layer_freq": 2},
            "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 2},
            "parallel": {"pp": 2, **par},
            "training": {"global_batch": 4, "micro_batch": 1}})
    assert _figures(make(recompute="full", recompute_every=1)) \
        == pytest.approx(_figures(make(recompute="full")))
    assert _figures(make(recompute="full", recompute_num_layers=0)) \
        == pytest.approx(_figures(make(recompute="none")))
    half = _figures(make(recompute="full", recompute_every=2))
    none, full = _figures(make(recompute="none")), _figures(make(recompute="full"))
    assert all(min(a, b) <= h <= max(a, b) for h, a, b in zip(half, none, full, strict=True))
    assert half[:3] != none[:3] and half[:3] != full[:3]  # step, FLOPs, stage 0's activations



@pytest.mark.parametrize(("stack", "parallel"), [
    ("pytorch-eager", {"tp": 2, "sequence_parallel": True, "recompute_every": 2}),
    ("pytorch-eager", {"dp": 2, "zero": 3, "recompute_num_layers": 1}),
    ("deepspeed", {"dp": 2, "zero": 3, "recompute_every": 2}),  # module units
    ("torchtitan", {"cp": 2, "recompute_every": 2}),
    ("torchtitan", {"cp": 2, "cp_comm_type": "allgather", "recompute_num_layers": 1}),
], ids=["tp2-sp", "fsdp2", "deepspeed-zero3", "cp2-ring", "cp2-allgather"])
def test_analytic_prices_the_collectives_of_the_recomputed_layers(
        stack: str, parallel: dict[str, Any], tmp_path: Path) -> None:
    """test_analytic.py's in-line profile (communication in line with compute, no burst
    curve): the estimate prices the collectives the engine issues, the recomputed
    layers' (TP, ZeRO-3's gathers in their order, CP's exchange) and no others, to
    rounding."""
    from simulator.api import simulate_scenario

    s = in_line_scenario(tmp_path, stack, {"recompute": "full", **parallel})
    engine, _ = simulate_scenario(s, "engine")
    analytic, _ = simulate_scenario(s, "analytic")
    assert analytic["step_time_s"] == pytest.approx(engine["step_time_s"], rel=1e-9)


@pytest.mark.parametrize(("field", "value", "recomputed"), [
    ("recompute_num_layers", 2, True), ("recompute_every", 2, False)])
def test_the_ops_table_shows_layer_0_as_it_runs(field: str, value: int,
                                                recomputed: bool) -> None:
    """Layer 0 is among Megatron's first N and not torchtitan's every 2nd."""
    from simulator.outputs.ops_table import format_table, op_rows

    s = scenario(recompute="full", **{field: value})
    rows = op_rows(s)
    assert any(r["pass"] == "recompute" for r in rows) == recomputed
    assert f"under recompute {'full' if recomputed else 'none'})" in format_table(s, rows)


# ------------------------------------------------------------------ Megatron's uniform method


@pytest.mark.parametrize(("group", "kept"), [(1, 4), (2, 2), (3, 2), (4, 1), (9, 1)])
def test_groups_keep_one_input_each(group: int, kept: int) -> None:
    """4 layers per stage in groups of N keep ⌈4/N⌉ inputs; time and FLOPs are full's."""
    s = scenario(recompute="full", recompute_group=group)
    full, none = scenario(recompute="full"), scenario(recompute="none")
    per_full = mem.activation_bytes_per_layer(s.model, 1, recompute="full", stack=s.stack)
    per_none = mem.activation_bytes_per_layer(s.model, 1, recompute="none", stack=s.stack)
    for stage in range(2):
        in_flight = mem.in_flight_microbatches("1f1b", 2, s.microbatches, 1, stage)
        extras = mem.activations(none, stage) - 4 * per_none * in_flight
        assert mem.activations(s, stage) == pytest.approx(kept * per_full * in_flight + extras,
                                                          rel=1e-12)
    assert analytic_estimate(s)["step_time_s"] == analytic_estimate(full)["step_time_s"]
    got = simulate(build_workload(s), s.hardware)
    want = simulate(build_workload(full), full.hardware)
    assert engine_metrics(s, got)["step_time_s"] == engine_metrics(full, want)["step_time_s"]


def test_groups_are_counted_per_chunk_in_the_timeline() -> None:
    """Interleaved chunks of 2 layers in groups of 2: one input per chunk, and the
    engine-timed memory curve's peak drops by what memory.py's total drops (interleaved
    first and last stages differ from memory.py by the embedding and head terms alone,
    test_memory_timeline.py)."""
    from simulator.analysis.memory import stage_breakdown
    from simulator.analysis.memory_timeline import memory_timeline, stage_peaks

    grouped, full = (scenario(layers=8, pp=2, v=2, schedule="interleaved", recompute="full",
                              **kw) for kw in ({"recompute_group": 2}, {}))
    assert mem.activations(grouped, 0) < mem.activations(full, 0)
    peaks = [stage_peaks(memory_timeline(x, simulate(build_workload(x), x.hardware)))
             for x in (grouped, full)]
    for stage in range(2):
        drop = stage_breakdown(full, stage).total - stage_breakdown(grouped, stage).total
        assert drop > 0
        assert peaks[1][stage] - peaks[0][stage] == pytest.approx(drop, rel=1e-9), stage


@pytest.mark.parametrize("key", ["ac_freq", "selective_ac_option"])
def test_torchtitans_names_point_to_the_field(key: str) -> None:
    with pytest.raises(ScenarioError, match="did you mean 'recompute_every'"):
        scenario_from_dict({
            "name": "t", "model": {"layers": 8, "hidden": 256, "heads": 8, "vocab": 1024,
                                   "seq_len": 128},
            "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 1},
            "parallel": {key: 2}, "training": {"global_batch": 4}})
