"""AdamW run op by op (``stack.optimizer`` foreach or per_tensor): each op a pass over the
tensors (:func:`simulator.model.inventory.optimizer.unfused_bytes`); Composer's
DecoupledAdamW, which reads each tensor's step count back from the device
(``stack.optimizer_loop: composer``, a ``synced`` op: host and device time add); and
FSDP1's flat parameters, under which a rank steps and clips only the tensors its shard
holds a piece of (:func:`simulator.model.inventory.optimizer.in_flat_shard`).

Oracles: the ops of torch/optim/adam.py (``_single_tensor_adam``, ``_multi_tensor_adam``)
and composer/optim/decoupled_weight_decay.py (v0.16.0) counted by hand, and the shards of
a flat parameter laid out and cut by brute force.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.model import transformer as mdl
from simulator.model.inventory.optimizer import in_flat_shard, optimizer_op, unfused_bytes
from simulator.model.memory import stage_params
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.spec.stack import STATE_BYTES, load_stack
from simulator.system.costs import CostModel
from simulator.system.profiles import load_system

EAGER, COMPOSER = load_stack("pytorch-eager"), load_stack("composer-fsdp1")


def _passes(ops: list[tuple[str, ...]], width: dict[str, int]) -> int:
    """Bytes per element of ops each reading its inputs and writing its output once."""
    return sum(width[name] for op in ops for name in op)


FP32 = {"param": 4, "grad": 4, "exp_avg": 4, "exp_avg_sq": 4, "denom": 4}
#: torch.optim.AdamW, decoupled weight decay, one op a line: what it reads, then writes
TORCH_OPS = [("param", "param"),                          # param.mul_(1 - lr * wd)
             ("exp_avg", "grad", "exp_avg"),              # exp_avg.lerp_(grad, 1 - beta1)
             ("exp_avg_sq", "exp_avg_sq"),                # exp_avg_sq.mul_(beta2)
             ("exp_avg_sq", "grad", "exp_avg_sq"),        # .addcmul_(grad, grad)
             ("exp_avg_sq", "denom"),                     # exp_avg_sq.sqrt()
             ("denom", "denom"),                          # / bias_correction2_sqrt
             ("denom", "denom"),                          # .add_(eps)
             ("param", "exp_avg", "denom", "param")]      # param.addcdiv_(exp_avg, denom)
#: Composer's DecoupledAdamW at weight_decay 0.0: mul_ then add_ for the lerp, no decay
COMPOSER_OPS = [("exp_avg", "exp_avg"), ("exp_avg", "grad", "exp_avg"), *TORCH_OPS[2:]]


def test_torch_adamw_op_by_op_moves_80_bytes_a_parameter_in_fp32() -> None:
    assert _passes(TORCH_OPS, FP32) == 80
    assert unfused_bytes(EAGER, 4, 4) == 80


def test_composers_decoupled_adamw_moves_80_bytes_too() -> None:
    assert _passes(COMPOSER_OPS, FP32) == 80
    assert unfused_bytes(COMPOSER, 2, 4) == 80


@given(m1=st.sampled_from(sorted(STATE_BYTES)), m2=st.sampled_from(sorted(STATE_BYTES)),
       g=st.sampled_from([2, 4]), loop=st.sampled_from(["torch", "composer"]))
def test_the_passes_follow_each_states_dtype(m1: str, m2: str, g: int, loop: str) -> None:
    """Each state's bytes enter as often as the ops touch it (the denominator takes the
    second moment's dtype), and op by op never moves less than the fused kernel's once
    over each state."""
    stack = EAGER.model_copy(update={"exp_avg_dtype": m1, "exp_avg_sq_dtype": m2,
                                     "optimizer_loop": loop})
    width = {"param": 4, "grad": g, "exp_avg": STATE_BYTES[m1],
             "exp_avg_sq": STATE_BYTES[m2], "denom": STATE_BYTES[m2]}
    ops = COMPOSER_OPS if loop == "composer" else TORCH_OPS
    assert unfused_bytes(stack, 4, g) == _passes(ops, width)
    assert unfused_bytes(stack, 4, g) >= g + 2 * (4 + STATE_BYTES[m1] + STATE_BYTES[m2])


def test_the_fused_step_and_a_cached_device_keep_one_pass() -> None:
    """The fused kernel reads the gradient and reads and writes each state once (28
    bytes); a device whose caches keep a tensor's operands between ops (a CPU running the
    small measured GPT) pays DRAM that once as well."""
    fused = EAGER.model_copy(update={"optimizer": "fused", "grad_clip": False})
    eager = EAGER.model_copy(update={"grad_clip": False})
    assert optimizer_op(1e6, 10, fused, "fp32").bytes == 28e6
    assert optimizer_op(1e6, 10, eager, "fp32").bytes == 80e6
    assert optimizer_op(1e6, 10, eager, "fp32", cached=True).bytes == 28e6


def test_only_composers_loop_reads_the_step_back() -> None:
    assert optimizer_op(1e6, 10, COMPOSER, "bf16").synced
    assert not optimizer_op(1e6, 10, EAGER, "bf16").synced
    foreach = COMPOSER.model_copy(update={"optimizer": "foreach"})
    assert not optimizer_op(1e6, 10, foreach, "bf16").synced  # its steps stay on the host


@settings(max_examples=60, deadline=None)
@given(params=st.floats(1e3, 1e10), tensors=st.integers(1, 2000),
       host=st.floats(0.5, 50.0))
def test_a_synced_step_adds_its_host_and_device_time(params: float, tensors: int,
                                                     host: float) -> None:
    """Waiting for the device before each tensor, the host's issue work and the device's
    run one after the other: their sum, never less than the unsynced step's larger one."""
    cost = CostModel(load_system("dgx-h100"), "bf16", host_us=host)
    op = optimizer_op(params, tensors, COMPOSER, "bf16")
    compute, mem, overhead, host_s = cost.op_parts(op)
    assert cost.op_time(op) == pytest.approx(max(compute, mem) + overhead + host_s)
    assert cost.op_time(op) >= cost.op_time(replace(op, synced=False))
    assert cost.ops_time([op]) == pytest.approx(cost.op_time(op))


def test_a_synced_op_waits_for_the_device_work_queued_before_it() -> None:
    """Behind a long kernel the host has banked its issue time; a synced op cannot use
    it: it starts when the device is done, then issues, then runs."""
    cost = CostModel(load_system("dgx-h100"), "bf16", host_us=10.0)
    step = optimizer_op(1e8, 100, COMPOSER, "bf16")
    before = optimizer_op(4e9, 1, EAGER.model_copy(update={"optimizer": "fused"}), "bf16")
    assert cost.ops_time([before, step]) == pytest.approx(
        cost.op_time(before) + cost.op_time(step))
    loose = replace(step, synced=False)
    assert cost.ops_time([before, loose]) < cost.ops_time([before, step])


def _pieces(sizes: list[float], ranks: int) -> float:
    """Mean over ranks of how many tensors (laid end to end) a rank's contiguous shard
    overlaps, cut by brute force."""
    edges, start = [], 0.0
    for size in sizes:
        edges.append((start, start + size))
        start += size
    width = start / ranks
    return sum(sum(1 for a, b in edges if a < (r + 1) * width and b > r * width)
               for r in range(ranks)) / ranks


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.floats(1.0, 1e6), min_size=1, max_size=30),
       ranks=st.integers(1, 64))
def test_a_rank_holds_pieces_of_tensors_plus_ranks_minus_one_over_ranks(
        sizes: list[float], ranks: int) -> None:
    """(tensors + ranks − 1) / ranks: exact wherever no shard boundary falls on a tensor
    boundary (each of the ranks − 1 inner boundaries splits one tensor); where one does,
    fewer."""
    brute = _pieces(sizes, ranks)
    assert brute <= in_flat_shard(len(sizes), ranks) + 1e-9
    starts = {round(sum(sizes[:i]), 6) for i in range(1, len(sizes))}
    cuts = {round(r * sum(sizes) / ranks, 6) for r in range(1, ranks)}
    if not starts & cuts:
        assert brute == pytest.approx(in_flat_shard(len(sizes), ranks))


def _composer(dp: int, zero: int = 3, **stack: Any) -> Scenario:
    return scenario_from_dict({
        "name": "optimizer-passes",
        "model": {"layers": 4, "hidden": 1024, "heads": 8, "vocab": 50368, "seq_len": 2048,
                  "bias": True, "position": "learned"},
        "cluster": {"system": "dgx-h100", "nodes": max(1, dp // 8),
                    "gpus_per_node": min(dp, 8)},
        "parallel": {"dp": dp, "zero": zero},
        "training": {"global_batch": dp, "micro_batch": 1, "dtype": "bf16"},
        "stack": {"preset": "composer-fsdp1", **stack},
    })


def _step(s: Scenario) -> Any:
    shard = stage_params(s.model, 1, 0) / (s.parallel.shard if s.parallel.zero else 1)
    return mdl.optimizer_op_of(s, shard, [range(s.model.layers)])


@pytest.mark.parametrize("dp", [8, 64, 512])
def test_fsdp1s_rank_steps_and_clips_only_the_tensors_its_shard_holds(dp: int) -> None:
    """MPT's blocks (12 tensors each) and the root unit's 4 tensors, each unit its own flat
    parameter: (12 + dp − 1) / dp a block and (4 + dp − 1) / dp the root; ten host units a
    tensor for the step, two more for FSDP1's per-tensor norm and scale."""
    flat, whole = _step(_composer(dp)), _step(_composer(dp, fsdp_flat_param=False))
    tensors = 4 * in_flat_shard(12, dp) + in_flat_shard(4, dp)
    assert flat.kernels == round(10 * tensors + 2 * tensors)
    assert whole.kernels == 10 * (4 * 12 + 4) + 2  # every tensor; clipping foreach, a chunk
    assert flat.bytes == whole.bytes  # the shard's elements are the same


def test_other_sharding_keeps_every_tensor() -> None:
    """ZeRO-1/2 and FSDP2 (a DTensor's shard of every parameter on every rank) step every
    tensor: only FSDP1's flat parameters under ZeRO-3 cut them."""
    assert _step(_composer(8, zero=1)).kernels == 10 * 52 + 2
    fsdp2 = _composer(8, fsdp_flat_param=False, fsdp_copies=True, dtensor=True)
    assert _step(fsdp2).kernels == 10 * 52 + 2


def test_dev_set_scale_out_steps_fewer_tensors_and_reads_faster() -> None:
    """At 512 ranks a rank holds a piece of about one tensor a block: its step issues a
    tenth of the kernels and takes less time than stepping all of them would."""
    s = _composer(512)
    cost = CostModel(s.hardware, "bf16", host_us=s.stack.host_us)
    flat, whole = _step(s), _step(_composer(512, fsdp_flat_param=False))
    assert flat.kernels < whole.kernels / 4
    assert cost.op_time(flat) < cost.op_time(whole)
