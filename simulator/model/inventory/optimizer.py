"""The optimizer step as ops: the stack's AdamW kernels over a rank's shard.
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.model.inventory.ops import Op, dtype_bytes, mem
from simulator.spec.stack import STATE_BYTES, StackSpec


def optimizer_op(params: float, tensors: float, stack: StackSpec, dtype: str,
                 dtensors: int = 0, clip_tensors: bool = False, cached: bool = False) -> Op:
    """AdamW on ``params`` parameters in ``tensors`` tensors (one rank's shard).

    Per parameter: read the gradient (main-grad dtype), read and write the master weight,
    momentum and variance in their dtypes (fp32 each by default; the stack's
    ``main_params_dtype``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``: Transformer Engine's
    FusedAdam reads and writes each state in its storage dtype and computes in fp32), write
    the 16-bit copy (fp32 training, autocast or FSDP's mixed precision,
    ``stack.master_weights: parameters``: the weights are the master, read and written as
    the master, no copy; with ``param_remainders`` the master is the 16-bit parameter and
    its int16 remainder, each read and written); global-norm clipping reads the gradients
    once more and scales them in place. Kernels: fused multi-tensor apply launches one
    kernel per ~110 tensors or 2.1e7 elements (apex ``multi_tensor_apply``: 110 tensors, 320
    blocks × 65,536); ``foreach`` runs its ~7 foreach ops over the same chunks; ``per_tensor``
    (the for-loop AdamW, torch/optim/adamw.py ``_single_tensor_adamw``) runs 10 ops per
    tensor: the step count's add, the weight decay's mul, lerp, mul and addcmul on the moments, the
    step's ``item``, sqrt, div and add for the denominator, the update's addcdiv. Run op by op
    (foreach, per tensor), each op is a pass over the tensors: :func:`unfused_bytes`. With
    ``stack.optimizer_loop: composer`` the host reads each tensor's step back from the
    device first (the op is ``synced``). ``clip_tensors``: the clipping's norm and scale run
    per tensor (FSDP1's ``clip_grad_norm_``), else foreach over the chunks. ``cached``: the
    device's caches hold a tensor's operands from one op to the next (a CPU "device" running
    the small measured GPT, whose largest tensor is a megabyte), so memory sees each operand
    once, as the fused kernel's bytes; a GPU's 40-50 MB L2 holds no training tensor's.

    Host work: a kernel's for the fused and per-tensor forms; foreach does its host work
    per tensor of each foreach op (``_multi_tensor_adamw`` builds per-tensor lists, its
    step counters and bias corrections in Python; each ``_foreach_*`` op checks and
    groups every tensor), so its host units are 7 per tensor, not 7 per chunk."""
    dt = dtype_bytes(dtype)
    amp = stack.amp(dt)  # autocast: the parameters and their gradients are fp32
    g = 4 if amp else stack.main_grad_bytes(dt)
    per_param = g + 2.0 * _state_bytes(stack, dt) if stack.optimizer == "fused" or cached \
        else unfused_bytes(stack, dt, g)
    if not (dt == 4 or stack.fp32_params(dt)):  # the 16-bit copy written, read too as the
        per_param += 2 * dt if stack.param_remainders else dt  # high half of the master
    clip = 3 * g if stack.grad_clip else 0
    chunks = max(1, math.ceil(tensors / 110), math.ceil(params / 2.1e7))
    kernels = {"fused": chunks, "foreach": 7 * chunks, "per_tensor": 10 * tensors}[stack.optimizer]
    clips = (2 * tensors if clip_tensors else 2 * chunks) if stack.grad_clip else 0
    op = mem("optimizer", params * (per_param + clip), 1, "optimizer",
             round(kernels + clips))
    if stack.optimizer == "foreach":
        op = replace(op, host_units=round(7 * tensors + clips))
    if stack.optimizer == "per_tensor" and dtensors:  # each op on a DTensor dispatches as one
        op = replace(op, dtensor=10 * dtensors)
    if stack.optimizer == "per_tensor" and stack.optimizer_loop == "composer":
        op = replace(op, synced=True)
    return op


def unfused_bytes(stack: StackSpec, dt: int, grad: float) -> float:
    """HBM bytes per parameter of AdamW run op by op (foreach or per tensor), each op a
    pass over the tensors; with m, s₁, s₂ and g the bytes of a master weight, a first and
    second moment and a gradient, and t the denominator's temporary (the second moment's
    dtype: ``sqrt`` of it). torch.optim.AdamW (torch/optim/adam.py ``_single_tensor_adam``
    and ``_multi_tensor_adam``, decoupled weight decay; the same ops in torch 2.1 through
    2.13): ``param.mul_(1 − lr·wd)`` (2m; weight_decay's default 1e-2),
    ``exp_avg.lerp_(grad)`` (2s₁ + g), ``exp_avg_sq.mul_(β₂)`` (2s₂) and
    ``.addcmul_(grad, grad)`` (2s₂ + g), ``exp_avg_sq.sqrt()`` (s₂ + t), its division by the
    bias correction (2t) and ``add_(eps)`` (2t), ``param.addcdiv_(exp_avg, denom)`` (2m + s₁
    + t): 4m + 3s₁ + 5s₂ + 2g + 6t, 80 bytes in fp32. Composer's DecoupledAdamW (v0.16.0
    ``adamw``) runs ``exp_avg.mul_(β₁).add_(grad)`` (4s₁ + g) for the lerp and skips the
    weight decay's pass at llm-foundry's ``weight_decay: 0.0``: 2m + 5s₁ + 5s₂ + 2g + 6t,
    also 80. The fused kernel reads and writes each once (g + 2(m + s₁ + s₂), 28)."""
    m, s1 = _master_bytes(stack, dt), STATE_BYTES[stack.exp_avg_dtype]
    s2 = t = STATE_BYTES[stack.exp_avg_sq_dtype]
    if stack.optimizer_loop == "composer":
        return 2 * m + 5 * s1 + 5 * s2 + 2 * grad + 6 * t
    return 4 * m + 3 * s1 + 5 * s2 + 2 * grad + 6 * t


def _state_bytes(stack: StackSpec, dt: int) -> float:
    """Bytes of one parameter's AdamW state the step reads and writes: the master copy (the
    fp32 parameter itself where it is the master; the int16 remainder with
    ``param_remainders``) and the two moments."""
    return _master_bytes(stack, dt) + STATE_BYTES[stack.exp_avg_dtype] \
        + STATE_BYTES[stack.exp_avg_sq_dtype]


def _master_bytes(stack: StackSpec, dt: int) -> float:
    """Bytes of the master copy the step reads and writes (the fp32 parameter where it is
    the master)."""
    return stack.master_bytes(dt) if dt < 4 and not stack.fp32_params(dt) else 4.0


def in_flat_shard(tensors: int, ranks: int) -> float:
    """Of a unit's ``tensors`` laid end to end in one FSDP1 FlatParameter split into
    ``ranks`` contiguous shards, how many a rank's shard holds a piece of, on average:
    each tensor is in at least one shard and each of the ranks − 1 shard boundaries
    falling inside a tensor puts it in one more, (tensors + ranks − 1) / ranks. Only those
    are the rank's to step and clip: ``_use_sharded_grad_views`` sets ``param.grad =
    None`` for a parameter not in the rank's shard (torch/distributed/fsdp/_flat_param.py,
    ``use_orig_params``), and the optimizer and ``clip_grad_norm_`` skip it."""
    return (tensors + ranks - 1) / ranks
