"""PyTorch's own exact GeLU priced by its arithmetic where that bounds it before HBM does
(``Op.alu_flops``, :data:`simulator.model.inventory.ops.TORCH_GELU_FP32_FLOPS`).

The oracle is the project's own calibration on an H200 (``clustersim calibrate``,
docs/validation/profile-nvidia-h200-2026-12-04.results.jsonl): ``F.gelu`` on bf16
tensors of 4,096 columns against a copy of the same bytes and an add, timed in the same run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.model.inventory.dense import act_op
from simulator.model.inventory.ops import TORCH_GELU_FP32_FLOPS, Op, Shape
from simulator.spec.load import scenario_from_dict
from simulator.system.costs import CostModel
from simulator.system.profiles import load_system

CALIBRATION = (Path(__file__).parents[1] / "docs" / "validation"
               / "profile-nvidia-h200-2026-12-04.results.jsonl")
LARGE = ("61035x4096", "13914x4096", "3172x4096")  # gelu's and copy's shapes (same bytes)


def _timed(path: Path = CALIBRATION) -> dict[str, dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["key"].split("/memory/")[1]: r for r in rows if r["kind"] == "memory" and r["ok"]}


def test_the_count_is_the_h200s_measured_gelu_at_its_fp32_peak() -> None:
    """250.0 M elements in 312.8 µs at the H200 preset's fp32 peak (the datasheet's 67
    TFLOP/s): 83.8 operations an element, to the constant's rounding."""
    gelu = _timed()["gelu/61035x4096"]
    elements = gelu["rows"] * gelu["hidden"]
    fp32 = load_system("dgx-h200").gpu.peak_flops("fp32")
    assert gelu["time_s"] * fp32 / elements == pytest.approx(TORCH_GELU_FP32_FLOPS, abs=0.05)


@pytest.mark.parametrize("session", [CALIBRATION, CALIBRATION.with_name(
    "profile-nvidia-h200-2026-12-04-run3.results.jsonl")])
@pytest.mark.parametrize("shape", LARGE)
def test_gelu_is_not_bound_by_its_bytes_on_the_h200(shape: str, session: Path) -> None:
    """The evidence that the kernel is bound by its CUDA cores: it moves a copy's bytes (read
    one, write one) yet takes 1.3 times as long at every size timed, in both sessions, and
    longer than an add that moves half as many bytes more."""
    timed = _timed(session)
    gelu, copy = timed[f"gelu/{shape}"], timed[f"copy/{shape}"]
    assert gelu["bytes"] == copy["bytes"]
    assert gelu["time_s"] / copy["time_s"] > 1.3
    adds = [r for k, r in timed.items() if k.startswith("add/")]
    add = min(adds, key=lambda r: abs(r["bytes"] - gelu["bytes"]))
    assert gelu["time_s"] > add["time_s"]


def _shape(stack: str, system: str = "dgx-a100-80gb") -> tuple[Shape, CostModel]:
    s = scenario_from_dict({
        "name": "t", "model": {"preset": "gpt3-175b"},
        "cluster": {"system": system, "nodes": 1, "gpus_per_node": 8},
        "parallel": {"dp": 8}, "training": {"global_batch": 8, "micro_batch": 1},
        "stack": stack})
    return Shape(s.model, 1, 1, False, 2, s.stack), CostModel(s.hardware, "bf16")


@pytest.mark.parametrize("pass_", ["fwd", "bwd_input"])
def test_an_a100_runs_pytorchs_gelu_at_its_cuda_cores_speed(pass_: str) -> None:
    """GPT-3's MLP activation (2,048 × 49,152 elements) under a stack that runs F.gelu on its
    own: the count at the A100's 19.5 TFLOP/s fp32, above its bytes' time, so compute-bound."""
    x, cost = _shape("composer-fsdp1")
    op = act_op(x, pass_)
    elements = x.tokens * x.spec.ffn
    assert op.alu_flops == TORCH_GELU_FP32_FLOPS * elements
    compute, memory, _, _ = cost.op_parts(op)
    assert compute == pytest.approx(elements * TORCH_GELU_FP32_FLOPS / 19.5e12, rel=1e-12)
    assert compute > memory and cost.bound(op) == "compute"


def test_an_h100s_cuda_cores_keep_up_with_its_bytes() -> None:
    """The same forward on an H100 (67 TFLOP/s fp32, 3.35 TB/s): the arithmetic takes less
    than the bytes, so the price is the bytes' as before."""
    x, cost = _shape("composer-fsdp1", "dgx-h100")
    op = act_op(x, "fwd")
    compute, memory, _, _ = cost.op_parts(op)
    assert 0 < compute < memory and cost.bound(op) == "memory"


@pytest.mark.parametrize("stack", ["megatron-core", "megatron-2022", "deepspeed"])
def test_a_fused_gelu_is_another_kernel_and_keeps_its_bytes_price(stack: str) -> None:
    x, _ = _shape(stack)
    assert act_op(x, "fwd").alu_flops == 0.0 and act_op(x, "bwd_input").alu_flops == 0.0


def test_swiglu_has_no_gelu_floor() -> None:
    s = scenario_from_dict({
        "name": "t", "model": {"preset": "llama2-7b"},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 8},
        "parallel": {"dp": 8}, "training": {"global_batch": 8, "micro_batch": 1},
        "stack": "pytorch-eager"})
    x = Shape(s.model, 1, 1, False, 2, s.stack)
    assert act_op(x, "fwd").alu_flops == 0.0


def test_a_cpu_profile_prices_its_own_kernels_whole() -> None:
    """The count is a CUDA kernel's; a CPU "device" keeps its measured curves alone."""
    cost = CostModel(load_system("cpu-1thread"), "fp32")
    assert cost.alu_time(1e9) == 0.0


@given(bytes_=st.floats(1e3, 1e11), alu=st.floats(0.0, 1e13),
       system=st.sampled_from(["dgx-a100-80gb", "dgx-h100", "dgx-b200"]))
def test_the_floor_never_shortens_a_kernel_and_is_the_larger_side(bytes_: float, alu: float,
                                                                   system: str) -> None:
    """Property: a memory op with arithmetic takes max(its bytes' time, its arithmetic at
    the fp32 peak) plus the kernel's device overhead, never less than without it, and grows
    with the count."""
    cost = CostModel(load_system(system), "bf16")
    plain = Op("x", "memory", 0.0, bytes_, 0.0, "elementwise")
    with_alu = Op("x", "memory", 0.0, bytes_, 0.0, "elementwise", alu_flops=alu)
    more = Op("x", "memory", 0.0, bytes_, 0.0, "elementwise", alu_flops=2 * alu + 1)
    assert cost.op_time(with_alu) >= cost.op_time(plain)
    assert cost.op_time(more) >= cost.op_time(with_alu)
    fp32 = cost.hw.gpu.peak_flops("fp32")
    overhead = cost.hw.gpu.kernel_overhead_us * 1e-6
    assert cost.op_time(with_alu) == pytest.approx(
        max(cost.op_time(plain) - overhead, alu / fp32) + overhead, rel=1e-12)
