"""torchrun worker of ``clustersim measure``: train the small GPT with real TP/PP/DP.

Launched by :func:`calibration.measured.measure.run_measure` as
``python -m torch.distributed.run --standalone --nproc-per-node=W -m
calibration.measured.parallel_worker --config RUN.json``; every rank reads the same
:class:`calibration.measured.measure.MeasureConfig`.

Parallelism, all with PyTorch's own APIs on one ``(pp, dp, tp)`` DeviceMesh
(tp innermost, so TP peers are neighbouring ranks as on a real node):

* **TP** - ``parallelize_module`` in the Megatron pattern: q/k/v and MLP-up
  ``ColwiseParallel``, attention-out and MLP-down ``RowwiseParallel``, the
  (vocab-sharded) embedding ``RowwiseParallel`` and the tied head
  ``ColwiseParallel``; with sequence parallelism the LayerNorms run
  ``SequenceParallel`` and the residual stream stays sharded on the sequence.
* **PP** - the layers are cut evenly into ``pp * virtual_stages`` stages by
  hand; each rank wraps its stage(s) in ``PipelineStage`` and runs
  ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` (two
  stages per rank, "loop" placement).  With ``pp > 1`` the first and last stage
  each hold a copy of the tied embedding; their gradients are summed after
  every step (as Megatron does), so the copies stay equal.
* **DP** - ZeRO-0: ``DistributedDataParallel`` on the dp group (with the PowerSGD
  communication hook when ``powersgd_rank`` is set:
  :mod:`calibration.measured.compression_hook`), or (when TP is
  also on, since DDP does not take DTensor parameters) the FSDP2-based
  ``replicate``; ZeRO-3: ``fully_shard`` per block plus the root.  Without PP,
  ZeRO-0 all-reduces once per step (``no_sync`` on earlier micro-batches) and
  ZeRO-3 reduce-scatters after every micro-batch; under PP the pipelining
  stage decides (it reduces after the last micro-batch).

Measurement: the steps are timed, one is profiled and rank 0 writes ``measured.json``
as for every measured worker (:mod:`calibration.measured.worker_run`,
:mod:`calibration.measured.timing`); with ``slow_rank`` that rank's compute is slowed
down on purpose (:mod:`calibration.measured.slow_rank`), and with ``pp > 1`` the
summary says how far the tied embedding's two copies lie apart.

Test hooks: ``CLUSTERSIM_TEST_CRASH_RANK=r`` makes rank ``r`` raise after the
process group is up; ``CLUSTERSIM_TEST_HANG_RANK=r`` makes it sleep forever.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from calibration.measured.compression_hook import powersgd_ddp_options, register_powersgd
from calibration.measured.gpt import GPT, GPTConfig, keep_stage_modules, loss_fn, synthetic_batch
from calibration.measured.measure_config import MeasureConfig
from calibration.measured.slow_rank import report as slow_report
from calibration.measured.slow_rank import slow_down
from calibration.measured.worker_run import record_run, worker_main

CRASH_ENV = "CLUSTERSIM_TEST_CRASH_RANK"
HANG_ENV = "CLUSTERSIM_TEST_HANG_RANK"


# --------------------------------------------------------------------------- TP
def tp_plan(model: GPT, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The Megatron TP plan for whatever parts of the model this stage holds."""
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.embed is not None:
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            # Token + position are summed replicated, then cut along the
            # sequence locally (no communication).
            plan["embed"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)
            )
    for key in model.layers:
        pre = f"layers.{key}."
        plan.update(
            {
                pre + "attn.q": ColwiseParallel(),
                pre + "attn.k": ColwiseParallel(),
                pre + "attn.v": ColwiseParallel(),
                pre + "attn.out": RowwiseParallel(output_layouts=residual),
                pre + "mlp.up": ColwiseParallel(),
                pre + "mlp.down": RowwiseParallel(output_layouts=residual),
            }
        )
        if model.cfg.is_llama:  # SwiGLU's gate, split as its up projection is
            plan[pre + "mlp.gate"] = ColwiseParallel()
        if sp:
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan.update(
                {
                    pre + "ln1": SequenceParallel(),
                    pre + "ln2": SequenceParallel(),
                    pre + "attn": gather,
                    pre + "mlp": gather,
                }
            )
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.head is not None:
        plan["head"] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate())
    return plan


def apply_tp(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    parallelize_module(model, tp_mesh, tp_plan(model, sequence_parallel))
    # Both the embedding (RowwiseParallel) and the head (ColwiseParallel) shard
    # the vocab x hidden matrix on dim 0, so the tie survives as one DTensor.
    model.tie_weights()


# --------------------------------------------------------------------------- DP
def apply_dp(module: GPT, cfg: MeasureConfig, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Wrap one (stage) module for data parallelism; returns what to call. ZeRO-3 wraps
    with FSDP2 even at dp 1 (a one-rank mesh: its all-gather copies and resharding
    still run, as a one-GPU FSDP2 run has them)."""
    if cfg.dp == 1 and cfg.zero == 0:
        return module
    dp_mesh = mesh["dp"]
    if cfg.zero == 3 or cfg.tp > 1:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import fully_shard

        wrap: Callable[..., Any] = fully_shard if cfg.zero == 3 else replicate
        for block in module.layers.values():
            wrap(block, mesh=dp_mesh)
        wrap(module, mesh=dp_mesh)
        return module
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        module,
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        **(powersgd_ddp_options() if cfg.powersgd_rank else {}),
    )
    if cfg.powersgd_rank:
        register_powersgd(ddp, cfg.powersgd_rank, cfg.warmup)
    return ddp


def build_stage(
    cfg: MeasureConfig, mesh: DeviceMesh, device: torch.device, stage: int, stages: int
) -> tuple[GPT, nn.Module]:
    """Build the (stage of the) model identically on every rank and parallelise it."""
    gcfg = GPTConfig.from_dict(cfg.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = GPT(gcfg)
    if stages > 1:
        keep_stage_modules(model, stage, stages)
    model.to(device)
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"], cfg.sequence_parallel)
    return model, apply_dp(model, cfg, mesh, device)


# --------------------------------------------------------------------------- steps
class Trainer:
    """One training step of the configured parallel layout, as a callable."""

    def __init__(self, cfg: MeasureConfig, mesh: DeviceMesh, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.coords = {d: mesh[d].get_local_rank() for d in ("pp", "dp", "tp")}
        gcfg = GPTConfig.from_dict(cfg.model)
        batch = cfg.micro_batch_size * cfg.micro_batches
        # Same data on TP peers and on all stages of a replica; new data per replica.
        self.inputs, self.targets = synthetic_batch(
            gcfg, batch, cfg.seed + 1 + self.coords["dp"], device
        )
        self.models: list[GPT] = []
        self.wrapped: list[nn.Module] = []
        self.schedule: Any = None
        self.tied_group: dist.ProcessGroup | None = None
        if cfg.pp == 1:
            model, wrapped = build_stage(cfg, mesh, device, 0, 1)
            self.models, self.wrapped = [model], [wrapped]
        else:
            self._build_pipeline(mesh)
        params = {id(p): p for m in self.models for p in m.parameters()}
        self.optimizer = torch.optim.AdamW(list(params.values()), lr=3e-4, weight_decay=0.1)
        self.autocast: Callable[[], AbstractContextManager[Any]] = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
            if device.type == "cuda"
            else nullcontext
        )

    def _build_pipeline(self, mesh: DeviceMesh) -> None:
        from torch.distributed.pipelining import PipelineStage

        cfg = self.cfg
        stages = cfg.pp * cfg.virtual_stages
        pp_rank = self.coords["pp"]
        pipe_stages = []
        for local in range(cfg.virtual_stages):
            index = pp_rank + local * cfg.pp  # "loop" placement, as the schedules expect
            model, wrapped = build_stage(cfg, mesh, self.device, index, stages)
            self.models.append(model)
            self.wrapped.append(wrapped)
            pipe_stages.append(
                PipelineStage(wrapped, index, stages, self.device, group=mesh["pp"].get_group())
            )
        self.has_first = any(s.is_first for s in pipe_stages)
        self.has_last = any(s.is_last for s in pipe_stages)
        self.schedule = make_schedule(cfg, pipe_stages)
        self.tied_group = tied_embedding_group(mesh)

    def tied_weight(self) -> torch.Tensor | None:
        """This rank's copy of the tied embedding (first or last stage), if any."""
        for model in self.models:
            if model.embed is not None:
                return model.embed.tok.weight
            if model.head is not None:
                return model.head.weight
        return None

    def __call__(self) -> torch.Tensor | None:
        """One optimizer step; returns the step's mean loss (a tensor, not synced) where known."""
        with self.autocast():
            if self.cfg.pp == 1:
                loss: torch.Tensor | None = self._accumulate()
            else:
                args = (self.inputs,) if self.has_first else ()
                target = self.targets if self.has_last else None
                losses: list[torch.Tensor] = []
                self.schedule.step(*args, target=target, losses=losses)
                loss = torch.stack(losses).mean().detach() if losses else None
                self._sum_tied_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _accumulate(self) -> torch.Tensor:
        m = self.cfg.micro_batches
        model = self.wrapped[0]
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(self.inputs.chunk(m), self.targets.chunk(m), strict=True)):
            with self._sync_context(model, last=i == m - 1):
                loss = loss_fn(model(x), y) / m
                loss.backward()
            total += loss.detach()
        return total

    def _sync_context(self, model: nn.Module, last: bool) -> AbstractContextManager[Any]:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            return nullcontext() if last else model.no_sync()
        if self.cfg.dp > 1 and self.cfg.zero == 0:
            # FSDP2-based replicate (TP + DP): all-reduce on the last micro-batch only.
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return nullcontext()

    def _sum_tied_grads(self) -> None:
        weight = self.tied_weight()
        if self.tied_group is None or weight is None or weight.grad is None:
            return
        grad = weight.grad
        if (
            isinstance(grad, DTensor)
            and isinstance(weight, DTensor)
            and grad.placements != weight.placements
        ):
            # The TP embedding's backward yields a replicated gradient of a
            # vocab-sharded weight; cut it (locally) to the weight's layout
            # so both stages all-reduce equal-sized shards.
            grad = grad.redistribute(weight.device_mesh, weight.placements)
            weight.grad = grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self.tied_group)

    def tied_weight_diff(self) -> float | None:
        """Max |first-stage copy - last-stage copy| of the tied embedding (pp > 1)."""
        weight = self.tied_weight()
        if self.tied_group is None or weight is None:
            return None
        local = (weight.to_local() if isinstance(weight, DTensor) else weight).detach().float()
        gathered = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(gathered, local.contiguous(), group=self.tied_group)
        return float((gathered[0] - gathered[1]).abs().max())


def make_schedule(cfg: MeasureConfig, stages: list[Any]) -> Any:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    if cfg.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=cfg.micro_batches, loss_fn=loss_fn)
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.schedule]
    return single(stages[0], n_microbatches=cfg.micro_batches, loss_fn=loss_fn)


def tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The {first stage, last stage} group holding this rank's tied-weight copies.

    ``new_group`` is collective over the world, so every rank creates every
    pair in the same order and keeps its own.
    """
    ranks = mesh.mesh  # shape (pp, dp, tp) of global ranks
    mine = None
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
    return mine


@record
def main(argv: list[str] | None = None) -> int:
    def checked(cfg: MeasureConfig, device: torch.device) -> None:
        _inject_test_faults(dist.get_rank())
        run(cfg, device)

    return worker_main(argv, __doc__.splitlines()[0], checked)


def _inject_test_faults(rank: int) -> None:
    if os.environ.get(CRASH_ENV) == str(rank):
        raise RuntimeError(f"injected crash on rank {rank} ({CRASH_ENV})")
    if os.environ.get(HANG_ENV) == str(rank):
        while True:
            time.sleep(1)


def run(cfg: MeasureConfig, device: torch.device) -> None:
    mesh = init_device_mesh(
        device.type, (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp")
    )
    trainer = Trainer(cfg, mesh, device)
    slow = slow_down(trainer.models, trainer.optimizer, cfg.slowdown) \
        if dist.get_rank() == cfg.slow_rank else None
    record_run(trainer, cfg, device,
               timed=None if slow is None else slow.counting(trainer, awake=cfg.warmup),
               extra=lambda steps: slow_report(slow, steps), tied_diff=trainer.tied_weight_diff)


if __name__ == "__main__":
    sys.exit(main())
