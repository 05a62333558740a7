"""Expert parallelism: the expert process groups, the token load of each expert-parallel
rank, the size of the all-to-alls and the experts' ops on one rank.

**Groups** (Megatron-LM, ``megatron/core/parallel_state.py``,
``initialize_model_parallel``): the dense layers of a pipeline stage use its
tp · cp · dp ranks as tp × dp (TP innermost); the expert layers regroup the same
ranks with a second ``RankGenerator(tp=expert_tp, ep=ep, dp=edp, cp=1)`` in the
order tp-ep-dp: expert TP innermost, then EP, then the expert data-parallel
dimension. Expert parallelism is therefore carved out of the data-parallel ranks
(``edp = tp · dp / (expert_tp · ep)``), never multiplied onto them. The experts of a
layer are split over the EP group in contiguous blocks of E/ep (Megatron's
``local_expert_indices``); expert gradients are reduced over the edp group, the
dense ones over dp.

**Tokens** (Megatron-core's ``MoEAlltoAllTokenDispatcher``). Megatron requires
sequence parallelism with MoE and TP > 1, so each rank routes its b·s/tp tokens:
every token picks k experts; the dispatch all-to-all sends each token-expert pair
to the EP rank holding the expert; with expert_tp > 1 an all-gather over the
expert-TP group gives every expert-TP rank the whole group's tokens; the experts
run as grouped GEMMs; a reduce-scatter and the combine all-to-all (the mirror)
bring the outputs home (the other dispatchers, allgather and DeepEP's flex, are
:mod:`simulator.strategies.expert.dispatcher`'s). Backward runs the mirror: two
all-to-alls of the same size and the expert GEMMs' input gradients (their weight
gradients go with the layer's other weight gradients, where zero-bubble schedules defer
them).

**Load.** Balanced, every EP rank receives k·b·s/tp token-expert pairs per
all-to-all. With a capacity factor c (padded buffers, as :mod:`simulator.model.moe`
counts) every rank receives c times that, whatever the router does. Dropless
with ``model.router_skew``, the experts' shares of the tokens are one draw from a
symmetric Dirichlet distribution (seeded), the same for every MoE layer, and EP
rank j receives ep · (the shares of its experts) times the balanced load. The
all-to-all is done when its most loaded rank has received its tokens, and the
combine waits for that rank's GEMMs, so every rank of the group runs at the pace
of the most loaded one: :func:`load_factor` is that rank's load over the balanced
one, applied to the all-to-all size and to the expert GEMMs' tokens.

All-to-all size ``S`` follows nccl-tests' ``alltoall_perf`` (each rank's whole
buffer, S/ep to every member; (ep − 1)/ep · S leaves the rank):
S = load · k · (b·s/tp) · h · bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.model.inventory.experts import expert_weight_ops, routed_expert_ops
from simulator.model.inventory.ops import Op, Pass, dtype_bytes
from simulator.spec.model_spec import ModelSpec
from simulator.spec.scenario import Scenario
from simulator.strategies.expert.dispatcher import (
    Exchanges,
    Sizes,
    edp_group,
    ep_group,
    etp_group,
    exchanges,
    tp_ep_group,
)

__all__ = ["ExpertLayer", "edp_group", "ep_group", "etp_group", "expert_grad_bytes",
           "expert_layer", "load_factor", "rank_loads", "shared_ops", "shared_overlapped",
           "tp_ep_group"]

# ---------------------------------------------------------------- load


def rank_loads(spec: ModelSpec, ep: int) -> tuple[float, ...]:
    """Tokens each EP rank receives, relative to the balanced share (mean 1)."""
    if spec.capacity_factor is not None:
        return (spec.capacity_factor,) * ep
    skew = spec.router_skew
    if skew is None or ep == 1:
        return (1.0,) * ep
    return _dirichlet_loads(spec.experts, ep, skew.concentration, skew.seed)


@cache
def _dirichlet_loads(experts: int, ep: int, concentration: float,
                     seed: int) -> tuple[float, ...]:
    shares = np.random.default_rng(seed).dirichlet(np.full(experts, concentration))
    per_rank = shares.reshape(ep, experts // ep).sum(axis=1)
    return tuple(float(ep * x) for x in per_rank)


def load_factor(spec: ModelSpec, ep: int) -> float:
    """The most loaded EP rank's tokens over the balanced share (1 when balanced)."""
    return max(rank_loads(spec, ep))


# ---------------------------------------------------------------- one MoE layer


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's expert-parallel work per micro-batch on the most loaded rank."""

    load: float  # load_factor
    tokens: float  # token-expert pairs the rank's experts compute (after the expert-TP gather)
    a2a_bytes: float  # S of each all-to-all (0 without EP)
    etp_bytes: float  # the expert-TP all-gather / reduce-scatter's whole array (0 if etp = 1)
    exchanges: Exchanges  # the dispatcher's collectives (simulator.strategies.expert.dispatcher)
    fwd: tuple[Op, ...]
    bwd_input: tuple[Op, ...]
    bwd_weight: tuple[Op, ...]


def expert_layer(s: Scenario) -> ExpertLayer:
    """The expert work of a MoE layer (every MoE layer of a model is alike)."""
    spec, par, trn = s.model, s.parallel, s.training
    dt = dtype_bytes(trn.dtype)
    load = load_factor(spec, par.ep)
    local = trn.micro_batch * spec.seq_len / par.tp  # each TP rank routes its sequence shard
    routed = load * spec.experts_per_token * local  # pairs received per all-to-all
    tokens = routed * par.etp
    groups, width = spec.experts // par.ep, spec.expert_ffn / par.etp

    def ops(pass_: Pass) -> tuple[Op, ...]:
        out = routed_expert_ops(spec, tokens, width, groups, dt, pass_, s.stack, par.ep)
        if pass_ == "bwd_weight":
            return (*(op for op in out if op.kind == "gemm"),
                    *expert_weight_ops(spec, s.stack, tokens, width, groups, dt))
        return tuple(out) if pass_ == "fwd" else tuple(out[::-1])

    sizes = Sizes(local, routed, tokens, spec.hidden * dt, spec.experts, dt)
    return ExpertLayer(load, tokens, routed * spec.hidden * dt if par.ep > 1 else 0.0,
                       tokens * spec.hidden * dt if par.etp > 1 else 0.0, exchanges(s, sizes),
                       ops("fwd"), ops("bwd_input"), ops("bwd_weight"))


# ---------------------------------------------------------------- shared experts

#: The shared experts' first linear and activation (beside the dispatch under
#: ``moe_shared_expert_overlap``) and second linear (beside the combine), with their FP8
#: casts: Megatron-core's SharedExpertMLP.linear_fc1_forward_and_act / linear_fc2_forward.
SHARED_FC1 = frozenset({"shared_up", "shared_act", "fp8_x_shared_up", "fp8_w_shared_up",
                        "fp8_dy_shared_up"})
SHARED_FC2 = frozenset({"shared_down", "fp8_x_shared_down", "fp8_w_shared_down",
                        "fp8_dy_shared_down"})


def shared_overlapped(s: Scenario) -> bool:
    """Whether the shared experts run beside the dispatch and combine."""
    return s.parallel.moe_shared_expert_overlap and s.model.is_moe \
        and s.model.shared_experts > 0


def shared_ops(s: Scenario, pass_: Pass) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """A MoE layer's shared-expert ops of ``pass_`` (fwd or bwd_input) on one TP rank:
    (first linear and activation, second linear)."""
    spec, par, trn = s.model, s.parallel, s.training
    layer = next(i for i in range(spec.layers) if spec.is_moe_layer(i))
    ops = mdl.layer_ops(spec, trn.micro_batch, par.tp, par.sequence_parallel, trn.dtype,
                        pass_, layer, s.stack)
    return (tuple(op for op in ops if op.name in SHARED_FC1),
            tuple(op for op in ops if op.name in SHARED_FC2))


def expert_grad_bytes(s: Scenario, layer: int) -> float:
    """Gradient bytes of ``layer``'s routed experts on one rank (0 for a dense layer)."""
    par = s.parallel
    return moe.expert_params(s.model, layer) / (par.etp * par.ep) \
        * s.stack.reduce_bytes(dtype_bytes(s.training.dtype))
