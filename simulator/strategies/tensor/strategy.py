"""Tensor (and sequence) parallelism as a strategy: its rules, its pass, its closed-form
terms and its search dimensions.

Megatron-LM's rules: tp divides the heads, and the KV heads and tp divide one another
(KV heads are split or replicated across TP ranks); sequence parallelism splits the
sequence over tp; TP communication overlap needs sequence parallelism
(``arguments.py``). The closed form prices a layer's TP collective (an all-reduce, or
under sequence parallelism the mean of an all-gather and a reduce-scatter) with a
functional collective's host time where the stack issues it through DTensor, the
collectives at the model's ends, and the optimizer's all-reduces of the norms' partial
gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from simulator.errors import Problem
from simulator.model import transformer as mdl
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.inventory.tensor_parallel import tp_end_collectives, tp_optimizer_collectives
from simulator.spec.base import divisor_list, divisors_text
from simulator.spec.scenario import Scenario
from simulator.strategies.base import Dimension, Strategy
from simulator.strategies.tensor.workload import TensorPass
from simulator.strategies.timing import collective_time
from simulator.system.costs import CostModel
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout
from simulator.system.units import CollectiveName

if TYPE_CHECKING:
    from simulator.builder.context import Context, Pass


def tp_time(s: Scenario, layout: Layout, cost: CostModel, hw: HardwareProfile) -> float:
    """One of a layer's TP collectives per micro-batch: an all-reduce, or under sequence
    parallelism the mean of an all-gather and a reduce-scatter, each with DTensor's host
    time beyond a plain collective."""
    par, spec, trn = s.parallel, s.model, s.training
    tp_ops: tuple[CollectiveName, ...] = ("all_gather", "reduce_scatter") \
        if par.sequence_parallel else ("all_reduce",)
    tp_bytes = mdl.tp_comm_bytes_per_layer(spec, trn.micro_batch, trn.dtype)
    group = layout.tp_group(0)
    return sum(collective_time(s, layout, op, tp_bytes, group, hw)
               # DTensor's functional collectives: their host time beyond a plain one
               + (cost.funcol_s(s.stack.dtensor, layout.group_link(group), op, tp_bytes)
                  if par.tp > 1 else 0.0)
               for op in tp_ops) / len(tp_ops)


#: Seconds per micro-batch of the TP collectives at the model's ends: the embedding's
#: forward and backward, the output layer's (with the loss's) forward and backward
#: (embedding forward, backward; output layer and loss forward, backward; one multi-token
#: prediction module's projection forward, backward)
Ends = tuple[float, float, float, float, float, float]


NO_ENDS: Ends = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def tp_ends(s: Scenario, layout: Layout, cost: CostModel, hw: HardwareProfile) -> Ends:
    """Per micro-batch, the TP collectives at the embedding (forward, backward) and at
    the output layer with the loss (forward, backward), each with a functional
    collective's cost beyond a plain one where the stack issues it through DTensor, as
    the engine's tensor pass issues them
    (:func:`simulator.model.inventory.tensor_parallel.tp_end_collectives`).
    """
    par, spec, trn = s.parallel, s.model, s.training
    if par.tp == 1:
        return NO_ENDS
    group = layout.tp_group(0)
    link = layout.group_link(group)
    size = mdl.tp_end_bytes(spec, trn.micro_batch, trn.dtype)

    def t(where: Literal["embed", "head", "loss", "mtp_proj"], forward: bool) -> float:
        return sum(collective_time(s, layout, op, size[payload], group, hw)
                   + (cost.funcol_s(s.stack.dtensor, link, op, size[payload])
                      if payload != "loss" else 0.0)
                   for op, payload in tp_end_collectives(s.stack, par.tp,
                                                         par.sequence_parallel, where,
                                                         forward))

    return (t("embed", True), t("embed", False), t("head", True) + t("loss", True),
            t("head", False), t("mtp_proj", True), t("mtp_proj", False))


def tp_optimizer(s: Scenario, layout: Layout, cost: CostModel, hw: HardwareProfile,
                  layers: int, last: bool) -> float:
    """The optimizer step's TP all-reduces on a rank of ``layers`` layers (the final
    norm's too on the last stage): the norms' partial gradients under DTensor with
    sequence parallelism
    (:func:`simulator.model.inventory.tensor_parallel.tp_optimizer_collectives`)."""
    par, spec = s.parallel, s.model
    n = tp_optimizer_collectives(spec, s.stack, par.tp, par.sequence_parallel, layers, last)
    if not n:
        return 0.0
    group = layout.tp_group(0)
    nbytes = spec.hidden * s.stack.reduce_bytes(dtype_bytes(s.training.dtype))
    return n * (collective_time(s, layout, "all_reduce", nbytes, group, hw)
                + cost.funcol_s(s.stack.dtensor, layout.group_link(group), "all_reduce",
                                nbytes))


class TensorParallel(Strategy):
    name = "tensor"
    kinds = ("tp",)

    def active(self, s: Scenario) -> bool:
        return s.parallel.tp > 1

    def problems(self, s: Scenario) -> list[Problem]:
        par, mdl_, out = s.parallel, s.model, []
        if s.stack.tp_overlap in ("bulk", "pipelined") and par.tp > 1 \
                and not par.sequence_parallel:
            out.append(Problem("stack.tp_overlap", s.stack.tp_overlap, "needs sequence "
                               "parallelism (Megatron-LM's arguments.py: TP communication "
                               "overlap only with --sequence-parallel); set "
                               "parallel.sequence_parallel: true or tp_overlap: async"))
        if s.stack.tp_overlap == "async" and s.stack.dtensor and par.tp > 1:
            out.append(Problem("stack.tp_overlap", "async", "is Megatron's asynchronous "
                               "backward of its column-parallel layers; TP as DTensor "
                               "(stack.dtensor: true) runs its collectives in line: set "
                               "tp_overlap: none"))
        if mdl_.heads % par.tp:
            out.append(Problem("parallel.tp", par.tp, f"model.heads ({mdl_.heads}) is not "
                               f"divisible by tp; use one of {divisors_text(mdl_.heads)}"))
        elif mdl_.kv % par.tp and par.tp % mdl_.kv:
            out.append(Problem("parallel.tp", par.tp, f"model.kv_heads ({mdl_.kv}) and tp must "
                               "divide one another (KV heads are split or replicated across "
                               "TP ranks)"))
        if par.sequence_parallel and mdl_.seq_len % par.tp:
            out.append(Problem("parallel.sequence_parallel", True, f"model.seq_len "
                               f"({mdl_.seq_len}) is not divisible by tp({par.tp}); turn it "
                               "off or change tp"))
        return out

    def unsupported(self, s: Scenario) -> list[Problem]:
        par, mdl_ = s.parallel, s.model
        if s.stack.tp_overlap in ("none", "async") or par.tp == 1 \
                or not (mdl_.is_moe or par.cp > 1):
            return []
        field, value = ("model.experts", mdl_.experts) if mdl_.is_moe else ("parallel.cp", par.cp)
        return [Problem(field, value, f"not yet simulated with stack.tp_overlap "
                        f"{s.stack.tp_overlap} (TP overlap is modelled for dense layers "
                        "without context parallelism); use tp_overlap: none")]

    def warnings(self, s: Scenario) -> list[str]:
        tp, domain = s.parallel.tp, s.hardware.domain_gpus
        if tp > domain:
            return [f"warning: parallel.tp = {tp} is larger than an NVLink domain "
                    f"({domain} GPUs): TP collectives cross the inter-node fabric"]
        if domain % tp and s.parallel.world > domain:
            return [f"warning: parallel.tp = {tp} does not divide the NVLink domain "
                    f"({domain} GPUs): some TP groups straddle two domains and cross the "
                    "inter-node fabric; use a divisor of the domain"]
        return []

    def make_pass(self, ctx: Context) -> Pass | None:
        return TensorPass(ctx)

    def dimensions(self) -> tuple[Dimension, ...]:
        return (Dimension(("tp",), ("parallel.tp",), 10, _tp_degrees),
                Dimension(("sequence_parallel",), ("parallel.sequence_parallel",), 90,
                          _sequence_parallel))


def _tp_degrees(req: Any, base: Scenario, chosen: Mapping[str, Any]) -> Iterator[tuple[int]]:
    """TP dividing the heads, at most an NVLink domain unless the request allows more."""
    domain = base.hardware.domain_gpus
    for tp in divisor_list(base.model.heads):
        if tp <= domain or req.tp_beyond_node:
            yield (tp,)


def _sequence_parallel(req: Any, base: Scenario,
                       chosen: Mapping[str, Any]) -> tuple[tuple[bool], ...]:
    return ((False,), (True,)) if chosen["tp"] > 1 else ((False,),)


TENSOR = TensorParallel()
