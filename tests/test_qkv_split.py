"""The backward of a fused QKV projection split into views (``stack.qkv_grad_cat``).

llm-foundry's MPT runs one ``Wqkv`` GEMM and splits its output into q, k and v views
(layers/attention.py ``GroupedQueryAttention.forward``: ``qkv.split(...)``); the
attention's backward returns dQ, dK and dV as three tensors (flash_attn_triton.py
``FlashAttnFunc.backward``: ``torch.empty_like`` each), and autograd's
``split_with_sizes_backward`` concatenates them into d(qkv) before the projection's
dgrad: one ``cat`` that reads and writes T·(q + 2kv) elements.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_published import DEV_SET

from simulator.api import simulate_scenario
from simulator.model.inventory.dense import dense_layer_ops
from simulator.spec.load import scenario_from_dict


def _scenario(stack: dict[str, Any], kv_heads: int = 8, micro_batch: int = 3) -> Any:
    return scenario_from_dict({
        "name": "t", "model": {"preset": "llama2-7b", "layers": 2, "hidden": 4096, "heads": 32,
                               "kv_heads": kv_heads, "seq_len": 1024, "ffn_hidden": 11008,
                               "position": "learned"},  # MPT's: no rotary kernels
        "cluster": {"system": "dgx-h100", "nodes": 1, "gpus_per_node": 8},
        "parallel": {"dp": 8, "zero": 3},
        "training": {"global_batch": 8 * micro_batch, "micro_batch": micro_batch},
        "stack": stack})


def _names(s: Any, pass_: str) -> list[str]:
    return [op.name for op in dense_layer_ops(s.model, s.training.micro_batch, 1, False,
                                              "bf16", pass_, s.stack)]  # type: ignore[arg-type]


def test_the_split_backward_concatenates_dq_dk_dv() -> None:
    """GQA (32 query heads, 8 KV heads of 128): the cat reads and writes 3·1024 tokens of
    4096 + 2·1024 elements in bf16, one kernel, between the attention's backward and the
    QKV projection's dgrad; nothing in the forward or the weight gradients."""
    s = _scenario({"preset": "composer-fsdp1", "attention": "flash_triton"})
    assert s.stack.qkv_grad_cat
    ops = dense_layer_ops(s.model, 3, 1, False, "bf16", "bwd_input", s.stack)
    names = [op.name for op in ops]
    [cat] = [op for op in ops if op.name == "qkv_grad_cat"]
    assert names.index("attn_core") + 1 == names.index("qkv_grad_cat") == names.index("qkv") - 1
    assert cat.bytes == 2 * 2 * (3 * 1024) * (4096 + 2 * 8 * 128)
    assert (cat.kind, cat.kernels, cat.flops, cat.saved) == ("memory", 1, 0.0, 0.0)
    for pass_ in ("fwd", "bwd_weight"):
        assert "qkv_grad_cat" not in _names(s, pass_)


@pytest.mark.parametrize("attention", ["flash_triton", "flash2", "unfused"])
def test_every_llm_foundry_attention_path_concatenates(attention: str) -> None:
    """The split is before the attention whichever ``attn_impl`` runs (the flash path's
    unpad gradients and the torch path's matmul gradients are separate tensors too)."""
    s = _scenario({"preset": "composer-fsdp1", "attention": attention})
    assert _names(s, "bwd_input").count("qkv_grad_cat") == 1


def test_no_concatenation_without_the_field_or_without_a_fused_projection() -> None:
    """Megatron Core's preset does not set it; separate q, k and v GEMMs take their own
    gradients (autograd sums their input gradients instead: ``qkv_grad_sum``)."""
    assert "qkv_grad_cat" not in _names(_scenario({"preset": "megatron-core"}), "bwd_input")
    apart = _scenario({"preset": "composer-fsdp1", "fusions": ["bias_gemm"]})
    assert apart.stack.qkv_grad_cat and "qkv_grad_cat" not in _names(apart, "bwd_input")
    assert "qkv_grad_sum" in _names(apart, "bwd_input")


def test_the_llm_foundry_rows_concatenate_and_pay_for_it() -> None:
    """A development-set triton row runs the cat; the same row without it is faster on
    the compute stream by the cat's time (closed form)."""
    from simulator.published.mapping import scenario_data
    from simulator.published.rows import read_rows

    [row] = [r for r in read_rows(DEV_SET)
             if r.name == "llmfoundry_h100_bf16_mpt1b_seq2048_64gpu_mbs20_ga1"]
    s = scenario_from_dict(scenario_data(row))
    assert s.stack.attention == "flash_triton" and s.stack.qkv_grad_cat
    without = s.model_copy(update={"stack": s.stack.model_copy(update={"qkv_grad_cat": False})})
    with_cat, plain = (simulate_scenario(x, "analytic")[0] for x in (s, without))
    assert sum(with_cat["compute_s"]) > sum(plain["compute_s"])
    assert with_cat["step_time_s"] >= plain["step_time_s"] * (1 - 1e-12)
