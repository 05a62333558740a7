"""DeepSeek-V3's low-precision activations (``stack.fp8_cache: deepseek``; arXiv:2412.19437
§3.3.3): the input of the linear after the attention kept once in the 12-bit E5M6 format
(1.5 bytes; the attention's backward reads that copy too), the routed experts' SwiGLU
inputs in FP8 (1 byte), their output recomputed under ``recompute_modules: [moe_act]``.

Closed forms for what a latent-attention layer (dense and MoE) and a standard-attention MoE
layer keep, the memory model reading exactly the inventory's kept bytes, and the bundled
DeepSeek-V3 run with the report's two low-precision stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from simulator.analysis.memory import memory_report
from simulator.model import moe
from simulator.model.inventory.experts import routed_tokens
from simulator.model.inventory.fp8 import E5M6_BYTES
from simulator.model.memory import activation_bytes_per_layer
from simulator.spec.load import load_scenario
from simulator.spec.model_spec import ModelSpec, load_preset_model
from simulator.spec.stack import StackSpec

DSV3 = load_preset_model("deepseek-v3")
MIXTRAL = load_preset_model("mixtral-8x7b")
SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "deepseek-v3-2048xh800.yaml"


def _stack(cache: str) -> StackSpec:
    return StackSpec.model_validate({"preset": "megatron-core", "fp8": "blockwise",
                                     "fp8_cache": cache})


def _kept(spec: ModelSpec, layer: int, cache: str, recompute: str = "none", b: int = 1,
          tp: int = 1) -> float:
    return activation_bytes_per_layer(spec, b, tp, False, recompute, "bf16",  # type: ignore[arg-type]
                                      layer, stack=_stack(cache))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective:layernorm,mla_up_proj,moe_act"])
def test_deepseek_v3s_layers_keep_e5m6_attention_outputs_and_fp8_swiglu_inputs(
        tp: int, recompute: str) -> None:
    """Against FP8 linears that keep their inputs' FP8 copies: the out-proj's input
    (T·H·d_v/t elements) 1.5 bytes less (E5M6's 12 bits, once, serving both backwards,
    where the default keeps the core's 16-bit output and the out-proj's 1-byte copy), a
    MoE layer's routed SwiGLU inputs (2·k·T·f_e/t) a byte less; whatever the layer
    recomputes (the norms, the up-projections, the SwiGLU output)."""
    mla, T = DSV3.mla, DSV3.seq_len
    assert mla is not None
    attn_out = T * DSV3.heads * mla.v_head_dim / tp
    swiglu_in = 2 * routed_tokens(DSV3, T, padded=True) * DSV3.expert_ffn / tp
    for layer, want in ((0, (E5M6_BYTES - 3) * attn_out),
                        (3, (E5M6_BYTES - 3) * attn_out - (2 - 1) * swiglu_in)):
        got = _kept(DSV3, layer, "deepseek", recompute, tp=tp) \
            - _kept(DSV3, layer, "linear_inputs", recompute, tp=tp)
        assert got == pytest.approx(want, rel=1e-12), layer


def test_with_the_swiglu_output_recomputed_its_inputs_are_all_the_experts_activation_keeps(
) -> None:
    """``moe_act`` drops the SwiGLU output's FP8 copy (k·T·f_e/t): under DeepSeek-V3's
    caching the routed experts' activation then keeps its two inputs at 1 byte each."""
    ops = moe.layer_ops(DSV3, 1, 1, False, "bf16", "fwd", 3, stack=_stack("deepseek"))
    act = next(op.saved for op in ops if op.name == "expert_act")
    routed = routed_tokens(DSV3, DSV3.seq_len, padded=True)
    assert act == (2 + 1) * routed * DSV3.expert_ffn  # inputs and the output's FP8 copy
    dropped = _kept(DSV3, 3, "deepseek") - _kept(DSV3, 3, "deepseek", "selective:moe_act")
    assert dropped == routed * DSV3.expert_ffn


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_standard_attention_moe_layer_caches_the_same_two_tensors(tp: int) -> None:
    """Mixtral's layer (standard attention): the out-proj's input in E5M6 and the routed
    experts' SwiGLU inputs in FP8, read from the inventory's ops by the memory model."""
    T, layer = MIXTRAL.seq_len, 0
    ops = {c: moe.layer_ops(MIXTRAL, 1, tp, False, "bf16", "fwd", layer, stack=_stack(c))
           for c in ("linear_inputs", "deepseek")}
    for cache, fwd in ops.items():
        assert _kept(MIXTRAL, layer, cache, tp=tp) == pytest.approx(
            sum(op.saved for op in fwd), rel=1e-12)
    saved = {c: {op.name: op.saved for op in fwd} for c, fwd in ops.items()}
    q = MIXTRAL.heads * MIXTRAL.head_size / tp
    assert saved["deepseek"]["out_proj"] == E5M6_BYTES * T * q
    assert saved["linear_inputs"]["out_proj"] == 1 * T * q
    # the fused core keeps its 16-bit output for its own backward beside the out-proj's
    # FP8 copy (TE's FusedAttnFunc: out_f16); DeepSeek-V3's one E5M6 copy serves both
    assert saved["linear_inputs"]["attn_core"] - saved["deepseek"]["attn_core"] == \
        pytest.approx(2 * T * q, rel=1e-12)
    routed = routed_tokens(MIXTRAL, T, padded=True)
    assert saved["deepseek"]["expert_act"] == 2 * routed * MIXTRAL.expert_ffn / tp * 1
    assert saved["linear_inputs"]["expert_act"] == 2 * routed * MIXTRAL.expert_ffn / tp * 2


def _with(s: Any, **stack: Any) -> Any:
    return s.model_copy(update={"stack": s.stack.model_copy(update=stack)})


def test_the_bundled_deepseek_v3_run_with_the_reports_low_precision_stores() -> None:
    """BF16 moments and DeepSeek-V3's caching together: every stage's optimizer item is 2/3
    of the fp32 moments' and its activations fall; the middle ranks (model stages r and
    15 − r, 4 MoE layers each) then fit in 80 GB, the end ranks (embedding, 3 dense
    layers, 2 MoE layers, the MTP module and the output layer with its logits) do not."""
    low = load_scenario(SCENARIO)  # the scenario states the report's stores
    assert (low.stack.exp_avg_dtype, low.stack.exp_avg_sq_dtype, low.stack.fp8_cache) == (
        "bf16", "bf16", "deepseek")
    s = _with(low, exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32", fp8_cache="linear_inputs")
    before, after = memory_report(s), memory_report(low)
    for a, b in zip(before, after, strict=True):
        assert b.optimizer == pytest.approx(a.optimizer * 8 / 12, rel=1e-12)
        assert b.activations < a.activations
        assert (b.weights, b.gradients, b.logits) == (a.weights, a.gradients, a.logits)
    assert [m.fits for m in before] == [False] * 16
    assert [m.fits for m in after] == [False] + [True] * 14 + [False]
