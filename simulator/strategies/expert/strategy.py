"""Expert parallelism as a strategy: Megatron-LM's rules for the expert grid, what a
mixture of experts cannot run yet, its pass, its closed-form terms (the routed experts'
compute and all-to-alls per MoE layer, the experts' gradients over the expert
data-parallel group) and the search over EP degrees.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from simulator.errors import Problem
from simulator.model import moe
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.transformer import embedding_params, head_params, layer_params
from simulator.spec.base import divisor_list, divisors_text
from simulator.spec.placement import holds_embedding, stage_layers
from simulator.spec.scenario import Scenario
from simulator.strategies.base import Dimension, Strategy
from simulator.strategies.expert import deepep, dispatcher
from simulator.strategies.expert.deepep import buffer_bytes
from simulator.strategies.expert.dispatcher import Exchange
from simulator.strategies.expert.layer import (
    expert_layer,
    shared_ops,
    shared_overlapped,
)
from simulator.strategies.expert.workload import ExpertPass
from simulator.strategies.timing import collective_time
from simulator.system.collectives.cost import estimate
from simulator.system.collectives.plan import GroupShape
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


def dispatcher_problems(s: Scenario) -> list[Problem]:
    """What Megatron-LM refuses of a token dispatcher: TransformerConfig.__post_init__
    (megatron/core/transformer/transformer_config.py) raises for shared-expert overlap
    with the allgather dispatcher ("moe_shared_expert_overlap only works with alltoall or
    flex token dispatcher") and for DeepEP with padding to capacity
    (moe_pad_expert_input_to_capacity, our model.capacity_factor);
    MoEFlexTokenDispatcher asserts "DeepEP dispatcher requires TPxEP > 1"."""
    par, mdl = s.parallel, s.model
    out: list[Problem] = []
    if not mdl.is_moe:
        for field, value, default in (("moe_token_dispatcher", par.moe_token_dispatcher,
                                       "alltoall"),
                                      ("moe_shared_expert_overlap",
                                       par.moe_shared_expert_overlap, False)):
            if value != default:
                out.append(Problem(f"parallel.{field}", value, "only for a mixture of experts "
                                   "(model.experts = 0); remove it"))
        return out
    if par.moe_shared_expert_overlap and par.moe_token_dispatcher == "allgather":
        out.append(Problem("parallel.moe_shared_expert_overlap", True, "Megatron-LM runs it "
                           "only with the alltoall or flex dispatcher; set "
                           "moe_token_dispatcher: alltoall or flex, or remove the overlap"))
    if par.moe_token_dispatcher == "flex":
        if mdl.capacity_factor is not None:
            out.append(Problem("parallel.moe_token_dispatcher", "flex", "DeepEP does not pad "
                               f"to capacity (model.capacity_factor {mdl.capacity_factor}); "
                               "remove the capacity factor or use alltoall"))
        if par.etp * par.ep == 1:
            out.append(Problem("parallel.moe_token_dispatcher", "flex", "DeepEP needs "
                               "expert_tp * ep > 1 (1 here); set ep > 1 or use alltoall"))
    return out


def dispatcher_buffers(s: Scenario) -> float:
    """Bytes a dispatcher holds beyond its layers' activations, on one GPU: the
    allgather dispatcher's gathered tokens, n · b·s/tp · h elements (n = expert_tp · ep) in
    Megatron's global memory buffer (``gather_from_sequence_parallel_region(...,
    use_global_buffer=True)``), reused by every layer; DeepEP's NVLink and RDMA buffers
    (:func:`simulator.strategies.expert.deepep.buffer_bytes`); none for alltoall."""
    par, spec, trn = s.parallel, s.model, s.training
    n, dt = par.etp * par.ep, dtype_bytes(trn.dtype)
    if n == 1:
        return 0.0
    if par.moe_token_dispatcher == "allgather":
        return n * trn.micro_batch * spec.seq_len / par.tp * spec.hidden * dt
    if par.moe_token_dispatcher == "flex":
        return float(buffer_bytes(spec.hidden * max(int(dt), 2), n))
    return 0.0


def expert_parallel_degrees(experts: int, stage: int, etp: int) -> list[int]:
    """The ep degrees :func:`expert_parallel_problems` accepts for ``experts`` routed
    experts on a stage of ``stage`` = tp · cp · dp ranks with expert tensor parallelism
    ``etp``: divisors of the experts whose etp · ep divides the stage, ascending."""
    return [d for d in divisor_list(experts) if stage % (etp * d) == 0]


class Experts(NamedTuple):
    """A MoE layer's expert terms per micro-batch (:func:`expert_times`)."""

    fwd: float  # the routed experts' forward compute
    bwd: float  # their input gradients
    a2a: float  # one ep exchange: the mean of the dispatch's and the combine's
    etp: float  # one expert-TP collective (alltoall dispatcher with expert_tp > 1)
    # under shared-expert overlap: the shared experts' compute per pass (forward,
    # backward) and the ep exchange seconds it hides per pass
    shared_fwd: float = 0.0
    shared_bwd: float = 0.0
    hidden_fwd: float = 0.0
    hidden_bwd: float = 0.0
    # what the SMs DeepEP's kernels hold add to that compute (held_sms_factor)
    stretch_fwd: float = 0.0
    stretch_bwd: float = 0.0


NO_EXPERTS = Experts(0.0, 0.0, 0.0, 0.0)


def _exchange_time(s: Scenario, layout: Layout, xs: tuple[Exchange, ...], kind: str,
                   hw: HardwareProfile) -> float:
    """Seconds of the ``kind`` collectives of one side of the dispatcher."""
    out = 0.0
    for x in xs:
        if x.kind != kind:
            continue
        group = dispatcher.group(layout, 0, x.group, s.parallel.etp, s.parallel.ep)
        shape = GroupShape(len(group), len(group) // layout.domains_spanned(group))
        plan = x.plan(s, shape) if len(group) > 1 and x.size > 0 else None
        out += estimate(plan, hw) if plan is not None \
            else collective_time(s, layout, x.op, x.size, group, hw)
    return out


def expert_times(s: Scenario, layout: Layout, cost: CostModel,
                  hw: HardwareProfile) -> Experts:
    """A MoE layer's routed experts per micro-batch: forward and input-gradient compute,
    one ep exchange (the mean of the dispatch and the combine), one expert-TP collective
    (the mean of the dispatch's all-gather and the combine's reduce-scatter),
    and under shared-expert overlap the shared experts' compute and what it hides:
    min(exchange, shared part) beside each exchange (slowed beside DeepEP's kernels:
    :func:`held_sms_factor`), as the engine's ``ep`` stream has it
    (:mod:`simulator.strategies.expert.workload`)."""
    if not s.model.is_moe:
        return NO_EXPERTS
    lay = expert_layer(s)
    x = lay.exchanges
    dispatch, combine = (_exchange_time(s, layout, side, "ep", hw)
                         for side in (x.dispatch, x.combine))
    # the dispatcher's expert-TP collectives (the alltoall dispatcher's all-gather and
    # reduce-scatter; none for the allgather and flex dispatchers, whose exchanges are
    # all over the tp·ep group)
    etp = sum(_exchange_time(s, layout, side, "tp", hw) for side in (x.dispatch, x.combine))
    out = Experts(cost.ops_time(lay.fwd), cost.ops_time(lay.bwd_input),
                  (dispatch + combine) / 2, etp / 2)
    if not shared_overlapped(s):
        return out
    (f1, f2), (b1, b2) = ((cost.ops_time(a), cost.ops_time(b))
                          for a, b in (shared_ops(s, p) for p in ("fwd", "bwd_input")))
    f = held_sms_factor(s, hw)  # the compute beside DeepEP's kernels runs slower

    def hidden(x: float, part: float) -> float:
        return min(x, part * f)

    def stretch(x: float, part: float) -> float:
        return min(part * (f - 1), x * (1 - 1 / f))

    return out._replace(shared_fwd=f1 + f2, shared_bwd=b1 + b2,
                        hidden_fwd=hidden(dispatch, f1) + hidden(combine, f2),
                        hidden_bwd=hidden(dispatch, b2) + hidden(combine, b1),
                        stretch_fwd=stretch(dispatch, f1) + stretch(combine, f2),
                        stretch_bwd=stretch(dispatch, b2) + stretch(combine, b1))


def held_sms_factor(s: Scenario, hw: HardwareProfile) -> float:
    """How much slower compute runs beside the dispatcher's exchanges: gpu.sms / (gpu.sms
    − the SMs DeepEP's kernels hold) for the flex dispatcher on a GPU whose SMs the
    profile states, else 1 (:mod:`simulator.strategies.expert.deepep`). A shared part S
    beside an exchange X then runs min(S·f, X + S − X/f) (f the factor), as the engine's
    interference runs it: it hides min(X, S·f) of the exchange and is stretched by
    min(S(f − 1), X(1 − 1/f))."""
    gpu = hw.gpu
    if s.parallel.moe_token_dispatcher != "flex" or not gpu.sms or \
            not gpu.comm_overlaps_compute:
        return 1.0
    return gpu.sms / max(gpu.sms - deepep.NUM_SMS, 1)


def stage_expert_split(s: Scenario, stage: int) -> tuple[float, list[float]]:
    """Pipeline rank ``stage``'s parameters on one rank: the dense ones (with the
    embedding on the first stage and, on a single stage, the head) and each MoE
    layer's routed experts (an edp gradient reduction each)."""
    spec, par = s.model, s.parallel
    dense = float(embedding_params(spec)) if holds_embedding(par, stage) else 0.0
    if par.pp == 1:
        dense += head_params(spec)
    experts: list[float] = []
    kinds = [k for r in stage_layers(spec.layers, par, stage, spec.mtp_layers)
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
        return expert_parallel_problems(s) + dispatcher_problems(s)

    def unsupported(self, s: Scenario) -> list[Problem]:
        par, mdl_ = s.parallel, s.model
        out = []
        if mdl_.is_moe and par.tp > 1 and not par.sequence_parallel:
            out.append(Problem("parallel.sequence_parallel", False, "a mixture of experts with "
                               f"tp({par.tp}) > 1 needs sequence parallelism (Megatron-LM's "
                               "arguments.py requires it: each TP rank dispatches its sequence "
                               "shard); set sequence_parallel: true"))
        if mdl_.is_moe and par.zero_offload:
            out.append(Problem("parallel.zero_offload", True, "not yet simulated for a mixture "
                               "of experts (expert states shard over the expert data-parallel "
                               "group); remove zero_offload"))
        if mdl_.is_moe and par.zero == 3 and s.stack.zero3_unit == "module":
            out.append(Problem("parallel.zero", 3, "a mixture of experts under ZeRO-3 with "
                               "module units (DeepSpeed's, whose engine asserts 'MoE not "
                               "supported with Stage 3'); use a stack with layer units "
                               "(stack: torchtitan) or zero 0, 1 or 2"))
        return out

    def make_pass(self, ctx: Context) -> Pass | None:
        return ExpertPass(ctx)

    def memory_terms(self, s: Scenario, stage: int) -> dict[str, float]:
        """The dispatcher's own buffers (:func:`dispatcher_buffers`), as comm_buffers."""
        nbytes = dispatcher_buffers(s) if s.model.is_moe else 0.0
        return {"comm_buffers": nbytes} if nbytes else {}

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
