"""FSDP1's own kernels around one unit's collectives (PyTorch's FlatParameter FSDP, as
Composer ran it: torch/distributed/fsdp/_runtime_utils.py and _flat_param.py), for a stack
with ``fsdp_flat_param``. Each is one kernel over the unit's flat parameter or its shard
(the FlatParameter is one tensor), in three places:

- before each all-gather, on the pre-unshard stream the unshard stream waits for: under
  mixed precision (fp32 parameters, 16-bit compute) ``FlatParamHandle.pre_unshard`` ->
  ``_use_low_precision_shard`` copies the fp32 shard into the 16-bit ``_mp_shard``
  (``copy_`` casts), the all-gather's input; the gathered buffer
  (``_alloc_padded_unsharded_flat_param``) is the parameters' storage, views, no copy out;
- after the unit's backward, on the compute stream: autograd's backward of the split into
  parameter views (``_get_unflat_views``: ``torch.split``, whose backward concatenates the
  views' gradients into the flat parameter's, ``at::cat``);
- around the reduce-scatter, on the post-backward stream that runs it (it waits for the
  compute stream: ``_post_backward_hook``): the cast of the unsharded gradient to the reduce
  dtype (``flat_param.grad.to(reduce_dtype)``) and the pre-divide
  (``_div_if_needed(padded_unsharded_grad, predivide)``; ``_get_reduce_scatter_tensors``
  pads with ``F.pad`` only a flat parameter that does not divide among the ranks, and
  under ``use_orig_params``, Composer's default, ``_init_flat_param_and_metadata`` pads it
  to a multiple of the group once at construction); after it the post-divide of the
  shard, its cast to the parameter dtype (``_cast_grad_to_param_dtype``) and, from the
  second micro-batch of a step on, its add into the saved shard
  (``_accumulate_sharded_grad``: ``_saved_grad_shard += sharded_grad``; Composer reduces
  every micro-batch, its ``ddp_sync_context`` yields at once for a model that is not DDP).

Where FSDP issues a kernel is not all of where it costs: the cast and pre-divide, a
whole unit each, get SMs only as the compute stream's kernels leave them, so the engine
runs them on the compute stream (:meth:`simulator.strategies.data.workload.DataPass.fsdp_copies`,
docs/model.md "Kernels beside the compute").
"""

from __future__ import annotations

from simulator.model.inventory.ops import Op, mem
from simulator.spec.stack import StackSpec


def divide_factors(world: int) -> tuple[float, float]:
    """(pre, post) divisions of the gradient sum over ``world`` data-parallel ranks:
    FSDP1 divides by ``pre`` before the reduce-scatter and by ``world / pre`` after it,
    ``pre`` doubled from 1 while it divides ``world`` and is below ``world / pre`` (a power
    of two 2^k: 2^ceil(k/2); torch/distributed/algorithms/_comm_hooks/default_hooks.py
    ``DefaultState._get_gradient_predivide_factor``, _init_utils.py ``_init_core_state``)."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return float(factor), world / factor


def param_bytes(stack: StackSpec, dt: int) -> int:
    """Bytes of an element of the sharded FlatParameter and of its gradient: fp32 under
    mixed precision (``stack.fp32_params``), else the training dtype's."""
    return 4 if stack.fp32_params(dt) else dt


def gather_parts(stack: StackSpec, elements: float, dp: int,
                 dt: int) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """(before, after) one unit's all-gather of ``elements`` parameters over ``dp``
    ranks: the cast of the fp32 shard to the ``dt``-byte compute dtype before it under
    mixed precision, nothing after it."""
    if param_bytes(stack, dt) == dt:
        return (), ()
    return (mem("fsdp1_shard_cast", elements / dp, 4 + dt, "copy"),), ()


def reduce_parts(stack: StackSpec, elements: float, dp: int, grad_dt: int, reduce_dt: int,
                 accumulate: bool, replicas: int = 1
                 ) -> tuple[tuple[Op, ...], tuple[Op, ...], tuple[Op, ...]]:
    """(on the compute stream, before the reduce-scatter on its stream, after it there)
    for one unit's reduce-scatter of ``elements`` gradients of ``grad_dt`` bytes over
    ``dp`` ranks in ``reduce_dt``, on a micro-batch after the first (``accumulate``) or
    not, with ``replicas`` hybrid-sharding replicas (the divisions are by the whole
    data-parallel group's size)."""
    pre, post = divide_factors(dp * replicas)
    shard, p = elements / dp, param_bytes(stack, grad_dt)
    compute = (mem("fsdp1_grad_cat", elements, 2 * grad_dt, "copy"),)
    before = [mem("fsdp1_grad_cast", elements, grad_dt + reduce_dt, "copy")] \
        if reduce_dt != grad_dt else []
    if pre > 1:
        before.append(mem("fsdp1_predivide", elements, 2 * reduce_dt, "elementwise"))
    after = [mem("fsdp1_postdivide", shard, 2 * reduce_dt, "elementwise")] if post > 1 else []
    if p != reduce_dt:
        after.append(mem("fsdp1_shard_grad_cast", shard, reduce_dt + p, "copy"))
    if accumulate:
        after.append(mem("fsdp1_grad_accum", shard, 3 * p, "elementwise"))
    return compute, tuple(before), tuple(after)
