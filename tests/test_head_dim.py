"""A head width apart from hidden / heads (``model.head_dim``: Qwen3, Gemma, GPT-OSS).

The query projection writes heads x head_dim and the output projection reads it back
into the hidden-wide residual stream; keys and values are kv_heads x head_dim. Left
out, head_dim is hidden / heads and nothing moves (every bundled figure is pinned by
tests/test_golden_scenarios.py); set apart, parameters, FLOPs, bytes and kept
activations follow the attention's own width.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import ScenarioError
from simulator.model.transformer import (
    embedding_params,
    head_params,
    layer_ops,
    layer_params,
    param_count,
)
from simulator.published.mapping import scenario_data
from simulator.published.rows import Row
from simulator.spec.load import scenario_from_dict
from simulator.spec.model_spec import ModelSpec, load_preset_model
from simulator.spec.rules import consistency_problems
from simulator.strategies.compression.arithmetic import layer_shapes

QWEN = {"layers": 2, "hidden": 5120, "heads": 64, "kv_heads": 8, "head_dim": 128,
        "ffn_hidden": 25600, "vocab": 151936, "seq_len": 4096, "activation": "swiglu",
        "norm": "rmsnorm", "bias": False, "tied_embeddings": False, "position": "rope"}


def test_left_out_it_is_hidden_over_heads() -> None:
    spec = ModelSpec(layers=2, hidden=4096, heads=32, vocab=1000, seq_len=128)
    assert spec.head_dim == spec.head_size == 128 and spec.q_width == 4096


def test_qwen3_32b_counts_the_model_cards_parameters() -> None:
    """Qwen3-32B's model card: 32.8B parameters, 31.2B without the embeddings; with
    the query and output projections 5120 wide instead of 8192 it would be 29.2B."""
    spec = load_preset_model("qwen3-32b")
    assert spec.q_width == 8192 != spec.hidden
    non_embedding = param_count(spec) - embedding_params(spec) - spec.vocab * spec.hidden
    assert non_embedding / 1e9 == pytest.approx(31.2, abs=0.05)
    assert param_count(spec) / 1e9 == pytest.approx(32.8, abs=0.05)
    assert head_params(spec) == spec.hidden + spec.vocab * spec.hidden  # untied


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_projections_and_core_take_the_attention_width(tp: int) -> None:
    spec = ModelSpec(**QWEN)
    b, s, h, q, kv = 1, spec.seq_len, spec.hidden, spec.q_width / tp, spec.kv / tp * 128
    ops = {op.name: op for op in layer_ops(spec, b, tp, False, "bf16", "fwd")}
    T = b * s
    assert ops["qkv"].flops == pytest.approx(2 * T * h * (q + 2 * kv))
    assert ops["out_proj"].flops == pytest.approx(2 * T * q * h)
    assert ops["attn_core"].flops == pytest.approx(4 * b * s * s * q)  # the full square
    assert ops["mlp_up"].flops == pytest.approx(2 * T * h * 2 * spec.ffn / tp)


def test_an_explicit_default_changes_nothing() -> None:
    base = dict(QWEN, hidden=8192, head_dim=None)
    implicit, explicit = ModelSpec(**base), ModelSpec(**dict(base, head_dim=128))
    assert layer_params(implicit) == layer_params(explicit)
    for pass_ in ("fwd", "bwd_input", "bwd_weight"):
        assert layer_ops(implicit, 2, 2, True, "bf16", pass_) \
            == layer_ops(explicit, 2, 2, True, "bf16", pass_)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([8, 16, 32]), st.sampled_from([32, 64, 128]), st.sampled_from([1, 2, 4]),
       st.sampled_from([3, 4, 5]), st.booleans(), st.sampled_from(["gelu", "swiglu"]))
def test_gradient_shapes_sum_to_the_layer(heads: int, head_dim: int, kv_div: int, ratio: int,
                                          bias: bool, activation: str) -> None:
    """PowerSGD's per-tensor shapes (q: q_width x h, out: h x q_width) hold exactly the
    layer's parameters, whatever the head width."""
    spec = ModelSpec(layers=1, hidden=heads * head_dim * ratio // 4, heads=heads,
                     head_dim=head_dim, kv_heads=heads // kv_div, vocab=64, seq_len=16,
                     bias=bias, activation=activation)
    assert sum(r * c for r, c in layer_shapes(spec)) == layer_params(spec)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([64, 96, 128, 256]))
def test_wider_heads_never_cost_less(head_dim: int) -> None:
    narrow, wide = ModelSpec(**dict(QWEN, head_dim=64)), ModelSpec(**dict(QWEN, head_dim=head_dim))
    assert layer_params(wide) >= layer_params(narrow)
    fwd = {n: sum(op.flops for op in layer_ops(m, 1, 1, False, "bf16", "fwd"))
           for n, m in (("narrow", narrow), ("wide", wide))}
    assert fwd["wide"] >= fwd["narrow"]


def _scenario(**model: Any) -> Any:
    return scenario_from_dict({
        "name": "head-dim", "model": model,
        "cluster": {"system": "dgx-h100", "nodes": 1},
        "parallel": {"tp": 8}, "training": {"global_batch": 8, "micro_batch": 1}})


def test_a_hidden_heads_do_not_divide_needs_head_dim() -> None:
    dims = {"layers": 2, "hidden": 5000, "heads": 64, "kv_heads": 8, "vocab": 1000,
            "seq_len": 256}
    with pytest.raises(ScenarioError, match=r"^model\.hidden = 5000: .*set model\.head_dim") \
            as caught:
        _scenario(**dims)
    assert len(caught.value.problems) == 1
    assert consistency_problems(_scenario(**dims, head_dim=80)) == []


def test_a_published_row_states_it_in_other_flags() -> None:
    row = Row.model_validate({
        "name": "qwen3", "source": "s", "gpu": "H100-80GB", "gpus": 8,
        "framework": "torchtitan", "model": "Qwen3-32B", "layers": 64, "hidden": 5120,
        "heads": 64, "kv_heads": 8, "ffn_hidden": 25600, "vocab": 151936, "seq_len": 4096,
        "tp": 8, "pp": 1, "dp": 1, "zero_or_fsdp": "", "recompute": "full",
        "micro_batch": 1, "global_batch": 8, "dtype": "bf16",
        "other_flags": "head_dim=128; QK-norm", "measured": 100.0, "unit": "tokens/s/GPU"})
    data = scenario_data(row)
    assert data["model"]["head_dim"] == 128
    assert scenario_from_dict(data).model.q_width == 8192
