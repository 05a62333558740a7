"""FP8 linears (``stack.fp8``): closed forms for an FP8 layer's GEMM time at the fp8 peak,
its casts' bytes and the memory of the FP8 weight copies; the one-line error on a GPU
without FP8; a Llama-style step on dgx-h100 with and without FP8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from simulator.analysis.memory import stage_breakdown
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.errors import ScenarioError
from simulator.model import transformer as mdl
from simulator.model.inventory.fp8 import AMAX_HISTORY, cast_bytes
from simulator.model.inventory.ops import Op
from simulator.spec.load import scenario_from_dict
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec
from simulator.system.costs import CostModel
from simulator.system.profiles import load_system

SPEC = ModelSpec(layers=4, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
                 seq_len=4096, activation="swiglu", norm="rmsnorm", bias=False, position="rope")


def _stack(recipe: str = "delayed", **extra: Any) -> StackSpec:
    return StackSpec.model_validate({"preset": "megatron-core", "fp8": recipe, **extra})


def _ops(stack: StackSpec, pass_: str = "fwd", tp: int = 1, sp: bool = False) -> dict[str, Op]:
    ops = mdl.layer_ops(SPEC, 2, tp, sp, "bf16", pass_, stack=stack)  # type: ignore[arg-type]
    return {op.name: op for op in ops}


def _scenario(system: str = "dgx-h100", **stack: Any) -> dict[str, Any]:
    return {"name": "fp8", "model": SPEC.model_dump(exclude_none=True),
            "cluster": {"system": system, "nodes": 1},
            "parallel": {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "zero": 1},
            "training": {"global_batch": 16, "micro_batch": 2},
            "stack": {"preset": "megatron-core", "attention_dropout": 0.0,
                      "hidden_dropout": 0.0, **stack}}


def test_an_fp8_gemm_runs_at_the_fp8_peak_on_the_gemm_curve() -> None:
    """T·h·(q + 2kv) multiply-adds against 1979 TFLOP/s (H100 SXM's dense FP8) at the
    GEMM curve's efficiency for a bf16 call of the same ideal duration (half the FLOPs:
    ``costs.curve_flops``): at most half the bf16 GEMM's time, never less."""
    hw = load_system("dgx-h100")
    cost = CostModel(hw, "bf16")
    qkv, bf16 = _ops(_stack())["qkv"], _ops(_stack("delayed").model_copy(
        update={"fp8": "none"}))["qkv"]
    flops = 2.0 * 2 * 4096 * 4096 * (4096 + 2 * 1024)
    assert qkv.precision == "fp8" and qkv.flops == flops == bf16.flops
    assert qkv.gemm_call is not None  # and its tile and wave quantisation on the preset
    want = flops / (1979e12 * hw.gpu.gemm_efficiency(flops * 989 / 1979)
                    * hw.gpu.gemm_shape_factor(qkv.gemm_call))
    assert cost.op_parts(qkv)[0] == pytest.approx(want, rel=1e-12)
    assert cost.op_parts(qkv)[0] >= cost.op_parts(bf16)[0] * 989 / 1979


def test_a_profile_fp8_curve_prices_the_fp8_gemms() -> None:
    hw = load_system("dgx-h100")
    flat = hw.gpu.gemm_efficiency.model_copy(update={"points": ((1.0, 0.5), (1e15, 0.5))})
    hw = hw.model_copy(update={"gpu": hw.gpu.model_copy(update={"fp8_gemm_efficiency": flat})})
    qkv = _ops(_stack())["qkv"]
    assert qkv.gemm_call is not None
    assert CostModel(hw, "bf16").op_parts(qkv)[0] == pytest.approx(
        qkv.flops / (1979e12 * 0.5 * hw.gpu.gemm_shape_factor(qkv.gemm_call)), rel=1e-12)


def test_the_fp8_gemms_read_one_byte_operands_and_write_16_bit_results() -> None:
    T, h, n = 2 * 4096, 4096, 4096 + 2 * 1024
    fwd, dgrad, wgrad = (_ops(_stack(), p)["qkv"] for p in ("fwd", "bwd_input", "bwd_weight"))
    assert fwd.bytes == T * h + h * n + 2 * T * n  # X, W in FP8; Y bf16
    assert dgrad.bytes == T * n + h * n + 2 * T * h  # dY, W in FP8; dX bf16
    assert wgrad.bytes == T * h + T * n + 2 * h * n  # X, dY in FP8; dW bf16


@pytest.mark.parametrize(("recipe", "per_element", "kernels"), [
    ("delayed", 2 + 2, 1),  # bf16 read; FP8 row-wise and column-wise written
    ("current", 2 + 2 + 2, 2),  # an amax pass reads it first
    ("blockwise", 2 + 2 * (1 + 4 / 128), 1),  # an fp32 scale per 1x128 tile, each copy
    ("mxfp8", 2 + 2 * (1 + 1 / 32), 1),  # an E8M0 scale per 32
])
def test_the_casts_bytes_by_recipe(recipe: str, per_element: float, kernels: int) -> None:
    T, h, tp = 2 * 4096, 4096, 2
    L = T / tp  # sequence parallelism: the local shard is cast, FP8 rows all-gathered
    ops = _ops(_stack(recipe), "fwd", tp, True)
    assert ops["fp8_x_qkv"].bytes == pytest.approx(L * h * per_element, rel=1e-12)
    assert ops["fp8_x_qkv"].kernels == kernels
    assert ops["fp8_x_mlp_down"].bytes == pytest.approx(T * 14336 / tp * per_element,
                                                           rel=1e-12)
    grads = _ops(_stack(recipe), "bwd_input", tp, True)  # dY of the column-parallel QKV
    assert grads["fp8_dy_qkv"].bytes == pytest.approx(
        T * (4096 + 2 * 1024) / tp * per_element, rel=1e-12)
    assert "fp8_w_qkv" not in ops  # once per step, with the optimizer
    assert ("fp8_scale_update" in ops) == (recipe == "delayed")


def test_delayed_scaling_updates_each_linears_scales_from_its_history() -> None:
    """Forward: input, weight, output of 4 linears (fused QKV, fused gate/up); backward:
    output and input gradients; each history of 1024 fp32 amaxes read and written."""
    fwd, bwd = _ops(_stack())["fp8_scale_update"], _ops(_stack(), "bwd_input")["fp8_scale_update"]
    assert fwd.bytes == 2 * 3 * 4 * (AMAX_HISTORY + 1) * 4
    assert bwd.bytes == 2 * 2 * 4 * (AMAX_HISTORY + 1) * 4


def test_weights_cast_every_microbatch_where_the_caller_says_so() -> None:
    """No workspace kept between micro-batches; the column-wise copy each forward saves
    for the dgrad is kept with the activations, 1 byte per weight."""
    h, q, kv, f = 4096, 4096, 1024, 14336
    ops = _ops(_stack(fp8_weight_cast="microbatch"))
    assert ops["fp8_w_qkv"].bytes == cast_bytes("delayed", h * (q + 2 * kv))
    assert ops["fp8_w_qkv"].saved == h * (q + 2 * kv)
    fp8, cached = (scenario_from_dict(_scenario(fp8="delayed", fp8_weight_cast=w))
                   for w in ("microbatch", "step"))
    weights = (h * (q + 2 * kv) + q * h + h * 2 * f + f * h) / 2  # TP 2
    m, c = stage_breakdown(fp8, 0), stage_breakdown(cached, 0)
    assert c.weights - m.weights == pytest.approx(2 * 2 * weights, rel=1e-12)  # 2 layers
    in_flight = 2  # 1F1B, first of two stages
    assert m.activations - c.activations == pytest.approx(in_flight * 2 * weights, rel=1e-12)


def test_the_fp8_weight_workspace_is_two_bytes_per_linear_weight() -> None:
    """The row-wise and column-wise FP8 copies of every linear weight of the stage's
    layers (here 2 of 4 layers, TP 2), on top of the bf16 weights; the step casts them
    once, priced with the optimizer."""
    fp8, bf16 = (scenario_from_dict(_scenario(fp8=r)) for r in ("delayed", "none"))
    h, q, kv, f = 4096, 4096, 1024, 14336
    linears = h * (q + 2 * kv) + q * h + h * 2 * f + f * h
    extra = 2 * 2 * linears / 2
    assert stage_breakdown(fp8, 0).weights - stage_breakdown(bf16, 0).weights == \
        pytest.approx(extra, rel=1e-12)
    step, plain = (mdl.optimizer_op_of(s, 1e6, [range(0, 2)]) for s in (fp8, bf16))
    assert step.bytes - plain.bytes == pytest.approx(cast_bytes("delayed", 2 * linears / 2),
                                                     rel=1e-12)
    assert step.kernels - plain.kernels == 2 * 4  # one cast-transpose per weight tensor


def test_activations_kept_in_fp8_shrink_the_stage() -> None:
    fp8, bf16 = (scenario_from_dict(_scenario(fp8=r)) for r in ("delayed", "none"))
    assert stage_breakdown(fp8, 0).activations < stage_breakdown(bf16, 0).activations


@pytest.mark.parametrize(("system", "recipe"), [("dgx-a100-80gb", "delayed"),
                                                ("dgx-h100", "mxfp8")])
def test_a_gpu_without_the_recipe_is_refused(system: str, recipe: str) -> None:
    with pytest.raises(ScenarioError, match=f"stack.fp8 = '{recipe}': system {system}") as e:
        scenario_from_dict(_scenario(system, fp8=recipe))
    # the systems it names are the bundled ones whose GPUs run the recipe
    runs = {"delayed": "(dgx-b200, dgx-h100, dgx-h200, gb200-nvl72, hgx-h800)",
            "mxfp8": "(dgx-b200, gb200-nvl72)"}[recipe]
    assert f"a system that runs {recipe} {runs}" in str(e.value)


def test_the_cli_says_so_in_one_line_with_exit_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    path = tmp_path / "a100.yaml"
    path.write_text(yaml.safe_dump(_scenario("dgx-a100-80gb", fp8="delayed")))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "stack.fp8" in err and "dgx-a100-80gb" in err and "stack.fp8: none" in err


def test_an_fp8_step_on_h100_is_faster_but_not_twice_as_fast() -> None:
    """Only the linears' GEMMs double their peak; attention, the memory-bound ops (now with
    casts), communication and the bubble do not."""
    fp8, bf16 = (simulate_scenario(scenario_from_dict(_scenario(fp8=r)), method="engine")[0]
                 for r in ("delayed", "none"))
    t8, t16 = fp8["step_time_s"], bf16["step_time_s"]
    assert t16 / 2 < t8 < t16


# ---------------------------------------------------------------- calibration


def _fp8_records(rate: float, device: str = "cuda") -> list[dict[str, Any]]:
    """FP8 GEMM records at ``rate`` FLOP/s, and bf16 ones at half of it."""
    out = []
    for i, n in enumerate((1024, 2048, 4096, 8192)):
        flops = 2.0 * n ** 3
        for kind, dtype, r in (("gemm", "bf16", rate / 2), ("gemm_fp8", "fp8", rate)):
            out.append({"key": f"{device}/{dtype}/t1/{kind}/{i}", "kind": kind, "ok": True,
                        "device": device, "dtype": dtype, "threads": 1, "m": n, "n": n, "k": n,
                        "flops": flops, "time_s": flops / r})
    return out


def _profile(records: list[dict[str, Any]], name: str) -> Any:
    from calibration.microbench.fit_profile import fit_compute
    from calibration.microbench.profile_build import build_profile

    fits = fit_compute(records, "cuda", "bf16", 1, name)
    base = load_system("dgx-h100")
    return fits, build_profile(fits, base, name="x", device="cuda", device_name=name,
                               gpus_per_node=8, memory_GB=None, provenance={},
                               datasheet=True)


def test_timed_fp8_gemms_give_the_fp8_curve_against_the_datasheet_peak() -> None:
    from calibration.microbench.fit_profile import well_quantised

    records = _fp8_records(1.2e15)
    fits, prof = _profile(records, "NVIDIA H100 80GB HBM3")
    assert fits.peak_tflops["fp8"] == 1979
    assert fits.fp8_gemm is not None
    top = max(e for _, e in fits.fp8_gemm.points)
    # each time net of its shape's quantisation on the preset's tiles (gemm_shape.py)
    timed = well_quantised([r for r in records if r["kind"] == "gemm_fp8"],
                           load_system("dgx-h100"))
    assert top == pytest.approx(max(r["flops"] / r["time_s"] for r in timed) / 1979e12,
                                rel=0.02)
    assert prof["gpu"]["fp8_gemm_efficiency"]["points"]
    assert set(prof["gpu"]["fp8_recipes"]) >= {"delayed", "current"}


def test_without_fp8_records_the_fit_keeps_no_fp8_curve() -> None:
    bf16 = [r for r in _fp8_records(1.2e15) if r["kind"] == "gemm"]
    fits, prof = _profile(bf16, "Some GPU 9")  # no datasheet: the measured bf16 peak only
    assert fits.fp8_gemm is None and "fp8" not in fits.peak_tflops
    assert prof["gpu"]["fp8_gemm_efficiency"] is None
    assert "gpu.fp8_gemm_efficiency" in prof["provenance"]["not_measured"]


def test_torch_cpu_runs_scaled_mm_and_a_build_without_it_is_skipped_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from calibration.microbench.bench_fp8 import fp8_support, run_fp8_gemm
    from calibration.microbench.bench_timing import Device

    cpu = Device("cpu")
    assert fp8_support(cpu) == (True, "")  # torch 2.13's CPU build runs _scaled_mm
    monkeypatch.delattr(torch, "_scaled_mm")
    ok, why = fp8_support(cpu)
    assert not ok and "_scaled_mm" in why
    assert run_fp8_gemm(cpu, None, None, []) == why  # type: ignore[arg-type]
    assert f"fp8 GEMMs: skipped ({why})" in capsys.readouterr().out


def test_a_gpu_before_ada_has_no_fp8_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from calibration.microbench.bench_fp8 import fp8_support
    from calibration.microbench.bench_timing import Device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 0))
    ok, why = fp8_support(Device("cuda"))
    assert not ok and "8.0" in why and "8.9" in why


def test_a_model_whose_experts_stay_16_bit_is_warned() -> None:
    from simulator.spec.rules import scenario_warnings

    moe = _scenario(fp8="delayed")
    moe["model"] = {**moe["model"], "experts": 8, "experts_per_token": 2}
    moe["parallel"] = {**moe["parallel"], "ep": 2}
    [warning] = [w for w in scenario_warnings(scenario_from_dict(moe)) if "stack.fp8" in w]
    assert "its router, run in bf16" in warning
    assert not [w for w in scenario_warnings(scenario_from_dict(_scenario(fp8="delayed")))
                if "stack.fp8" in w]


def _moe(recipe: str) -> Any:
    data = _scenario(fp8=recipe)
    data["model"] = {**data["model"], "experts": 8, "experts_per_token": 2}
    data["parallel"] = {**data["parallel"], "ep": 2}
    return scenario_from_dict(data)


def test_routed_experts_run_fp8_grouped_gemms_in_the_expert_pass() -> None:
    """TE's GroupedLinear: one FP8 GEMM per local expert, its input kept in FP8; the casts
    go with the experts to the ranks that hold them (the expert pass), not the layer's."""
    from simulator.model.moe import ROUTED_OPS
    from simulator.strategies.expert.layer import expert_layer

    s = _moe("delayed")
    layer = expert_layer(s)
    fwd = {op.name: op for op in layer.fwd}
    tokens, h = layer.tokens, 4096
    assert fwd["expert_up"].precision == "fp8" and fwd["expert_up"].kernels == 4
    assert fwd["expert_up"].saved == tokens * h  # 1 byte an element
    assert fwd["fp8_x_expert_up"].bytes == pytest.approx(cast_bytes("delayed", tokens * h))
    assert {"fp8_dy_expert_up", "fp8_dy_expert_down"} <= {op.name for op in layer.bwd_input}
    assert all(op.name in ROUTED_OPS for op in (*layer.fwd, *layer.bwd_input)
               if op.name.startswith("fp8_"))


def test_the_experts_fp8_weights_are_held_and_cast_once_per_step() -> None:
    fp8, bf16 = _moe("delayed"), _moe("none")
    h, q, kv, f = 4096, 4096, 1024, 14336
    attention = (h * (q + 2 * kv) + q * h) / 2  # TP 2
    experts = 8 // 2 * (h * 2 * f + f * h) / 2  # 4 local experts, expert TP 2
    extra = 2 * 2 * (attention + experts)  # 2 MoE layers on the first stage
    assert stage_breakdown(fp8, 0).weights - stage_breakdown(bf16, 0).weights == \
        pytest.approx(extra, rel=1e-12)
    step, plain = (mdl.optimizer_op_of(s, 1e6, [range(0, 2)], "experts") for s in (fp8, bf16))
    assert step.bytes - plain.bytes == pytest.approx(cast_bytes("delayed", 2 * experts),
                                                     rel=1e-12)
    assert step.kernels - plain.kernels == 2 * 2 * 4  # up and down of 4 experts, 2 layers
