"""Fused attention kernels on their own curves: the presets' points are the kernels'
published microbenchmarks over the datasheet peak, a call is priced by its kernel,
sequence length and head dimension, and the backward executes its recomputation.

The published figures (TFLOP/s of executed FLOPs, causal, batch × sequence = 16K
tokens, hidden 2048) are the oracles: FlashAttention-2's A100 and H100 forward +
backward bars (flash-attention README, ``assets/flash2_{a100,h100}_fwd_bwd_benchmark.png``,
panels c and d), and the FlashAttention-3 paper's H100 forward (Fig. 5, also
``assets/flash3_fp16_fwd.png``) and backward without mask (Fig. 6 c). flash-attn's
Triton kernel (``flash_attn_triton.py``) has no published benchmark: it runs on v1's
bars, as its docstring and llm-foundry's TUTORIAL.md place it beside v1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import ScenarioError
from simulator.model.inventory.attention import attention_core, attention_ops
from simulator.model.inventory.ops import (
    FLASH_BWD_KERNELS,
    FLASH_BWD_RECOMPUTE,
    Op,
    Pass,
    Shape,
    flash_scale,
)
from simulator.spec.load import scenario_from_dict
from simulator.system.attention_kernels import (
    AttentionCall,
    AttentionKernel,
    AttentionPass,
    selected_kernel,
)
from simulator.system.costs import CostModel
from simulator.system.profiles import load_system
from simulator.system.units import FusedAttention

SEQ = (512, 1024, 2048, 4096, 8192, 16384)
A100_FA2_FWD_BWD = {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)}
H100_FA2_FWD = {64: (180, 229, 262, 284, 295, 299), 128: (191, 260, 298, 319, 333, 335),
                256: (208, 251, 278, 293, 297, 298)}
H100_FA2_FWD_BWD = {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)}
H100_FA3_FWD = {64: (197, 265, 371, 420, 460, 473), 128: (292, 423, 521, 579, 602, 616),
                256: (286, 427, 537, 612, 628, 642)}
H100_FA3_FWD_UNMASKED_128 = (467, 565, 625, 638, 646, 648)
H100_FA3_BWD_UNMASKED_128 = (316, 424, 501, 542, 559, 561)
H100_CUDNN_FWD = {64: (225, 288, 334, 363, 379, 388), 128: (315, 410, 484, 518, 529, 539),
                  256: (308, 391, 450, 483, 497, 509)}
H100_CUDNN_FWD_UNMASKED_128 = (497, 574, 617, 609, 600, 595)
H100_CUDNN_BWD_UNMASKED_128 = (305, 408, 465, 499, 518, 516)
# the same README figures' "FlashAttention" (v1) bars, causal
A100_FA1_FWD_BWD = {64: (58, 70, 77, 87, 92, 97), 128: (55, 62, 69, 76, 80, 83)}
H100_FA1_FWD_BWD = {64: (104, 123, 136, 138, 149, 156), 128: (98, 109, 108, 126, 135, 137)}


def _bwd_from_fwd_bwd(fwd_bwd: tuple[int, ...], fwd: tuple[int, ...]) -> list[float]:
    """The backward's rate from the forward + backward's and the forward's: the pair
    executes 3.5 forwards' FLOPs, the backward 2.5, so t_b = 3.5/r_fb − 1/r_f."""
    return [2.5 / (3.5 / fb - 1.0 / f) for fb, f in zip(fwd_bwd, fwd, strict=True)]


def _causal(unmasked_bwd: tuple[int, ...], causal_fwd: tuple[int, ...],
            unmasked_fwd: tuple[int, ...]) -> list[float]:
    """A causal backward from the unmasked one and the kernel's own forward ratio."""
    return [b * min(c / u, 1.0)
            for b, c, u in zip(unmasked_bwd, causal_fwd, unmasked_fwd, strict=True)]


def _expect(kernel: AttentionKernel, pass_: str, table: Mapping[int, Sequence[float]],
            peak: float) -> None:
    curves = kernel.fwd if pass_ == "fwd" else kernel.bwd
    assert sorted(curves) == sorted(table)
    for dim, rates in table.items():
        assert curves[dim].points == tuple(
            (float(s), round(r / peak, 3)) for s, r in zip(SEQ, rates, strict=True))


def test_a100_presets_are_the_published_bars() -> None:
    for system in ("dgx-a100-80gb", "dgx-a100-40gb"):
        kernels = load_system(system).gpu.attention_kernels
        assert set(kernels) == {"flash2", "flash1", "flash_triton"}
        for pass_ in ("fwd", "bwd"):  # no split published: both passes on the pair's figure
            _expect(kernels["flash2"], pass_, A100_FA2_FWD_BWD, 312)
            _expect(kernels["flash1"], pass_, A100_FA1_FWD_BWD, 312)
            # flash_attn_triton.py: no published benchmark; its docstring puts it beside v1
            _expect(kernels["flash_triton"], pass_, A100_FA1_FWD_BWD, 312)


@pytest.mark.parametrize("system", ["dgx-h100", "dgx-h200", "hgx-h800"])
def test_hopper_presets_are_the_published_kernels(system: str) -> None:
    kernels = load_system(system).gpu.attention_kernels
    assert set(kernels) == {"flash2", "flash3", "cudnn", "flash1", "flash_triton"}
    for pass_ in ("fwd", "bwd"):
        _expect(kernels["flash1"], pass_, H100_FA1_FWD_BWD, 989)
        _expect(kernels["flash_triton"], pass_, H100_FA1_FWD_BWD, 989)
    _expect(kernels["flash2"], "fwd", H100_FA2_FWD, 989)
    _expect(kernels["flash2"], "bwd", {d: _bwd_from_fwd_bwd(H100_FA2_FWD_BWD[d], H100_FA2_FWD[d])
                                       for d in (64, 128)}, 989)
    _expect(kernels["flash3"], "fwd", H100_FA3_FWD, 989)
    _expect(kernels["flash3"], "bwd", {128: _causal(H100_FA3_BWD_UNMASKED_128, H100_FA3_FWD[128],
                                                    H100_FA3_FWD_UNMASKED_128)}, 989)
    _expect(kernels["cudnn"], "fwd", H100_CUDNN_FWD, 989)
    _expect(kernels["cudnn"], "bwd", {128: _causal(H100_CUDNN_BWD_UNMASKED_128,
                                                   H100_CUDNN_FWD[128],
                                                   H100_CUDNN_FWD_UNMASKED_128)}, 989)


def test_flashattention2_on_h100_runs_at_about_a_third_of_peak() -> None:
    """The FlashAttention-3 paper's abstract: FlashAttention-2 reaches only 35% of the
    H100's peak; FA3 up to 75% (head dim 256, unmasked, beyond these causal tables)."""
    k = load_system("dgx-h100").gpu.attention_kernels
    assert 0.30 <= k["flash2"].efficiency("fwd", 16384, 128) <= 0.35
    assert k["flash3"].efficiency("fwd", 16384, 256) > 0.6


def test_head_dimension_interpolates_in_log2_and_clamps() -> None:
    k = load_system("dgx-h100").gpu.attention_kernels["flash2"]
    lo, hi = k.efficiency("fwd", 2048, 64), k.efficiency("fwd", 2048, 128)
    w = math.log2(96 / 64)
    assert k.efficiency("fwd", 2048, 96) == pytest.approx((1 - w) * lo + w * hi, rel=1e-12)
    assert k.efficiency("fwd", 2048, 32) == lo
    assert k.efficiency("bwd", 2048, 256) == k.efficiency("bwd", 2048, 128)  # bwd: 64, 128


def _scenario(stack: dict[str, object], system: str = "dgx-h100", **model: object) -> Any:
    return scenario_from_dict({
        "name": "t", "model": {"preset": "llama2-7b", **model},
        "cluster": {"system": system, "nodes": 1, "gpus_per_node": 8},
        "parallel": {"dp": 8}, "training": {"global_batch": 8, "micro_batch": 1},
        "stack": stack})


def _core(s: Any, pass_: Pass) -> Op:
    ops = attention_ops(Shape(s.model, s.training.micro_batch, 1, False, 2, s.stack), pass_)
    return next(op for op in ops if op.name == "attn_core")


def test_a_call_is_priced_at_its_kernels_published_rate() -> None:
    """llama2-7b (head dim 128) at 4096: FlashAttention-2's forward at 319 TFLOP/s of
    executed FLOPs, FlashAttention-3's at 579, cuDNN's at 518."""
    for kernel, rate in (("flash2", 319), ("flash3", 579), ("cudnn", 518)):
        s = _scenario({"preset": "megatron-core", "attention": kernel})
        op = _core(s, "fwd")
        assert op.attn == AttentionCall(kernel, 4096, 128)
        cost = CostModel(s.hardware, "bf16")
        executed = op.flops * 0.5
        assert cost.op_parts(op)[0] == pytest.approx(executed / (round(rate / 989, 3) * 989e12),
                                                     rel=1e-12)


def test_flashattention_in_triton_is_priced_at_flashattention_v1s_bars() -> None:
    """llm-foundry's ``attn_impl: triton`` (flash-attn's ``flash_attn_triton.py``) has no
    published benchmark; its docstring finds its forward + backward "slightly slower" than
    FlashAttention v1's, llm-foundry's TUTORIAL.md "slightly faster": at head dim 64 and
    2K both passes run at v1's bar, 77 TFLOP/s of executed FLOPs on an A100 (where
    FlashAttention-2 reaches 140) and 136 on an H100."""
    model = {"hidden": 2048, "heads": 32, "seq_len": 2048}  # head dim 64
    for system, peak, rate in (("dgx-a100-80gb", 312, 77), ("dgx-h100", 989, 136)):
        cores = {kernel: {pass_: _core(_scenario({"preset": "composer-fsdp1",
                                                  "attention": kernel}, system, **model), pass_)
                          for pass_ in ("fwd", "bwd_input")}
                 for kernel in ("flash_triton", "flash2")}
        cost = CostModel(load_system(system), "bf16")
        for op in cores["flash_triton"].values():
            assert op.attn == AttentionCall("flash_triton", 2048, 64)
            executed = op.flops * op.compute_scale
            assert cost.op_parts(op)[0] == pytest.approx(
                executed / (round(rate / peak, 3) * peak * 1e12), rel=1e-12)
        assert cost.op_parts(cores["flash_triton"]["fwd"])[0] > \
            1.5 * cost.op_parts(cores["flash2"]["fwd"])[0]


def test_the_triton_backward_launches_its_four_kernels() -> None:
    """``_flash_attn_backward`` (flash_attn_triton.py as llm-foundry copied it):
    ``_bwd_preprocess_do_o_dot``, the fp32 dq accumulator's ``zero_()`` (the autotune
    pre_hook ``init_to_zero('DQ')``), ``_bwd_kernel`` and ``dq.copy_(dq_accum)``; the
    forward one ``_fwd_kernel``."""
    s = _scenario({"preset": "composer-fsdp1", "attention": "flash_triton"}, "dgx-a100-80gb")
    assert FLASH_BWD_KERNELS["flash_triton"] == 4
    assert _core(s, "bwd_input").kernels == 4 and _core(s, "fwd").kernels == 1
    flash2 = _scenario({"preset": "composer-fsdp1", "attention": "flash2"}, "dgx-a100-80gb")
    assert _core(flash2, "bwd_input").kernels == 3


def test_the_backward_executes_five_gemms_of_the_forwards_two() -> None:
    """Counted at twice the forward, a fused backward executes 2.5 times it (it
    recomputes QKᵀ); on equal curves it takes 2.5 times the forward's time."""
    assert flash_scale("fwd") == 0.5 and flash_scale("bwd_input") == 0.5 * 1.25
    assert FLASH_BWD_RECOMPUTE == 1.25
    s = _scenario({"preset": "megatron-core", "attention": "flash2"}, system="dgx-a100-80gb")
    cost = CostModel(s.hardware, "bf16")
    fwd, bwd = _core(s, "fwd"), _core(s, "bwd_input")
    assert bwd.flops == 2 * fwd.flops
    assert cost.op_parts(bwd)[0] / cost.op_parts(fwd)[0] == pytest.approx(2.5, rel=1e-12)


def test_a_calibrated_class_curve_wins_and_a_kernel_without_a_table_falls_back() -> None:
    from simulator.system.curves import EfficiencyCurve

    hw = load_system("dgx-a100-80gb")
    call = AttentionCall("flash3", 4096, 128)  # FlashAttention-3 does not run on an A100
    assert hw.gpu.efficiency("attention_fwd", 1e11, call) == hw.gpu.attention_efficiency(1e11)
    measured = EfficiencyCurve(points=((1e9, 0.2),))
    gpu = hw.gpu.model_copy(update={"class_efficiency": {"attention_fwd": measured}})
    assert gpu.efficiency("attention_fwd", 1e11, AttentionCall("flash2", 4096, 128)) == 0.2


def test_context_parallel_cores_run_the_stacks_kernel_on_their_chunk() -> None:
    from simulator.model.inventory.attention import context_parallel_ops

    s = _scenario({"preset": "megatron-core", "attention": "cudnn"})
    local = s.model.model_copy(update={"seq_len": 1024})
    out = context_parallel_ops((_core(s, "fwd"),), local, 1, 1, "bf16", "fwd", 4)
    assert out[0].attn == AttentionCall("cudnn", 1024, 128) and out[0].kernels == 4
    unfused = Op("attn_scores", "gemm", 1.0, 1.0, 1.0)
    core = context_parallel_ops((unfused,), local, 1, 1, "bf16", "fwd", 4)[0]
    assert core.attn == AttentionCall("flash2", 1024, 128)
    assert attention_core(local, 1, 1, 2, "bwd_input", 4, "flash3").kernels == 12


def test_the_stack_names_the_kernel_and_a_profile_is_checked() -> None:
    with pytest.raises(ScenarioError, match=r"stack\.attention"):
        _scenario({"preset": "megatron-core", "attention": "flash4"})
    gpu = load_system("dgx-h100").gpu
    curve = {"points": [[512, 0.3]]}
    with pytest.raises(ValueError, match="unknown attention kernel 'flash5'"):
        type(gpu).model_validate({**gpu.model_dump(),
                                  "attention_kernels": {"flash5": {"fwd": {128: curve},
                                                                   "bwd": {128: curve}}}})
    with pytest.raises(ValueError, match="head dimension 0"):
        AttentionKernel.model_validate({"fwd": {0: curve}, "bwd": {128: curve}})
    flash2 = gpu.attention_kernels["flash2"]  # a JSON dump's string keys read back
    assert AttentionKernel.model_validate(flash2.model_dump(mode="json")) == flash2


@settings(max_examples=60, deadline=None)
@given(seq=st.sampled_from((256, 512, 1024, 2048, 4096, 8192, 16384, 65536)),
       dim=st.sampled_from((64, 80, 96, 128, 192, 256)),
       kernel=st.sampled_from(("flash2", "flash3", "cudnn")))
def test_a_longer_sequence_never_runs_a_causal_kernel_slower_per_flop(
        seq: int, dim: int, kernel: FusedAttention) -> None:
    """Causal kernels' published rates rise with the sequence (more blocks per row, a
    smaller share on the diagonal): per executed FLOP a longer call is never slower,
    and between head dimensions the rate lies between its neighbours'. (FlashAttention
    v1's published bars, on which the Triton kernel runs too, dip by a few percent here
    and there, e.g. on the H100 at head dim 128: 109 TFLOP/s at 1K, 108 at 2K; their
    curves keep the bars as published.)"""
    k = load_system("dgx-h100").gpu.attention_kernels[kernel]
    passes: tuple[AttentionPass, ...] = ("fwd", "bwd")
    for pass_ in passes:
        assert k.efficiency(pass_, 2 * seq, dim) >= k.efficiency(pass_, seq, dim)
        dims = sorted(k.fwd if pass_ == "fwd" else k.bwd)
        vals = [k.efficiency(pass_, seq, d) for d in dims]
        assert min(vals) - 1e-12 <= k.efficiency(pass_, seq, dim) <= max(vals) + 1e-12


def test_transformer_engines_choice_is_cudnn_from_hopper_on_and_flash2_before() -> None:
    """TE's ``get_attention_backend`` prefers cuDNN's fused attention on sm90 and later
    where both run, FlashAttention before; megatron-core says ``te``."""
    assert selected_kernel("te", "9.0") == "cudnn" and selected_kernel("te", "10.0") == "cudnn"
    assert selected_kernel("te", "8.0") == "flash2" and selected_kernel("te", None) == "flash2"
    assert selected_kernel("flash3", "8.0") == "flash3"  # a named kernel is itself
    assert load_system("dgx-h100").gpu.compute_capability == "9.0"
    assert load_system("dgx-a100-80gb").gpu.compute_capability == "8.0"
    for system, kernel in (("dgx-h100", "cudnn"), ("dgx-a100-80gb", "flash2")):
        s = _scenario({"preset": "megatron-core"}, system=system)
        assert s.stack.attention == "te"
        op = _core(s, "fwd")
        gpu = s.hardware.gpu
        assert gpu.efficiency("attention_fwd", op.gemm_flops, op.attn) == \
            gpu.attention_kernels[kernel].efficiency("fwd", 4096, 128)


def test_a_compute_capability_is_checked() -> None:
    gpu = load_system("dgx-h100").gpu
    for bad in ("9", "sm90", "9.0.1", ""):
        with pytest.raises(ValueError, match="compute_capability"):
            type(gpu).model_validate({**gpu.model_dump(), "compute_capability": bad})
