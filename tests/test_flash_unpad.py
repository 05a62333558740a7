"""flash-attn called on packed tokens (``stack.flash_unpad``): the ops llm-foundry's
``flash_attn_fn`` runs around the kernel, from flash_attn/bert_padding.py.

Forward: three ``unpad_input`` calls (Q, K, V: a mask sum, ``nonzero``'s two kernels,
a max, its ``.item()`` copy, a cumsum, ``F.pad`` and a ``torch.gather`` that reads and
writes its tensor) after a mask of ones, then ``pad_input`` (``torch.zeros`` and an
index put that reads the packed output and writes it back). Backward: each gather's
gradient is a zeroed buffer its gradient is scattered into, the pad's a gather.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_published import DEV_SET

from simulator.api import simulate_scenario
from simulator.model.inventory.attention import UNPAD_KERNELS, attention_ops
from simulator.model.inventory.ops import Shape
from simulator.spec.load import scenario_from_dict


def _scenario(attention: str, unpad: bool, hidden: int = 2048, heads: int = 16,
              kv_heads: int | None = None, seq_len: int = 2048, micro_batch: int = 2) -> Any:
    model: dict[str, Any] = {"preset": "llama2-7b", "layers": 2, "hidden": hidden,
                             "heads": heads, "seq_len": seq_len, "ffn_hidden": 4 * hidden}
    if kv_heads:
        model["kv_heads"] = kv_heads
    return scenario_from_dict({
        "name": "t", "model": model,
        "cluster": {"system": "dgx-h100", "nodes": 1, "gpus_per_node": 8},
        "parallel": {"dp": 8, "zero": 3},
        "training": {"global_batch": 8 * micro_batch, "micro_batch": micro_batch},
        "stack": {"preset": "composer-fsdp1", "attention": attention, "flash_unpad": unpad}})


def _ops(s: Any, pass_: str) -> dict[str, Any]:
    shape = Shape(s.model, s.training.micro_batch, 1, False, 2, s.stack)
    return {op.name: op for op in attention_ops(shape, pass_)}  # type: ignore[arg-type]


def test_the_packing_ops_move_bert_paddings_bytes() -> None:
    """GQA (8 heads of K and V under 32 of Q, head dimension 128): the gathers move Q, K
    and V once each way, the pad three times the output; backward the scatters three
    times the packed tensors and the pad's gather twice the output."""
    s = _scenario("flash2", True, hidden=4096, heads=32, kv_heads=8, seq_len=1024,
                  micro_batch=3)
    tokens, q, kv = 3 * 1024, 4096, 8 * 128
    fwd, bwd = _ops(s, "fwd"), _ops(s, "bwd_input")
    assert list(fwd) == ["attn_unpad", "attn_core", "attn_pad"]
    assert fwd["attn_unpad"].bytes == 2 * 2 * tokens * (q + 2 * kv)
    assert fwd["attn_unpad"].kernels == 3 * UNPAD_KERNELS + 1 == 25
    assert fwd["attn_pad"].bytes == 2 * 3 * tokens * q and fwd["attn_pad"].kernels == 2
    assert bwd["attn_unpad"].bytes == 2 * 3 * tokens * (q + 2 * kv)
    assert bwd["attn_unpad"].kernels == 6
    assert bwd["attn_pad"].bytes == 2 * 2 * tokens * q and bwd["attn_pad"].kernels == 1
    assert all(op.saved == 0 for op in (*fwd.values(), *bwd.values()) if op.name != "attn_core")
    assert fwd["attn_core"] == _ops(_scenario("flash2", False, hidden=4096, heads=32,
                                              kv_heads=8, seq_len=1024, micro_batch=3),
                                    "fwd")["attn_core"]


@pytest.mark.parametrize("kernel", ["flash_triton", "flash3", "cudnn"])
def test_only_flash_attns_kernels_are_packed(kernel: str) -> None:
    """llm-foundry's Triton path takes the padded tensors; other kernels are not
    flash-attn's varlen interface: the field changes nothing there."""
    for pass_ in ("fwd", "bwd_input"):
        assert list(_ops(_scenario(kernel, True), pass_)) == ["attn_core"]


def test_the_llm_foundry_flash_rows_pack_and_the_triton_rows_do_not() -> None:
    from simulator.published.mapping import scenario_data
    from simulator.published.rows import read_rows

    rows = {r.name: r for r in read_rows(DEV_SET)}
    flash = scenario_from_dict(scenario_data(
        rows["llmfoundry_h100_bf16_large_mpt1b_seq2048_128gpu_mbs12_ga1"]))
    triton = scenario_from_dict(scenario_data(
        rows["llmfoundry_h100_bf16_mpt1b_seq2048_64gpu_mbs20_ga1"]))
    assert flash.stack.flash_unpad and flash.stack.attention == "flash2"
    assert "attn_unpad" in _ops(flash, "fwd")
    assert triton.stack.attention == "flash_triton" and "attn_unpad" not in _ops(triton, "fwd")


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([(1024, 8), (2048, 16), (2560, 32), (4096, 32)]),
       st.sampled_from([512, 2048, 8192]), st.integers(1, 4), st.booleans())
def test_packing_never_makes_a_step_faster(dims: tuple[int, int], seq_len: int,
                                           micro_batch: int, full: bool) -> None:
    """More work on the compute stream: the step (closed form) is never shorter, whether
    or not the forward runs again, and the compute stream's busy time always longer (a
    step bound by FSDP's exposed gathers may hide the packing)."""
    results = []
    for unpad in (False, True):
        s = _scenario("flash2", unpad, *dims, seq_len=seq_len, micro_batch=micro_batch)
        if full:
            s = s.model_copy(update={"parallel": s.parallel.model_copy(
                update={"recompute": "full"})})
        results.append(simulate_scenario(s, "analytic")[0])
    # (to rounding: where exposed gathers bound the step, compute + (gather − compute))
    assert results[1]["step_time_s"] >= results[0]["step_time_s"] * (1 - 1e-12)
    assert sum(results[1]["compute_s"]) > sum(results[0]["compute_s"])


def test_the_forwards_packing_waits_for_the_gpu() -> None:
    """Each ``unpad_input`` reads ``nonzero``'s size and the lengths' max back to the host
    (flash-attn v2.4.2 bert_padding.py), so the forward's packing is ``synced``: the host
    cannot have issued it ahead behind the QKV projection, and in the attention block its
    host time adds to the block instead of hiding behind the GEMM before it. The
    backward's scatters read nothing back."""
    from dataclasses import replace

    from simulator.model.inventory.dense import dense_layer_ops
    from simulator.system.costs import CostModel

    s = _scenario("flash2", True)
    fwd, bwd = _ops(s, "fwd"), _ops(s, "bwd_input")
    assert fwd["attn_unpad"].synced and not bwd["attn_unpad"].synced
    assert not fwd["attn_pad"].synced and not fwd["attn_core"].synced
    cost = CostModel(s.hardware, "bf16", host_us=s.stack.host_us)
    block = list(dense_layer_ops(s.model, 2, 1, False, "bf16", "fwd", s.stack))
    loose = [replace(op, synced=False) for op in block]
    unpad = fwd["attn_unpad"]
    host = cost.op_parts(unpad)[3]
    assert host > 0 and cost.ops_time(block) > cost.ops_time(loose)
    assert cost.ops_time(block) <= cost.ops_time(loose) + host + 1e-12
