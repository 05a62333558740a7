"""FP8 in a latent-attention mixture of experts (``stack.fp8``, DeepSeek-V3's tile-wise FP8,
arXiv:2412.19437 §3.3): MLA's five projections and a dense layer's MLP run FP8 GEMMs with
their casts, their inputs kept at 1 byte, their weights' FP8 copies held; the routed
experts' likewise (their GEMMs in the expert pass, tests/test_fp8.py); the router and the
shared experts stay 16-bit. Closed forms for the kept bytes and the weight workspace, and
a property: FP8 never raises a layer's kept bytes nor slows a GEMM-bound layer.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.memory import stage_breakdown
from simulator.api import simulate_scenario
from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.model.inventory.fp8 import cast_bytes
from simulator.model.inventory.ops import Op
from simulator.model.memory import activation_bytes_per_layer
from simulator.spec.load import scenario_from_dict
from simulator.spec.model_spec import ModelSpec, load_preset_model
from simulator.spec.stack import StackSpec
from simulator.system.costs import CostModel
from simulator.system.profiles import load_system

H, HEADS, F, FE, E = 256, 8, 512, 128, 8
QL, KVL, NOPE, ROPE, DV = 96, 64, 32, 16, 32
MODEL = {"layers": 4, "hidden": H, "heads": HEADS, "kv_heads": HEADS, "ffn_hidden": F,
         "activation": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False,
         "vocab": 1024, "seq_len": 128, "experts": E, "experts_per_token": 2,
         "expert_ffn_hidden": FE, "shared_experts": 1, "first_dense_layers": 1,
         "mla": {"q_lora_rank": QL, "kv_lora_rank": KVL, "qk_nope_head_dim": NOPE,
                 "qk_rope_head_dim": ROPE, "v_head_dim": DV}}
SPEC = ModelSpec.model_validate(MODEL)
DSV3 = load_preset_model("deepseek-v3")
MIXTRAL = load_preset_model("mixtral-8x7b")
LINEARS = ("q_down", "q_up", "kv_down", "kv_up", "out_proj")


def _stack(recipe: str = "delayed", **extra: Any) -> StackSpec:
    return StackSpec.model_validate({"preset": "megatron-core", "fp8": recipe, **extra})


def _ops(recipe: str, pass_: str = "fwd", layer: int = 1, tp: int = 2,
         sp: bool = True) -> dict[str, Op]:
    ops = moe.layer_ops(SPEC, 2, tp, sp, "bf16", pass_, layer,  # type: ignore[arg-type]
                        stack=_stack(recipe))
    return {op.name: op for op in ops}


def _scenario(recipe: str) -> Any:
    return scenario_from_dict({
        "name": "fp8-mla", "model": MODEL, "cluster": {"system": "dgx-h100", "nodes": 1},
        "parallel": {"tp": 2, "pp": 2, "dp": 2, "ep": 2, "sequence_parallel": True,
                     "zero": 1},
        "training": {"global_batch": 16, "micro_batch": 2},
        "stack": {"preset": "megatron-core", "attention_dropout": 0.0, "hidden_dropout": 0.0,
                  "fp8": recipe}})


def test_mla_projections_run_fp8_gemms_with_their_casts() -> None:
    """Each of the five a Transformer Engine linear: its input cast (the local shard of
    the normed tokens for the two down-projections, each its own), its output gradient
    cast before the dgrad; the router and the shared experts stay 16-bit."""
    fwd, bwd = _ops("delayed"), _ops("delayed", "bwd_input")
    T, L = 2 * 128, 2 * 128 / 2
    assert all(fwd[n].precision == "fp8" for n in (*LINEARS, "expert_up", "expert_down"))
    assert fwd["router"].precision != "fp8" and fwd["shared_up"].precision != "fp8"
    for name, elements in (("q_down", L * H), ("kv_down", L * H), ("q_up", T * QL),
                           ("kv_up", T * KVL), ("out_proj", T * HEADS / 2 * DV)):
        assert fwd[f"fp8_x_{name}"].bytes == pytest.approx(cast_bytes("delayed", elements))
        assert f"fp8_dy_{name}" in bwd
    dense = _ops("delayed", layer=0)
    assert dense["mlp_up"].precision == dense["mlp_down"].precision == "fp8"
    assert "fp8_x_q_down" not in _ops("none")


def _kept(recipe: str, layer: int, recompute: str = "none", spec: ModelSpec = SPEC,
          b: int = 2, tp: int = 2, sp: bool = True) -> float:
    return activation_bytes_per_layer(spec, b, tp, sp, recompute, "bf16",  # type: ignore[arg-type]
                                      layer, stack=_stack(recipe))


@pytest.mark.parametrize("recompute", ["none", "selective:layernorm,mla_up_proj"])
def test_the_fp8_inputs_each_layer_keeps(recompute: str) -> None:
    """1 byte instead of 2 for a dense layer's MLP up input (L·h) and down input (T·f/t),
    a MoE layer's routed experts' inputs (k·T·h and k·T·f_e/t); the normed tokens the two
    down-projections each keep in FP8 weigh what the one 16-bit copy did; the out-proj's
    FP8 input is 1 byte more (T·H·d_v/t): the fused core keeps its 16-bit output for its
    own backward beside it (TE's FusedAttnFunc saves out_f16). Recomputing the norms
    drops the MLP's normed input in either precision; recomputing the up-projections (Q,
    K, V) leaves the rest."""
    T, L, routed = 2 * 128, 2 * 128 / 2, 2 * 2 * 128
    out_proj = -T * HEADS * DV / 2
    dense = out_proj + L * H + T * F / 2
    experts = out_proj + routed * H + routed * FE / 2
    if recompute != "none":  # the MLP's normed input goes with the norm's recomputation
        dense -= L * H  # (in either precision); the out-proj's input stays
    for layer, saving in ((0, dense), (1, experts)):
        got = _kept("none", layer, recompute) - _kept("delayed", layer, recompute)
        assert got == pytest.approx(saving, rel=1e-12), layer


def test_recomputing_the_experts_activation_drops_its_fp8_output() -> None:
    """``moe_act``: the activation re-runs, so the down-projection's kept input goes, 1
    byte an element under FP8 (k·T·f_e/t), 2 in 16 bits; its own input stays."""
    routed = 2 * 2 * 128
    for recipe, bytes_ in (("none", 2), ("delayed", 1)):
        dropped = _kept(recipe, 1) - _kept(recipe, 1, "selective:moe_act")
        assert dropped == pytest.approx(bytes_ * routed * FE / 2, rel=1e-12), recipe


def test_the_fp8_weight_workspace_holds_mla_dense_and_expert_weights() -> None:
    """Row-wise and column-wise FP8 copies (2 bytes) of every FP8 linear weight of the
    first stage (layer 0 dense, layer 1 MoE; TP 2, EP 2, expert TP 2), cast once a step
    with the optimizer: one cast per weight tensor (Megatron's experts: one per expert)."""
    fp8, bf16 = _scenario("delayed"), _scenario("none")
    assert fp8.parallel.etp == 2
    mla = H * QL + QL * HEADS * (NOPE + ROPE) / 2 + H * (KVL + ROPE) \
        + KVL * HEADS * (NOPE + DV) / 2 + HEADS * DV * H / 2
    mlp = H * 2 * F / 2 + F / 2 * H
    experts = E // 2 * (H * 2 * FE / 2 + FE / 2 * H)
    extra = 2 * (2 * mla + mlp + experts)
    assert stage_breakdown(fp8, 0).weights - stage_breakdown(bf16, 0).weights == \
        pytest.approx(extra, rel=1e-12)
    step, plain = (mdl.optimizer_op_of(s, 1e6, [range(0, 2)], "all") for s in (fp8, bf16))
    assert step.bytes - plain.bytes == pytest.approx(
        cast_bytes("delayed", 2 * mla + mlp + experts), rel=1e-12)
    assert step.kernels - plain.kernels == 5 * 2 + 2 + 2 * (E // 2)  # modules: per expert


def test_the_estimate_and_the_engine_agree_on_an_fp8_mla_step() -> None:
    fp8, bf16 = _scenario("delayed"), _scenario("none")
    engine, _ = simulate_scenario(fp8, "engine")
    analytic, _ = simulate_scenario(fp8, "analytic")
    assert analytic["step_time_s"] == pytest.approx(engine["step_time_s"], rel=0.05)
    assert engine["step_time_s"] != simulate_scenario(bf16, "engine")[0]["step_time_s"]


def _time(ops: tuple[Op, ...]) -> float:
    """The layer's own ops (the routed experts are the expert pass's, on the ranks that
    hold them: tests/test_fp8.py)."""
    cost = CostModel(load_system("hgx-h800"), "bf16")
    return sum(cost.op_time(op) for op in ops if op.name not in moe.ROUTED_OPS)


@settings(max_examples=50, deadline=None)
@given(recipe=st.sampled_from(["delayed", "current", "blockwise"]),
       b=st.integers(1, 4), tp=st.sampled_from([1, 2, 4, 8]), sp=st.booleans(),
       model=st.sampled_from([(DSV3, 0), (DSV3, 3), (MIXTRAL, 0)]),
       recompute=st.sampled_from(["none", "selective", "selective:layernorm,mla_up_proj",
                                  "selective:moe_act", "selective:layernorm"]))
def test_fp8_never_keeps_more_nor_slows_a_gemm_bound_layer(
        recipe: str, b: int, tp: int, sp: bool, model: tuple[ModelSpec, int],
        recompute: str) -> None:
    """DeepSeek-V3's layers (a dense one, a MoE one) and Mixtral's (standard attention;
    GEMM-bound at their widths): FP8 keeps at most what 16 bits keep, and each pass of
    the layer's own ops (with the casts) takes no longer."""
    spec, layer = model
    assert _kept(recipe, layer, recompute, spec, b, tp, sp) <= \
        _kept("none", layer, recompute, spec, b, tp, sp)
    if spec.mla is None and tp > 2:
        return  # Mixtral's attention projections split 8 ways (768 and 512 columns) are
        # not GEMM-bound: current scaling's amax pass can cost more than FP8 saves there
    for pass_ in ("fwd", "bwd_input", "bwd_weight"):
        fp8, bf16 = (moe.layer_ops(spec, b, tp, sp, "bf16", pass_, layer,  # type: ignore[arg-type]
                                   stack=_stack(r)) for r in (recipe, "none"))
        assert _time(fp8) <= _time(bf16)
