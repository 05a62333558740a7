"""The planner proposes only what could run: a memory headroom no returned layout
exceeds, and a warning where a predicted MFU passes the kernel-level ceiling."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from simulator.analysis.ceiling import best_kernel_efficiency, mfu_ceiling
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.errors import UserError
from simulator.model import transformer as mdl
from simulator.search.candidates import PlanRequest
from simulator.search.headroom import DEFAULT_HEADROOM, Headroom, parse_headroom
from simulator.search.plan import ceiling_warnings, plan_lines, run_plan
from simulator.spec.load import scenario_from_dict
from simulator.system.curves import EfficiencyCurve
from simulator.system.profiles import load_system

# Llama-2 7B on 16 A100-80GB, a reduced search that still spans 20-110 GB
SMALL = PlanRequest("llama2-7b", 16, "dgx-a100-80gb", 64, seq_len=2048, top_k=1,
                    micro_batches=(1, 4), schedules=("1f1b",), zero_stages=(0, 1),
                    recompute=("none", "selective"))


@pytest.mark.parametrize(("text", "headroom"), [
    ("5%", Headroom(fraction=0.05)), ("12.5%", Headroom(fraction=0.125)),
    ("4GB", Headroom(GB=4.0)), ("4", Headroom(GB=4.0)), ("0", Headroom()),
    (" 2.5 gb ", Headroom(GB=2.5)),
])
def test_parse_headroom(text: str, headroom: Headroom) -> None:
    assert parse_headroom(text) == headroom


@pytest.mark.parametrize("text", ["-1GB", "5 MB", "100%", "x", ""])
def test_parse_headroom_rejects(text: str) -> None:
    with pytest.raises(UserError, match="--headroom"):
        parse_headroom(text)


def test_default_headroom_is_megatrons_overhead_factor() -> None:
    # theoretical_memory_usage.py: overhead_factor = 1.05
    assert DEFAULT_HEADROOM.bytes(80e9) == pytest.approx(4e9)
    assert Headroom(fraction=0.1, GB=2).bytes(80e9) == pytest.approx(10e9)


@pytest.mark.parametrize("headroom", [Headroom(), Headroom(fraction=0.05), Headroom(GB=30)])
def test_plan_never_returns_a_layout_above_the_headroom(headroom: Headroom) -> None:
    plan = run_plan(replace(SMALL, headroom=headroom), ThreadPoolExecutor(2))
    t, usable = plan.table, 80 - headroom.bytes(80e9) / 1e9
    assert plan.usable_GB == pytest.approx(usable)
    fits = t[t["fits"]]
    assert (fits["peak_memory_GB"] <= usable).all()
    # the headroom decides: every candidate between usable and capacity is refused
    between = t[(t["peak_memory_GB"] > usable) & (t["peak_memory_GB"] <= 80)]
    assert (between["verdict"] == "out of memory").all()
    assert plan.chosen is not None and t.loc[plan.chosen, "peak_memory_GB"] <= usable
    if headroom.GB == 30:
        assert len(between) > 0  # the reduced search has layouts in 50-80 GB


def test_best_kernel_efficiency_reads_every_compute_curve() -> None:
    s = scenario_from_dict({"name": "t", "model": {"preset": "llama2-7b"},
                            "cluster": {"system": "dgx-h100", "nodes": 1},
                            "parallel": {"tp": 8}, "training": {"global_batch": 8}})
    gpu = s.hardware.gpu
    points = [v for _, v in gpu.gemm_efficiency.points + gpu.attention_efficiency.points]
    points += [v for k in gpu.attention_kernels.values() for c in (*k.fwd.values(),
               *k.bwd.values()) for _, v in c.points]
    assert best_kernel_efficiency(gpu) == max(points)
    faster = gpu.model_copy(update={"class_efficiency": {
        "gemm_fwd": EfficiencyCurve(points=((1e9, 0.5), (1e12, 0.97))),
        "softmax": EfficiencyCurve(points=((1e3, 0.99),))}})  # bytes: not a compute curve
    assert best_kernel_efficiency(faster) == 0.97


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_mfu_ceiling_is_best_efficiency_times_model_over_executed_flops(recompute: str) -> None:
    """Executed FLOPs: the hardware FLOPs less the causal half a fused attention kernel
    skips; its backward executes 2.5 forwards where the model counts 2, so of the
    counted 4·B·s²·h forward it skips half, of the 8·B·s²·h backward 3/8, and of a
    recomputed forward half again."""
    s = scenario_from_dict({"name": "t", "model": {"preset": "llama2-7b", "seq_len": 2048},
                            "cluster": {"system": "dgx-a100-80gb", "nodes": 2},
                            "parallel": {"tp": 2, "pp": 2, "dp": 4, "recompute": recompute},
                            "training": {"global_batch": 64}})
    spec, B = s.model, 64
    core = 4.0 * B * spec.seq_len ** 2 * spec.hidden  # one layer's counted forward core
    passes = 0.5 + 8 / 4 * 3 / 8 + (0.5 if recompute != "none" else 0.0)
    executed = mdl.hardware_flops_per_step(spec, B, recompute) - spec.layers * core * passes
    ratio = mdl.model_flops_per_step(spec, B) / executed
    assert mfu_ceiling(s) == pytest.approx(best_kernel_efficiency(s.hardware.gpu) * ratio,
                                           rel=1e-12)
    results, _ = simulate_scenario(s, "analytic")
    assert results["mfu"] <= mfu_ceiling(s)  # the kernels' curves bound the prediction
    unfused = s.model_copy(update={"stack": s.stack.model_copy(
        update={"attention": "unfused"})})  # the full square runs: nothing skipped
    assert mfu_ceiling(unfused) == pytest.approx(
        best_kernel_efficiency(s.hardware.gpu) * mdl.model_flops_per_step(spec, B)
        / mdl.hardware_flops_per_step(spec, B, recompute), rel=1e-12)


def test_the_ceiling_rises_with_the_sequence_under_a_causal_kernel() -> None:
    """At long context the attention's counted square dominates and a causal kernel runs
    half of it: the ceiling on the full-square MFU passes the best kernel efficiency."""
    def ceiling(seq: int) -> float:
        return mfu_ceiling(scenario_from_dict({
            "name": "t", "model": {"preset": "llama3-70b", "seq_len": seq},
            "cluster": {"system": "dgx-h100", "nodes": 2}, "parallel": {"tp": 8, "cp": 2},
            "training": {"global_batch": 8}}))
    best = best_kernel_efficiency(load_system("dgx-h100").gpu)
    assert ceiling(2048) < ceiling(32768) < ceiling(131072)
    assert ceiling(131072) > best


def test_plan_warns_where_a_prediction_exceeds_the_ceiling() -> None:
    plan = run_plan(SMALL, ThreadPoolExecutor(2))
    assert not ceiling_warnings(plan.table)  # the engine stays under its kernels' curves
    assert "kernel-level ceiling" in plan_lines(plan)[-1]
    table = plan.table.copy()
    table.loc[plan.chosen, "above_ceiling"] = True  # as if a curve had promised more
    lines = ceiling_warnings(table)
    assert len(lines) == 1 and lines[0].startswith("warning: TP")
    assert "exceeds the kernel-level ceiling" in lines[0]


def test_cli_plan_headroom(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama2-7b", "--gpus", "8", "--system", "dgx-a100-80gb",
            "--global-batch", "8", "--micro-batches", "1", "--top", "0", "--workers", "1",
            "--no-plots", "--out", str(tmp_path), "--headroom", "12GB"]
    assert main(argv) == 0
    assert "do not fit in 68.0 GB (80 GB less 12 GB headroom)" in capsys.readouterr().out
    assert main([*argv[:-1], "lots"]) == 2
    assert "--headroom = 'lots'" in capsys.readouterr().err
