"""The optimizer's state in the dtypes the frameworks store it in (``stack.exp_avg_dtype``,
``exp_avg_sq_dtype``, ``main_params_dtype``, ``param_remainders``): Megatron-Core's
precision-aware optimizer (Transformer Engine's FusedAdam), torchtitan's
``fused_opt_states_bf16``, DeepSeek-V3's BF16 moments (arXiv:2412.19437, §3.3.3).

Closed forms for the bytes per parameter of every dtype combination, sharded by the
distributed optimizer as the fp32 state is; a property: lowering any state's dtype never
raises a stage's memory and lowers it by exactly the closed form; the optimizer step's
bytes; the rules that refuse a state the framework would not keep; Megatron-LM's and
torchtitan's flags.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.memory import memory_items, memory_report
from simulator.cli.main import main
from simulator.model.inventory.optimizer import optimizer_op
from simulator.model.memory import state_bytes_per_param
from simulator.spec.load import load_scenario, scenario_from_dict
from simulator.spec.stack import STATE_BYTES, StackSpec

MOMENTS = ("fp32", "bf16", "fp16", "fp8")
ORDER = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}  # bytes, the Megatron parser's dtypes
DSV3 = Path(__file__).resolve().parent.parent / "scenarios" / "deepseek-v3-2048xh800.yaml"


def _stack(**fields: Any) -> StackSpec:
    return StackSpec.model_validate({"preset": "megatron-core", **fields})


@pytest.mark.parametrize(("m", "v"), list(itertools.product(MOMENTS, MOMENTS)))
@pytest.mark.parametrize(("master", "want_master"), [
    ({}, 4), ({"main_params_dtype": "fp16"}, 2), ({"param_remainders": True}, 2)])
def test_bytes_per_parameter_of_every_dtype_combination(m: str, v: str, master: dict[str, Any],
                                                        want_master: int) -> None:
    """Master copy + exp_avg + exp_avg_sq: 4 + 4 + 4 = 12 (the ZeRO paper's K) by default;
    bf16 moments 4 + 2 + 2 = 8 (DeepSeek-V3's); a 16-bit master (fp16, or the int16 low
    halves beside bf16 parameters) 2; fp32 parameters are their own master (0)."""
    stack = _stack(exp_avg_dtype=m, exp_avg_sq_dtype=v, **master)
    assert stack.optimizer_bytes(2) == want_master + ORDER[m] + ORDER[v]
    assert stack.optimizer_bytes(4) == ORDER[m] + ORDER[v]  # fp32 training
    fsdp = stack.model_copy(update={"master_weights": "parameters"})
    assert fsdp.optimizer_bytes(2) == ORDER[m] + ORDER[v]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("n_d", [1, 8, 128])
def test_the_distributed_optimizer_shards_the_lower_precision_state(zero: int, n_d: int) -> None:
    """From ZeRO-1 the state divides by the data-parallel degree whatever its dtype:
    8 / n_d bytes a parameter with bf16 moments, where fp32 ones hold 12 / n_d."""
    bf16 = _stack(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16").optimizer_bytes(2)
    w, g, o = state_bytes_per_param(zero, n_d, "bf16", 4, False, bf16)
    assert (w, g) == state_bytes_per_param(zero, n_d, "bf16", 4)[:2]
    assert o == (8 / n_d if zero >= 1 else 8)
    assert state_bytes_per_param(zero, n_d, "bf16", 4)[2] == (12 / n_d if zero >= 1 else 12)


def _scenario(model: str, zero: int, dp: int, **stack: Any) -> Any:
    experts = {"ep": dp} if model == "mixtral-8x7b" else {}  # routed experts shard over edp
    return scenario_from_dict({
        "name": "states", "model": {"preset": model},
        "cluster": {"system": "dgx-h100", "nodes": 1},
        "parallel": {"tp": 2, "pp": 8 // (2 * dp), "dp": dp, "zero": zero, **experts},
        "training": {"global_batch": 4 * dp, "micro_batch": 1},
        "stack": {"preset": "megatron-core", **stack}})


FIELDS = {"exp_avg_dtype": MOMENTS, "exp_avg_sq_dtype": MOMENTS,
          "main_params_dtype": ("fp32", "fp16")}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["tiny-gpt", "mixtral-8x7b"]), st.sampled_from([0, 1, 2, 3]),
       st.sampled_from([1, 2, 4]), st.sampled_from(list(FIELDS)), st.data())
def test_lowering_a_state_dtype_lowers_memory_by_exactly_its_bytes(
        model: str, zero: int, dp: int, field: str, data: st.DataObject) -> None:
    """Any state's dtype lowered (fp32 -> bf16/fp16 -> fp8): on every stage the optimizer
    item falls by params × (old − new bytes) / the sharding, i.e. in the ratio of the
    bytes per parameter, and nothing else moves: the total never rises. The optimizer
    step moves twice the difference fewer bytes a parameter."""
    hi, lo = sorted(data.draw(st.lists(st.sampled_from(FIELDS[field]), min_size=2,
                                       max_size=2)), key=lambda d: -ORDER[d])
    before = memory_report(_scenario(model, zero, dp, **{field: hi}))
    after = memory_report(_scenario(model, zero, dp, **{field: lo}))
    k_hi = _stack(**{field: hi}).optimizer_bytes(2)
    k_lo = _stack(**{field: lo}).optimizer_bytes(2)
    assert k_hi - k_lo == ORDER[hi] - ORDER[lo]
    step = [optimizer_op(1e6, 10, _stack(**{field: d}), "bf16").bytes for d in (hi, lo)]
    assert step[0] - step[1] == 1e6 * 2 * (k_hi - k_lo)  # each state read and written
    for a, b in zip(before, after, strict=True):
        assert b.optimizer == pytest.approx(a.optimizer * k_lo / k_hi, rel=1e-12)
        assert a.total - b.total == pytest.approx(a.optimizer - b.optimizer, rel=1e-9, abs=1e-3)
        assert b.total <= a.total
        assert (a.weights, a.gradients, a.activations) == (b.weights, b.gradients,
                                                           b.activations)


def test_deepseek_v3s_bf16_moments_hold_a_third_less_state() -> None:
    """The bundled DeepSeek-V3 run with its report's BF16 moments: 8 bytes a parameter of
    the shard where fp32 moments hold 12, so every stage's optimizer item is 2/3 of it
    (stage 1: 8.63 -> 5.75 GB), and `clustersim memory` names the dtypes it priced."""
    low = load_scenario(DSV3)  # the scenario states them; fp32 moments are the override
    assert (low.stack.exp_avg_dtype, low.stack.exp_avg_sq_dtype) == ("bf16", "bf16")
    s = low.model_copy(update={"stack": low.stack.model_copy(update={
        "exp_avg_dtype": "fp32", "exp_avg_sq_dtype": "fp32"})})
    for a, b in zip(memory_report(s), memory_report(low), strict=True):
        assert b.optimizer == pytest.approx(a.optimizer * 8 / 12, rel=1e-12)
    peak = memory_report(low)[1]
    source = {name: src for name, _, src in memory_items(peak, low)}["optimizer"]
    assert "AdamW 8 B/param" in source and "exp_avg bf16 2" in source


def test_the_optimizer_step_reads_and_writes_each_state_in_its_dtype() -> None:
    """Per parameter: the fp32 main grad read (4), master, exp_avg and exp_avg_sq read and
    written in their dtypes, the bf16 copy written (2); clipping reads the grads and
    scales them (3 × 4). bf16 moments: 4 + 2·(4 + 2 + 2) + 2; fp8: 4 + 2·(4 + 1 + 1) + 2;
    int16 remainders: the bf16 parameter read and written with them, 4 + 2·(2 + 4 + 4)
    + 2 + 2."""
    clip = 12
    cases = [({}, 4 + 24 + 2), ({"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}, 4 + 16 + 2),
             ({"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}, 4 + 12 + 2),
             ({"param_remainders": True}, 4 + 20 + 4), ({"main_params_dtype": "fp16"}, 4 + 20 + 2)]
    for fields, per_param in cases:
        assert optimizer_op(1e6, 10, _stack(**fields), "bf16").bytes == 1e6 * (per_param + clip)
    fp32 = _stack(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")  # fp32 training: no copy
    assert optimizer_op(1e6, 10, fp32, "fp32").bytes == 1e6 * (4 + 2 * (4 + 2 + 2) + clip)
    assert STATE_BYTES == ORDER


@pytest.mark.parametrize(("sets", "words"), [
    (["stack.exp_avg_dtype=int8"], ["stack.exp_avg_dtype", "'int8'", "'fp32', 'bf16'"]),
    (["stack.param_remainders=true", "training.dtype=fp16"],
     ["stack.param_remainders", "bf16 parameters", "set it false"]),
    (["stack.param_remainders=true", "stack.main_params_dtype=fp16"],
     ["stack.param_remainders", "main_params_dtype: fp32"]),
    (["stack.main_params_dtype=fp16", "training.dtype=fp32"],
     ["stack.main_params_dtype", "'fp16'", "fp32 master", "remove it"]),
    (["stack.fp8_cache=deepseek", "stack.fp8=none"],
     ["stack.fp8_cache", "'deepseek'", "set stack.fp8"]),
])
def test_a_state_the_framework_would_not_keep_is_one_line_and_exit_2(
        capsys: pytest.CaptureFixture[str], sets: list[str], words: list[str]) -> None:
    args = [w for kv in sets for w in ("--set", kv)]
    rc = main(["validate", str(DSV3), *args])
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.startswith("error:")]
    assert rc == 2 and len(err) == 1, err
    assert all(w in err[0] for w in words), err[0]
