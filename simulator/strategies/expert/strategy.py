"""Expert parallelism as a strategy: Megatron-LM's rules for the expert grid, what a
mixture of experts cannot run yet, its pass, its closed-form terms (the routed experts'
compute and all-to-alls per MoE layer, the experts' gradients over the expert
data-parallel group) and the search over EP degrees.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from simulator.errors import Problem
from simulator.model import moe
from simulator.model.transformer import embedding_params, head_params, layer_params
from simulator.spec.base import divisor_list, divisors_text
from simulator.spec.placement import holds_embedding, stage_layers
from simulator.spec.scenario import Scenario
from simulator.strategies.base import Dimension, Strategy
from simulator.strategies.expert.layer import ep_group, etp_group, expert_layer
from simulator.strategies.expert.workload import ExpertPass
from simulator.strategies.timing import collective_time
from simulator.system.costs import CostModel
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout

if TYPE_CHECKING:
    from simulator.builder.context import Context, Pass


def expert_parallel_problems(s: Scenario) -> list[Problem]:
    """Megatron-LM's rules (parallel_state.initialize_model_parallel, arguments.py): the
    expert layers use expert_tp · ep · edp = tp · cp · dp ranks per stage, and every
    expert-parallel rank holds the same number of experts."""
    par, mdl = s.parallel, s.model
    out: list[Problem] = []
    if par.ep > 1 and not mdl.is_moe:
        out.append(Problem("parallel.ep", par.ep, "the model has no routed experts "
                           "(model.experts = 0); set ep: 1 or use a mixture of experts"))
        return out
    if par.expert_tp is not None and not mdl.is_moe:
        out.append(Problem("parallel.expert_tp", par.expert_tp, "only for a mixture of experts "
                           "(model.experts = 0); remove it"))
        return out
    stage = par.tp * par.cp * par.dp
    if mdl.is_moe and mdl.experts % par.ep and not stage % (par.etp * par.ep):
        out.append(Problem("parallel.ep", par.ep, f"model.experts ({mdl.experts}) is not "
                           f"divisible by ep; use one of {divisors_text(mdl.experts)}"))
    if stage % (par.etp * par.ep):  # its fix lists only degrees that divide the experts too
        fits = expert_parallel_degrees(mdl.experts, stage, par.etp)[:12]
        out.append(Problem("parallel.ep", par.ep, f"expert_tp({par.etp}) * ep({par.ep}) = "
                           f"{par.etp * par.ep} does not divide tp({par.tp}) * cp({par.cp}) * "
                           f"dp({par.dp}) = {stage}: expert-parallel ranks are carved out of a "
                           f"stage's tp * cp * dp ranks; use ep one of "
                           f"{', '.join(map(str, fits)) or 'none (change expert_tp)'}"))
    return out


def expert_parallel_degrees(experts: int, stage: int, etp: int) -> list[int]:
    """The ep degrees :func:`expert_parallel_problems` accepts for ``experts`` routed
    experts on a stage of ``stage`` = tp · cp · dp ranks with expert tensor parallelism
    ``etp``: divisors of the experts whose etp · ep divides the stage, ascending."""
    return [d for d in divisor_list(experts) if stage % (etp * d) == 0]


Experts = tuple[float, float, float, float]


NO_EXPERTS: Experts = (0.0, 0.0, 0.0, 0.0)


def expert_times(s: Scenario, layout: Layout, cost: CostModel,
                  hw: HardwareProfile) -> Experts:
    """A MoE layer's routed experts per micro-batch: forward and input-gradient compute,
    one all-to-all, one expert-TP all-gather (or reduce-scatter)."""
    if not s.model.is_moe:
        return NO_EXPERTS
    par, lay = s.parallel, expert_layer(s)
    a2a = collective_time(s, layout, "all_to_all", lay.a2a_bytes,
                           ep_group(layout, 0, par.etp, par.ep), hw)
    etp = collective_time(s, layout, "all_gather", lay.etp_bytes,
                           etp_group(layout, 0, par.etp), hw)
    return (cost.ops_time(lay.fwd), cost.ops_time(lay.bwd_input), a2a, etp)


def stage_expert_split(s: Scenario, stage: int) -> tuple[float, list[float]]:
    """Pipeline rank ``stage``'s parameters on one rank: the dense ones (with the
    embedding on the first stage and, on a single stage, the head) and each MoE
    layer's routed experts (an edp gradient reduction each)."""
    spec, par = s.model, s.parallel
    dense = float(embedding_params(spec)) if holds_embedding(par, stage) else 0.0
    if par.pp == 1:
        dense += head_params(spec)
    experts: list[float] = []
    kinds = [k for r in stage_layers(spec.layers, par, stage)
             for k in moe.layer_kinds(spec, r.start, r.stop)]
    for layer, count in kinds:
        e = moe.expert_params(spec, layer)
        dense += count * (layer_params(spec, layer) - e)
        experts += [e / (par.etp * par.ep)] * count if e else []
    return dense / par.tp, experts


class ExpertParallel(Strategy):
    name = "expert"
    kinds = ("ep",)

    def active(self, s: Scenario) -> bool:
        return s.model.is_moe

    def problems(self, s: Scenario) -> list[Problem]:
        return expert_parallel_problems(s)

    def unsupported(self, s: Scenario) -> list[Problem]:
        par, mdl_ = s.parallel, s.model
        out = []
        if mdl_.is_moe and par.tp > 1 and not par.sequence_parallel:
            out.append(Problem("parallel.sequence_parallel", False, "a mixture of experts with "
                               f"tp({par.tp}) > 1 needs sequence parallelism (Megatron-LM's "
                               "arguments.py requires it: each TP rank dispatches its sequence "
                               "shard); set sequence_parallel: true"))
        if mdl_.is_moe and (par.zero == 3 or par.zero_offload):
            field, value = ("parallel.zero", 3) if par.zero == 3 \
                else ("parallel.zero_offload", True)
            out.append(Problem(field, value, "not yet simulated for a mixture of experts (expert "
                               "states shard over the expert data-parallel group); use zero 0, "
                               "1 or 2 without offload"))
        return out

    def make_pass(self, ctx: Context) -> Pass | None:
        return ExpertPass(ctx)

    def dimensions(self) -> tuple[Dimension, ...]:
        return (Dimension(("ep",), ("parallel.ep",), 50, _ep_degrees),)


def _ep_degrees(req: Any, base: Scenario, chosen: Mapping[str, Any]) -> Iterator[tuple[int]]:
    """The EP degrees of a stage of tp · cp · dp ranks the schema accepts (expert TP left
    at TP), those of the request only when it names some; 1 for a dense model."""
    if not base.model.is_moe:
        yield (1,)
        return
    tp = chosen["tp"]
    valid = expert_parallel_degrees(base.model.experts, tp * chosen["cp"] * chosen["dp"], tp)
    wanted = valid if req.expert_parallel is None else req.expert_parallel
    yield from ((ep,) for ep in wanted if ep in valid)


EXPERT = ExpertParallel()
