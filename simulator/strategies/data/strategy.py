"""Data parallelism with ZeRO-1/2 as a strategy: the batch's split into micro-batches
per replica, DDP's bucket copies and the parameter all-gather of the closed form, the
communication buffers it holds, and the search over ZeRO stages (and the derived
data-parallel degree).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from simulator.errors import Problem
from simulator.model import transformer as mdl
from simulator.model.inventory.layer import layer_tensors
from simulator.model.inventory.mtp import mtp_end_tensors
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.sharding import END_TENSORS, ddp_copy_ops
from simulator.spec.placement import embedding_copy_params, holds_embedding, holds_head
from simulator.spec.scenario import Scenario
from simulator.strategies.base import Dimension, Strategy
from simulator.strategies.compression import arithmetic as cmp
from simulator.strategies.data.workload import DataPass
from simulator.strategies.expert.layer import edp_group
from simulator.strategies.timing import collective_time
from simulator.system.costs import CostModel
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout

if TYPE_CHECKING:
    from simulator.builder.context import Context, Pass


def ddp_copies(s: Scenario, cost: CostModel, stage: int, layers: int) -> float:
    """Seconds per step of torch DDP's bucket copies on a stage
    (:func:`simulator.model.inventory.sharding.ddp_copy_ops`): each gradient into its bucket and,
    after
    the reductions, back, per entry of the stage's gradients as the engine lists them
    (:meth:`simulator.builder.context.Context.grad_units`: each layer, the head's norm with
    the first, the embedding's tables)."""
    par, spec, stack = s.parallel, s.model, s.stack
    if par.zero != 0 or par.dp * par.cp == 1 or not stack.ddp_copies \
            or cmp.effective_method(s) == "onebit_adam":
        return 0.0
    dt = stack.reduce_bytes(dtype_bytes(s.training.dtype))
    units = [(mdl.layer_params(spec) / par.tp, layer_tensors(spec, stack))] * layers
    if holds_head(par, stage):
        tied = embedding_copy_params(spec, par)
        head = (mdl.head_params(spec) + tied) / par.tp
        end = END_TENSORS + mtp_end_tensors(spec)
        units = [(units[0][0] + head, units[0][1] + end), *units[1:]] if units \
            else [(head, end)]
    if holds_embedding(par, stage):
        units.append((mdl.embedding_params(spec) / par.tp, END_TENSORS))
    return sum(cost.ops_time(ddp_copy_ops(stack, e, dt, n, back))
               for e, n in units for back in (False, True))


def parameter_gather(s: Scenario, layout: Layout, hw: HardwareProfile, param_bytes: float,
                     expert_params: list[float]) -> float:
    """ZeRO-1/2's all-gather of the updated parameters after the step (ZeRO-3 gathers at
    use instead), and the routed experts' over their expert data-parallel group."""
    par = s.parallel
    gathered = param_bytes if par.zero in (1, 2) else 0.0
    t_gather = collective_time(s, layout, "all_gather", gathered, layout.dp_group(0), hw)
    if expert_params and par.zero in (1, 2):
        t_gather += collective_time(s, layout, "all_gather",
                                    sum(expert_params) * dtype_bytes(s.training.dtype),
                                    edp_group(layout, 0, par.etp, par.ep), hw)
    return t_gather


def bucket_buffers(s: Scenario) -> float:
    """DDP and ZeRO-1/2 hold two gradient buckets in flight."""
    par = s.parallel
    return 2 * par.dp_bucket_MB * 1e6 if par.dp > 1 and par.zero <= 2 else 0.0


class DataParallel(Strategy):
    name = "data"
    kinds = ("dp",)

    def active(self, s: Scenario) -> bool:
        return True  # the gradients' reduction and the optimizer step, even on one replica

    def problems(self, s: Scenario) -> list[Problem]:
        trn, par = s.training, s.parallel
        per_step = trn.micro_batch * par.dp
        if trn.global_batch % per_step == 0:
            return []
        return [Problem("training.global_batch", trn.global_batch, f"not divisible by "
                        f"micro_batch({trn.micro_batch}) * dp({par.dp}) = {per_step}; use a "
                        f"multiple of {per_step}")]

    def make_pass(self, ctx: Context) -> Pass | None:
        return DataPass(ctx)

    def dimensions(self) -> tuple[Dimension, ...]:
        return (Dimension(("dp",), ("parallel.dp",), 40, _replicas),
                Dimension(("zero",), ("parallel.zero",), 70,
                          lambda req, base, chosen: ((z,) for z in req.zero_stages)))


def _replicas(req: Any, base: Scenario, chosen: Mapping[str, Any]) -> tuple[tuple[int]]:
    """What is left of the GPUs: N / (tp · cp · pp)."""
    return ((req.gpus // (chosen["tp"] * chosen["cp"] * chosen["pp"]),),)


DATA = DataParallel()
