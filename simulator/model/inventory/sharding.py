"""What sharding data parallelism adds to the inventory: ZeRO-3's collectives per
layer (one, or one per linear module), FSDP's own kernels around its all-gathers and
reduce-scatters (FSDP2's copies; FSDP1's casts and divisions,
:mod:`simulator.model.inventory.fsdp1`), and torch DDP's bucket copies.
"""

from __future__ import annotations

from dataclasses import replace

from simulator.model.inventory import fsdp1
from simulator.model.inventory.dense import weight_elements
from simulator.model.inventory.ops import Op, Shape, mem, qkv_linears, up_linears
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import StackSpec


def zero3_collectives(spec: ModelSpec, stack: StackSpec) -> int:
    """All-gathers (and reduce-scatters) one dense layer's parameters take under ZeRO-3:
    one per layer, or one per linear module (QKV, or q, k, v; out-proj; MLP up, or
    gate and up; down), as :func:`zero3_blocks` lists them. A mixture of experts gathers
    whole layers (the expert pass regroups the experts)."""
    return sum(len(parts) for parts in zero3_blocks(spec, stack, 1, 1.0).values())


def zero3_blocks(spec: ModelSpec, stack: StackSpec, tp: int,
                 layer_elements: float) -> dict[str, tuple[float, ...]]:
    """The elements of each of one dense layer's ZeRO-3 all-gathers on one TP rank
    (:func:`zero3_collectives` of them), by the block that needs them first: the whole
    layer under ``attn`` for a layer unit (FSDP), else each linear module's weight
    under its block (DeepSpeed: q, k, v or QKV and out-proj under ``attn``; gate and up
    or up, and down under ``mlp``). ``layer_elements`` (the layer's parameters on the
    rank) is shared out in proportion to the weights, so the norms and biases that
    DeepSpeed keeps whole (``stage3_param_persistence_threshold``, 1e5 elements) ride
    with them; they are under 0.1% of a layer at these sizes."""
    if stack.zero3_unit == "layer" or spec.is_moe:
        return {"attn": (layer_elements,)}
    x = Shape(spec, 1, tp, False, 2, stack)
    qkv = [x.spec.hidden * x.q] + [x.spec.hidden * x.kv] * 2 if qkv_linears(stack) == 3 \
        else [weight_elements(x, "qkv")]
    ups = up_linears(spec, stack)
    up = [weight_elements(x, "mlp_up") / ups] * ups
    weights = {"attn": (*qkv, weight_elements(x, "out_proj")),
               "mlp": (*up, weight_elements(x, "mlp_down"))}
    scale = layer_elements / sum(sum(w) for w in weights.values())
    return {block: tuple(w * scale for w in ws) for block, ws in weights.items()}


#: parameter tensors of a stage's root unit (FSDP2's ``fully_shard`` on the stage's
#: module): the embedding tables and the final norm's
ROOT_TENSORS = 4


#: parameter tensors an end of the model adds to a gradient entry: the embedding's two
#: tables, or the final norm's weight and bias riding with the first layer reduced
END_TENSORS = 2


#: ops before a collective on its stream, ops after it on the compute stream
GatherParts = tuple[tuple[Op, ...], tuple[Op, ...]]

#: ops on the compute stream before a reduce-scatter, on its stream before it, after it
ReduceParts = tuple[tuple[Op, ...], tuple[Op, ...], tuple[Op, ...]]


def fsdp_runtime(stack: StackSpec) -> str | None:
    """The FSDP whose own kernels the stack runs around its collectives: ``fsdp2``
    (``fsdp_copies``), ``fsdp1`` (``fsdp_flat_param``) or none."""
    return "fsdp2" if stack.fsdp_copies else "fsdp1" if stack.fsdp_flat_param else None


def fsdp_gather_parts(stack: StackSpec, elements: float, dp: int, dt: int,
                      tensors: int) -> GatherParts:
    """The stack's FSDP kernels around one unit's all-gather of ``elements`` parameters of
    ``dt`` bytes over ``dp`` ranks (``tensors`` parameter tensors): (before it on its
    stream, after it on the compute stream); none without an FSDP runtime."""
    runtime = fsdp_runtime(stack)
    if runtime is None or elements <= 0:
        return (), ()
    if runtime == "fsdp1":
        return fsdp1.gather_parts(stack, elements, dp, dt)
    return _fsdp2_gather(stack, elements, dp, dt, tensors)


def fsdp_reduce_parts(stack: StackSpec, elements: float, dp: int, grad_dt: int,
                      reduce_dt: int, tensors: int, accumulate: bool,
                      replicas: int = 1) -> ReduceParts:
    """The stack's FSDP kernels around one unit's reduce-scatter of ``elements``
    gradients over ``dp`` ranks (``replicas`` hybrid-sharding replicas), on a micro-batch
    after the first (``accumulate``) or not: (on the compute stream before it, on its
    stream before it, after it there); none without an FSDP runtime."""
    runtime = fsdp_runtime(stack)
    if runtime is None or elements <= 0:
        return (), (), ()
    if runtime == "fsdp1":
        return fsdp1.reduce_parts(stack, elements, dp, grad_dt, reduce_dt, accumulate,
                                  replicas)
    return _fsdp2_reduce(elements, dp, grad_dt, reduce_dt, tensors, accumulate)


def fsdp_gather_ops(stack: StackSpec, elements: float, dp: int, dt: int,
                    tensors: int) -> tuple[Op, ...]:
    """:func:`fsdp_gather_parts` in the order they run."""
    return tuple(op for part in fsdp_gather_parts(stack, elements, dp, dt, tensors)
                 for op in part)


def fsdp_reduce_ops(stack: StackSpec, elements: float, dp: int, grad_dt: int, reduce_dt: int,
                    tensors: int, accumulate: bool, replicas: int = 1) -> tuple[Op, ...]:
    """:func:`fsdp_reduce_parts` in the order they run."""
    return tuple(op for part in fsdp_reduce_parts(stack, elements, dp, grad_dt, reduce_dt,
                                                  tensors, accumulate, replicas)
                 for op in part)


def fsdp_task_name(ops: tuple[Op, ...]) -> str:
    """The name of the task that runs FSDP's ``ops``: theirs without the runtime's
    prefix (``fsdp_``, ``fsdp1_``), joined with ``+``."""
    return "+".join(op.name.split("_", 1)[1] for op in ops)


def _fsdp2_gather(stack: StackSpec, elements: float, dp: int, dt: int,
                  tensors: int) -> GatherParts:
    """FSDP2's copies around one unit's all-gather
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). Before it, on the
    all-gather's stream: under a MixedPrecisionPolicy (the stack keeps fp32 main grads
    beside fp32 sharded parameters, and trains in a 16-bit ``dt``)
    ``_get_param_all_gather_inputs`` casts the shard into a flat buffer
    (``torch._foreach_copy_``); ``all_gather_copy_in`` copies it into the rank's slot of
    the all-gather output (``_foreach_copy_``). After it, on the compute stream,
    ``foreach_all_gather_copy_out`` splits the gathered buffer into the unsharded
    parameters (``split_with_sizes_copy``: every element read and written once).
    Each is one kernel over the unit's ``tensors`` parameter tensors, whose host work is
    per tensor (the lists of views FSDP2 builds; on a CPU ``_foreach_copy_`` and
    ``split_with_sizes_copy`` loop over them)."""
    shard = elements / dp
    before = [per_tensor(mem("fsdp_cast_in", shard, 4 + dt, "copy"), tensors)] \
        if stack.main_grads == "fp32" and dt < 4 else []
    return ((*before, per_tensor(mem("fsdp_copy_in", shard, 2 * dt, "copy"), tensors)),
            (per_tensor(mem("fsdp_copy_out", elements, 2 * dt, "copy"), tensors),))


def per_tensor(op: Op, tensors: int) -> Op:
    """``op`` with host work per tensor (one kernel over a list of ``tensors``)."""
    return replace(op, host_units=max(tensors, 1))


def _fsdp2_reduce(elements: float, dp: int, grad_dt: int, reduce_dt: int, tensors: int,
                  accumulate: bool) -> ReduceParts:
    """FSDP2's copies around one unit's reduce-scatter (``foreach_reduce``,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): before it, on the compute
    stream, ``chunk_cat`` packs the unsharded gradients (``grad_dt`` bytes) into the
    reduce-scatter input (``reduce_dt``: the cast to the reduce dtype happens in it);
    after it, on a micro-batch after the first (``accumulate``), each of the unit's
    ``tensors`` sharded ``.grad`` adds its reduced shard (``grad._local_tensor +=
    new_sharded_grad``, one add per tensor; the first micro-batch's shard becomes
    ``.grad`` as it is). No division kernels: for an fp32 or bf16 reduce dtype NCCL
    averages (``_get_gradient_divide_factors``: ``ReduceOp.AVG``)."""
    pack = (per_tensor(mem("fsdp_chunk_cat", elements, grad_dt + reduce_dt, "copy"), tensors),)
    add = (mem("fsdp_grad_accum", elements / dp, 3 * reduce_dt, "elementwise", tensors),) \
        if accumulate else ()
    return pack, (), add


def ddp_copy_ops(stack: StackSpec, elements: float, dt: int, tensors: int,
                 back: bool) -> tuple[Op, ...]:
    """torch DDP's copies of ``elements`` gradients of ``dt`` bytes in ``tensors`` tensors,
    under a stack with ``ddp_copies`` (torch/csrc/distributed/c10d/reducer.cpp, with
    ``gradient_as_bucket_view=False``): into a bucket, each gradient scaled by 1/N on the
    way as it becomes ready (``mark_variable_ready_dense``: ``at::mul_out``, one kernel per
    tensor; a plain ``copy_`` under a communication hook), or (``back``) the reduced
    buckets back into the gradients once the backward's reductions are done
    (``finalize_bucket_dense``: ``copy_bucket_to_grad``, one per tensor). Each reads
    and writes every element once."""
    if not stack.ddp_copies or elements <= 0:
        return ()
    return (mem("ddp_bucket_out" if back else "ddp_bucket_in", elements, 2 * dt,
                "copy" if back else "elementwise", max(tensors, 1)),)
