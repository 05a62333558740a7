"""Tensor parallelism in the inventory: which ops DTensor's parallel styles run as
distributed tensors, and how many collectives a block, the model's ends and the
optimizer's norms issue (Megatron-LM's and DTensor's counts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from simulator.model.inventory.ops import (
    Op,
    Shape,
    dense_layer_tensors,
    norm_tensors,
    qkv_linears,
    up_linears,
)
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec
from simulator.system.units import CollectiveName

#: ops on DTensor operands when TP runs as DTensor (torch.distributed.tensor.parallel):
#: the Colwise/Rowwise linears (their GEMMs, bias and weight grads); under sequence
#: parallelism also the norms (``SequenceParallel`` replicates their parameters) and the
#: residual stream, which stays a sequence-sharded DTensor between layers
DTENSOR_OPS = ("qkv", "out_proj", "mlp_up", "mlp_down", "bias_grad", "grad_accum")


DTENSOR_SP_OPS = ("ln1", "ln2", "residual", "grad_sum", "norm_grad")


def dtensor(x: Shape, ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """Mark the ops DTensor dispatches (each pays its sharding propagation on the host)."""
    if not x.st.dtensor or x.tp == 1:
        return ops
    names = DTENSOR_OPS + (DTENSOR_SP_OPS if x.sp else ())
    return tuple(replace(op, dtensor=op.kernels) if op.name in names else op for op in ops)


def dtensor_tensors(spec: ModelSpec, stack: StackSpec, tp: int, sp: bool) -> int:
    """Parameter tensors of one dense layer that are DTensors under TP (their optimizer
    ops dispatch through DTensor): the linears' weights and biases, and with sequence
    parallelism the norms' too."""
    if not stack.dtensor or tp == 1:
        return 0
    return dense_layer_tensors(spec, stack) - (0 if sp else 2 * norm_tensors(spec))


def tp_block_collectives(spec: ModelSpec, stack: StackSpec, tp: int, sp: bool, label: str,
                         backward: bool) -> int:
    """TP collectives after one block (``attn`` or ``mlp``) in one pass, besides the
    all-gather before it under sequence parallelism.

    Megatron-LM: one (Shoeybi et al. 2019, §3: the row-parallel output's all-reduce in
    forward, the column-parallel input gradient's in backward). TP as DTensor without
    sequence parallelism, in backward: every ``ColwiseParallel`` module wraps its plain
    input in a replicated DTensor of its own (torch/distributed/tensor/parallel/style.py,
    ``ColwiseParallel._prepare_input_fn``: ``DTensor.from_local(input, mesh,
    Replicate())``), so each one's partial input gradient is all-reduced on its own: q,
    k and v (one with fused projections), and gate and up of a gated MLP. Under
    sequence parallelism one ``PrepareModuleInput`` gathers the block's input, which
    its projections share, so one reduce-scatter serves them all."""
    if tp == 1:
        return 0
    if not (stack.dtensor and backward and not sp):
        return 1
    return qkv_linears(stack) if label == "attn" else up_linears(spec, stack)


#: What a TP collective at the model's ends carries: the b·s·h activation (or its
#: gradient), the b·s·V logits, the cross-entropy's fp32 value per token, or a
#: multi-token prediction module's b·s·2h concatenation (its projection's input).
EndPayload = Literal["activation", "logits", "loss", "mtp_input"]


def tp_end_collectives(stack: StackSpec, tp: int, sp: bool,
                       where: Literal["embed", "head", "loss", "mtp_proj"], forward: bool,
                       ) -> tuple[tuple[CollectiveName, EndPayload], ...]:
    """The TP collectives of one micro-batch at the model's ends, in order.

    Megatron's vocab-parallel ends: the embedding's partial sums all-reduced after its
    forward (reduce-scattered under sequence parallelism), its incoming gradient
    all-gathered under SP; the output layer's replicated input all-gathered under SP and
    its input gradient all-reduced (reduce-scattered); the vocab-parallel cross-entropy's
    three fp32 all-reduces per token (max, target logit, sum of exponentials). As DTensor
    (``stack.dtensor``): the embedding's output all-reduced to a replicated tensor even
    under SP (then cut locally), and the logits all-gathered whole (``ColwiseParallel``
    with a replicated output) for a cross-entropy with no collective of its own.

    A multi-token prediction module's projection (``mtp_proj``, Megatron-LM's
    ``MultiTokenPredictionLayer._concat_embeddings``): a column-parallel linear over the
    2h concatenation (its input all-gathered under SP, its input gradient reduce-scattered,
    or all-reduced without SP), whose output is all-gathered whole
    (``gather_from_tensor_model_parallel_region``) and, under SP, cut to the rank's
    tokens again (its gradient all-gathered)."""
    if tp == 1:
        return ()
    if where == "mtp_proj":
        if forward:
            return (("all_gather", "mtp_input"), ("all_gather", "activation")) if sp else \
                (("all_gather", "activation"),)
        return (("all_gather", "activation"), ("reduce_scatter", "mtp_input")) if sp else \
            (("all_reduce", "mtp_input"),)
    if where == "loss":
        if not forward:
            return ()
        return (("all_gather", "logits"),) if stack.dtensor else (("all_reduce", "loss"),) * 3
    if where == "embed":
        if forward:
            return (("reduce_scatter" if sp and not stack.dtensor else "all_reduce",
                     "activation"),)
        return (("all_gather", "activation"),) if sp else ()
    if forward:
        return (("all_gather", "activation"),) if sp else ()
    return (("reduce_scatter" if sp else "all_reduce", "activation"),)


def tp_optimizer_collectives(spec: ModelSpec, stack: StackSpec, tp: int, sp: bool,
                             layers: int, last: bool) -> int:
    """All-reduces the optimizer step issues over the TP group on a rank holding
    ``layers`` layers (two norms each) and, on the ``last`` stage, the final norm: under
    DTensor with sequence parallelism the norms'
    replicated parameters keep partial gradients until the for-loop AdamW reads them,
    and each op with the gradient as an operand all-reduces it (torch/optim/adam.py
    ``_single_tensor_adam``: ``exp_avg.lerp_(grad)`` and
    ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad)``), three per norm tensor, each of
    ``hidden`` elements."""
    if tp == 1 or not (stack.dtensor and sp) or stack.optimizer != "per_tensor":
        return 0
    return 3 * (2 * layers + (1 if last else 0)) * norm_tensors(spec)
