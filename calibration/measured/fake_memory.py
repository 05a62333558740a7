"""PyTorch's own memory accounting of one FSDP2 training step, without a GPU.

The measured model (:mod:`calibration.measured.gpt`, Llama's block under ``arch:
llama``) is built under ``FakeTensorMode`` (tensors with shapes, dtypes and devices but
no storage), each block wrapped with ``fully_shard`` (FSDP2, a ``MixedPrecisionPolicy``
of the scenario's stack), the root wrapped last, over a fake process group of the
scenario's shard size (rank 0 of N: ``torch.testing._internal.distributed.fake_pg``'s
``FakeStore`` and the ``fake`` backend, whose collectives return at once). One forward,
backward and AdamW step of the scenario's micro-batch then runs under
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which counts every tensor
the step allocates by what it is (``_FSDPRefType``: sharded and unsharded parameters
and gradients, activations, backward temporaries, optimizer states, the all-gather and
reduce-scatter buffers) and keeps the snapshot at the peak. This is what torchtitan's
``scripts/estimate/estimation.py`` did (it was removed later); the pieces are torch's.

Two steps run: the first creates AdamW's states (lazily, in its first ``step``), the
second is tracked, as a steady-state step. The first is not tracked: a tracker entered
over both counts the second step's states again (torch 2.13: OptState reads about ten
times AdamW's two moments after ``reset_mod_stats``), one entered after the first reads
them right. A step of several micro-batches (gradient accumulation, each reduce-scattered
as FSDP2 does by default) runs all but the last before the tracker starts (it follows
one forward a unit): the tracked pass is the last, the earlier ones' sharded gradients
held.

The tensors live on the CPU: on a CPU-only build FSDP2's ``fully_shard`` asks
``torch.cuda.current_device()`` for a ``cuda`` mesh (``_fsdp_init._get_device_from_mesh``)
and fake CUDA tensors cannot be initialised (``uniform_`` dispatches to CUDA), so the
tracker counts CPU fake tensors. What differs from a GPU step: SDPA takes the CPU's
flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which also saves its
output and an fp32 log-sum-exp per row), and nothing of the caching allocator beyond
its 512-byte rounding, nor the CUDA context, cuBLAS workspaces or NCCL buffers.

Import this module only where torch is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import checkpoint

from calibration.measured.gpt import GPT, GPTConfig, loss_fn

#: the tracker's categories (``_FSDPRefType`` values) -> ours
CATEGORIES: dict[str, str] = {
    "Sharded Param": "weights",
    "Sharded Grad": "grads",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "Unsharded Param": "buffers",
    "Unsharded Grad": "buffers",
    "All Gather": "buffers",
    "Reduce Scatter": "buffers",
    "Buffer": "buffers",
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class FakeStep:
    """What the tracked step needs of a scenario (:mod:`calibration.measured.fake_memory_cli`)."""

    sizes: GPTConfig
    tied: bool  # output head shares the token embedding
    shards: int  # FSDP2 shard group size (rank 0 of it is tracked)
    micro_batch: int
    param_dtype: str  # MixedPrecisionPolicy.param_dtype
    reduce_dtype: str  # MixedPrecisionPolicy.reduce_dtype
    recompute: str  # none | full | op (each block under torch.utils.checkpoint)
    reshard_after_forward: bool
    microbatches: int = 1  # forward-backward passes a step (gradient accumulation)


#: what torchtitan's per-op policy saves (``_op_sac_save_list`` of
#: torchtitan/distributed/activation_checkpoint.py), plus the CPU's flash attention
OP_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def _op_policy() -> Any:
    """torchtitan's ``_get_custom_policy``: keep the outputs of :data:`OP_SAVE_LIST`'s ops
    but every second matrix multiply, re-run the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
        save = func in OP_SAVE_LIST and not (
            func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Checkpointed(nn.Module):
    """A block re-run in the backward (``torch.utils.checkpoint``, non-reentrant): under
    ``full`` only its input is kept (torchtitan's ``activation_checkpoint.mode =
    "full"``), under ``op`` what torchtitan's per-op policy saves (:func:`_op_policy`)."""

    def __init__(self, block: nn.Module, mode: str) -> None:
        super().__init__()
        self.block = block
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "op":
            out: torch.Tensor = checkpoint(self.block, x, use_reentrant=False,
                                           context_fn=_op_policy)
        else:
            out = checkpoint(self.block, x, use_reentrant=False)
        return out


def _fake_group(shards: int) -> Any:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=shards)
    return init_device_mesh("cpu", (shards,))


def _build(step: FakeStep, mesh: Any) -> GPT:
    """The model, its blocks (checkpointed under full recompute) and the root each
    ``fully_shard``-ed as torchtitan's ``apply_fsdp`` does (the last block stays gathered
    after its forward, the backward needs it at once)."""
    model = GPT(step.sizes)
    if not step.tied:  # Llama 3's own output matrix
        model.head = nn.Linear(step.sizes.hidden, step.sizes.vocab, bias=False)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[step.param_dtype],
                              reduce_dtype=DTYPES[step.reduce_dtype])
    keys = list(model.layers.keys())
    for i, key in enumerate(keys):
        block = model.layers[key]
        if step.recompute != "none":
            block = model.layers[key] = Checkpointed(block, step.recompute)
        last = i == len(keys) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=step.reshard_after_forward and not last)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def _forward_backward(model: GPT, tokens: torch.Tensor, microbatches: int = 1) -> None:
    """``microbatches`` forward-backward passes, each reduce-scattered as FSDP2 does by
    default (the sharded gradients accumulate from the first)."""
    for _ in range(microbatches):
        loss_fn(model(tokens), tokens).backward()


def _optimizer_step(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)


def _split(snap: dict[Any, dict[str, int]]) -> dict[str, Any]:
    """One peak snapshot: the tracker's categories and ours (:data:`CATEGORIES`)."""
    (device, counts), = ((d, c) for d, c in snap.items() if c.get("Total", 0) > 0)
    tracker_bytes = {k: int(v) for k, v in counts.items() if k != "Total"}
    ours: dict[str, int] = {}
    for name, nbytes in tracker_bytes.items():
        ours[CATEGORIES[name]] = ours.get(CATEGORIES[name], 0) + nbytes
    return {"device": str(device), "peak_bytes": int(counts["Total"]),
            "tracker": tracker_bytes, "by_item": ours}


def peak_moment(tracker: FSDPMemTracker, model: GPT, peak: int) -> dict[str, str]:
    """Where the forward-and-backward peak of ``peak`` bytes happened, from the tracker's
    per-unit peaks (``memory_tracking``: each ``fully_shard`` unit's peak while it ran
    forward and backward): ``block`` in the backward of the last block (the backward's
    first), ``later block`` in another block's backward, ``forward`` in a block's
    forward, ``root`` in the root unit's own modules (embedding, norm, head), ``loss``
    outside every unit (the loss's backward, before the root's pre-backward hook), with
    the unit's name."""
    blocks = list(model.layers.values())
    units = [(b, "block" if i == len(blocks) - 1 else "later block")
             for i, b in enumerate(blocks)]
    for state, label in ((_FSDPModState.PEAK_BW, None), (_FSDPModState.PEAK_FW, "forward")):
        for unit, name in [*units, (model, "root")]:
            stats = tracker.memory_tracking.get(unit)
            snaps = stats.snapshots.get(state, []) if stats is not None else []
            if any(snap.get("Total", 0) == peak for s in snaps for snap in s.values()):
                return {"moment": label or name, "module": stats.mod_fqn}
    return {"moment": "loss", "module": ""}


def tracked_peak(step: FakeStep,
                 progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The tracker's peak snapshots of a steady-state step on rank 0, in bytes: over the
    forward and backward, and over the whole step (the optimizer's step included; fused
    AdamW, which updates in place), and where the first happened (:func:`peak_moment`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mesh = _fake_group(step.shards)
    try:
        with FakeTensorMode():
            progress(f"building {step.sizes.layers} layers under FakeTensorMode")
            model = _build(step, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            tokens = torch.zeros(step.micro_batch, step.sizes.seq_len, dtype=torch.long)
            progress("step 1 of 2 (creates AdamW's states, untracked)")
            _forward_backward(model, tokens, step.microbatches)
            _optimizer_step(opt)
            # the tracker follows one forward a unit: the earlier micro-batches run
            # before it, their sharded gradients there when it starts
            _forward_backward(model, tokens, step.microbatches - 1)
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((tokens,))
            with tracker:
                progress("step 2 of 2 (tracked: its last micro-batch and the optimizer)")
                _forward_backward(model, tokens)
                backward = tracker.get_tracker_snapshot("peak")
                where = peak_moment(tracker, model, _split(backward)["peak_bytes"])
                _optimizer_step(opt)
            step_peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    return {"forward_backward": _split(backward), "step": _split(step_peak), "peak_at": where}
