"""A layer of either kind, dense or a mixture of experts' MoE layer: how many parameter
tensors it has and what it keeps for backward, from the op inventory of its kind.
"""

from __future__ import annotations

import functools

from simulator.model import moe
from simulator.model.inventory import mla
from simulator.model.inventory.dense import dense_layer_ops, weight_elements
from simulator.model.inventory.experts import expert_calls, moe_layer_ops, moe_layer_tensors
from simulator.model.inventory.ops import Shape, dense_layer_tensors, dtype_bytes
from simulator.model.inventory.recompute_policy import kept_tensors
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec


def layer_tensors(spec: ModelSpec, stack: StackSpec, layer: int | None = None) -> int:
    """Parameter tensors of one layer as the stack builds it, its routed experts apart
    (:func:`expert_tensors`): a dense layer's linears (weights and biases) and norms, or
    where ``layer`` is one of a mixture of experts' MoE layers :func:`moe_layer_tensors`
    (the optimizer's per-tensor kernels, DDP's bucket copies)."""
    if layer is not None and spec.is_moe_layer(layer):
        return moe_layer_tensors(spec, stack)
    return dense_layer_tensors(spec, stack)


def fp8_weights(spec: ModelSpec, stack: StackSpec, tp: int, layer: int = 0) -> tuple[float, int]:
    """(elements, tensors) of one layer's linear weights on one TP rank that run in FP8
    under ``stack.fp8``, its routed experts apart (:func:`fp8_expert_weights`): a dense
    layer's four linears, a MoE layer's attention projections; with latent attention its
    five (four without a q latent) projections and a dense layer's two MLP linears; none
    without FP8. The router and the shared experts stay 16-bit."""
    if stack.fp8 == "none":
        return 0.0, 0
    x = Shape(spec, 1, tp, False, 2, stack)
    if spec.mla is not None:
        w = mla.mla_linears(spec, spec.mla, tp)
        if not spec.is_moe_layer(layer):
            w |= {"mlp_up": (spec.hidden, x.up), "mlp_down": (spec.ffn / tp, spec.hidden)}
        return sum(k * n for k, n in w.values()), len(w)
    names = ("qkv", "out_proj") if spec.is_moe_layer(layer) else \
        ("qkv", "out_proj", "mlp_up", "mlp_down")
    tensors = {"qkv": x.qkv_kernels, "out_proj": 1, "mlp_up": x.up_kernels, "mlp_down": 1}
    return (sum(weight_elements(x, n) for n in names), sum(tensors[n] for n in names))


def fp8_expert_weights(spec: ModelSpec, stack: StackSpec, ep: int, etp: int,
                       layer: int) -> tuple[float, int]:
    """(elements, tensors) of one MoE layer's routed experts' weights on one rank (its
    experts / ep, each split over etp) that run in FP8 under ``stack.fp8`` (none in a dense
    layer or without FP8); tensors as the stack holds them
    (:func:`~simulator.model.inventory.experts.expert_calls`)."""
    if stack.fp8 == "none" or not spec.is_moe_layer(layer):
        return 0.0, 0
    local, f = spec.experts // ep, spec.expert_ffn / etp
    up = (2 if spec.activation == "swiglu" else 1) * f
    return local * (spec.hidden * up + f * spec.hidden), 2 * expert_calls(stack, local)


@functools.lru_cache(maxsize=1024)
def saved_tensors(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                  dtype: str, recompute: str, stack: StackSpec,
                  moe_layer: bool) -> tuple[float, ...]:
    """The tensors (bytes) one layer, dense or (``moe_layer``) a mixture of experts' MoE
    layer, keeps between its forward and backward, one per forward op that saves; under
    selective recomputation the core's internals (scores, softmax, dropout, statistics)
    give way to its inputs Q, K and V; under full recomputation only the layer's input
    (sharded under sequence parallelism; fp32 under autocast). Cached: the memory model
    and the allocator's rounding (:mod:`simulator.model.device_memory`) ask for the same
    layers, stage after stage and candidate after candidate in a plan."""
    x = Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    if recompute == "full":
        return (x.rs * x.local * spec.hidden,)
    ops = moe_layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, "fwd", stack) \
        if moe_layer else \
        dense_layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, "fwd", stack)
    if recompute != "none":  # selective (its modules) or torchtitan's per-op policy
        return kept_tensors(x, ops, recompute)
    return tuple(op.saved for op in ops if op.saved > 0)


def kept_for_backward(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                      dtype: str, recompute: str, stack: StackSpec, layer: int = 0) -> float:
    """Bytes one layer (dense, or a mixture of experts' ``layer``) keeps between its
    forward and backward: the sum of :func:`saved_tensors`."""
    return sum(saved_tensors(spec, micro_batch, tp, sequence_parallel, dtype, recompute,
                             stack, spec.is_moe_layer(layer)))




def latent_kept(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                dtype: str, recompute: str, stack: StackSpec, layer: int) -> tuple[float, ...]:
    """The tensors a latent-attention model's ``layer`` keeps short of full recomputation:
    what its coarser forward ops save (:func:`simulator.model.moe.layer_ops`), less what a
    selective policy's modules drop
    (:func:`~simulator.model.inventory.recompute_policy.kept_tensors`; the default
    ``core_attn`` drops nothing from a flash core that keeps only its inputs)."""
    ops = moe.layer_ops(spec, micro_batch, tp, sequence_parallel, dtype, "fwd", layer,
                        stack=stack)
    if recompute in ("none", "selective"):
        return tuple(op.saved for op in ops if op.saved > 0)
    x = Shape(spec, micro_batch, tp, sequence_parallel, dtype_bytes(dtype), stack)
    return kept_tensors(x, ops, recompute)
