"""The optimizer step as ops: the stack's AdamW kernels over a rank's shard.
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.model.inventory.ops import Op, dtype_bytes, mem
from simulator.spec.stack import STATE_BYTES, StackSpec


def optimizer_op(params: float, tensors: int, stack: StackSpec, dtype: str,
                 dtensors: int = 0) -> Op:
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
    step's ``item``, sqrt, div and add for the denominator, the update's addcdiv.

    Host work: a kernel's for the fused and per-tensor forms; foreach does its host work
    per tensor of each foreach op (``_multi_tensor_adamw`` builds per-tensor lists, its
    step counters and bias corrections in Python; each ``_foreach_*`` op checks and
    groups every tensor), so its host units are 7 per tensor, not 7 per chunk."""
    dt = dtype_bytes(dtype)
    amp = stack.amp(dt)  # autocast: the parameters and their gradients are fp32
    g = 4 if amp else stack.main_grad_bytes(dt)
    per_param = g + 2.0 * _state_bytes(stack, dt)
    if not (dt == 4 or stack.fp32_params(dt)):  # the 16-bit copy written, read too as the
        per_param += 2 * dt if stack.param_remainders else dt  # high half of the master
    clip = 3 * g if stack.grad_clip else 0
    chunks = max(1, math.ceil(tensors / 110), math.ceil(params / 2.1e7))
    kernels = {"fused": chunks, "foreach": 7 * chunks, "per_tensor": 10 * tensors}[stack.optimizer]
    if stack.grad_clip:
        kernels += 2 * chunks
    op = mem("optimizer", params * (per_param + clip), 1, "optimizer", int(kernels))
    if stack.optimizer == "foreach":
        op = replace(op, host_units=7 * tensors + (2 * chunks if stack.grad_clip else 0))
    if stack.optimizer == "per_tensor" and dtensors:  # each op on a DTensor dispatches as one
        op = replace(op, dtensor=10 * dtensors)
    return op


def _state_bytes(stack: StackSpec, dt: int) -> float:
    """Bytes of one parameter's AdamW state the step reads and writes: the master copy (the
    fp32 parameter itself where it is the master; the int16 remainder with
    ``param_remainders``) and the two moments."""
    master = stack.master_bytes(dt) if dt < 4 and not stack.fp32_params(dt) else 4.0
    return master + STATE_BYTES[stack.exp_avg_dtype] + STATE_BYTES[stack.exp_avg_sq_dtype]
