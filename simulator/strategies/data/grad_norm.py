"""Gradient clipping over sharded gradients: the global norm's all-reduce.

With ZeRO-3 / FSDP each rank holds a shard of every gradient, so the clipping norm is
each rank's local norm reduced over the shard group before any gradient can be
scaled: PyTorch FSDP1 ``FullyShardedDataParallel.clip_grad_norm_``
(torch/distributed/fsdp/fully_sharded_data_parallel.py, v2.1.0: the local sharded
norm to the power p, ``dist.all_reduce(total_norm, group=self.process_group)``, then
the p-th root; Composer's ``gradient_clipping`` calls it on the root module) and FSDP2
under torchtitan (``torchtitan/distributed/utils.py`` ``clip_grad_norm_``: the norm is
a DTensor with a partial placement and ``total_norm.full_tensor()`` all-reduces it over
the mesh); DeepSpeed's ZeRO-3 step likewise all-reduces its norm groups' norms over the
data-parallel group (deepspeed/runtime/zero/stage3.py ``step`` → ``_get_norm_groups`` →
``get_grad_norm_direct``; the ``.item()`` that follows there, a host wait, is not
modelled). One fp32 scalar, issued on the current stream after the backward's
reductions have been waited for and before the optimizer step, so it sits on the
compute stream's critical path: a latency-bound collective whose time grows with the
group (NCCL's tree, 2 log2 N network hops).

Only ZeRO-3 (``parallel.zero: 3``) with ``stack.grad_clip``: DDP's gradients are whole
after their all-reduce (``torch.nn.utils.clip_grad_norm_`` needs no collective), and the
ZeRO-1/2 and model-parallel norm reductions (Megatron's, DeepSpeed's, torchtitan's over
its tensor- and pipeline-parallel meshes) are not modelled here.
"""

from __future__ import annotations

from simulator.spec.scenario import Scenario
from simulator.strategies.timing import collective_time
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout

GRAD_NORM_BYTES = 4.0  # one fp32 scalar (FSDP1 computes the local norms in fp32)


def grad_norm_reduced(s: Scenario) -> bool:
    """Whether a step all-reduces the clipping norm: clipping on ZeRO-3's shards."""
    return s.stack.grad_clip and s.parallel.zero == 3 and not s.parallel.zero_offload


def grad_norm_time(s: Scenario, layout: Layout, hw: HardwareProfile) -> float:
    """The norm's all-reduce over a rank's shard group, uncontended (0 where the step
    has none, or the group is one rank)."""
    if not grad_norm_reduced(s):
        return 0.0
    return collective_time(s, layout, "all_reduce", GRAD_NORM_BYTES, layout.shard_group(0), hw)
