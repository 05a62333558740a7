"""The token dispatchers: the collectives that take a MoE layer's tokens to its experts
(the dispatch) and bring the outputs home (the combine), one function per Megatron-LM
dispatcher (``parallel.moe_token_dispatcher``, megatron/core/transformer/moe/
token_dispatcher.py), registered in :data:`DISPATCHERS`.

A backward runs the same collectives in the same order (the combine's gradient first,
then the dispatch's: the gradient of an all-gather is a reduce-scatter of the same
array, and the reverse), so an :class:`Exchanges` serves every pass.

- ``alltoall`` (MoEAlltoAllTokenDispatcher): the all-to-all of the k·load·T token-expert
  pairs over the EP group, then with expert_tp > 1 the all-gather over the expert-TP
  group (``gather_from_sequence_parallel_region(..., group=self.tp_group)``); the
  combine mirrors them;
- ``allgather`` (MoEAllGatherTokenDispatcher, "this allgather spans the communication
  domain of TP*EP"): the routing map (1 byte per token and expert), the probabilities
  and the tokens all-gathered over the expert-TP × EP group of n = expert_tp · ep ranks,
  [T, ·] to [n·T, ·] (counted as one all-gather of their sum: their three latencies as
  one), the local experts' tokens picked out; the combine reduce-scatters the n·T
  outputs (``reduce_scatter_to_sequence_parallel_region(..., group=self.tp_ep_group)``).
  The router's skew does not change the bytes, only the experts' work;
- ``flex`` (MoEFlexTokenDispatcher, DeepEP backend): one fused dispatch and one fused
  combine over the expert-TP × EP group (:mod:`simulator.strategies.expert.deepep`).

Every exchange here is kind ``ep`` but the alltoall dispatcher's expert-TP collectives
(kind ``tp``, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from simulator.spec.scenario import Scenario
from simulator.strategies.expert.deepep import Direction, deepep_plan
from simulator.system.collectives.plan import GroupShape, Plan
from simulator.system.layout import Layout
from simulator.system.units import CollectiveName

GroupName = Literal["ep", "etp", "tp_ep"]


@dataclass(frozen=True)
class Exchange:
    """One collective of a dispatch or a combine on the busiest rank."""

    op: CollectiveName
    kind: str  # the accounting's kind: ep, or tp for the expert-TP collectives
    group: GroupName
    size: float  # S, bytes (nccl-tests' convention for the op)
    label: str  # the trace name's stem; {role}: dispatch or combine
    deepep: Direction | None = None  # DeepEP's kernel instead of NCCL's plan

    def plan(self, s: Scenario, shape: GroupShape) -> Plan | None:
        """The exchange's own plan (DeepEP's), or None for NCCL's as the scenario picks."""
        if self.deepep is None:
            return None
        spec = s.model
        token_bytes = self.size / (spec.experts_per_token * s.parallel.etp)
        return deepep_plan(self.deepep, token_bytes, spec.experts, spec.experts_per_token,
                           s.parallel.ep, shape)


@dataclass(frozen=True)
class Exchanges:
    dispatch: tuple[Exchange, ...]
    combine: tuple[Exchange, ...]


@dataclass(frozen=True)
class Sizes:
    """What every dispatcher's sizes are made of, per micro-batch on the busiest rank."""

    local: float  # tokens the rank routes, b·s/tp
    routed: float  # token-expert pairs it receives per all-to-all, load · k · local
    tokens: float  # pairs its experts compute, routed · expert_tp
    hidden_bytes: float  # h · bytes per element
    experts: int
    dt: float


def alltoall(s: Scenario, z: Sizes) -> Exchanges:
    par = s.parallel
    a2a = z.routed * z.hidden_bytes if par.ep > 1 else 0.0
    etp = z.tokens * z.hidden_bytes if par.etp > 1 else 0.0
    return Exchanges(
        (Exchange("all_to_all", "ep", "ep", a2a, "ep.all_to_all {role}"),
         Exchange("all_gather", "tp", "etp", etp, "tp.all_gather experts")),
        (Exchange("reduce_scatter", "tp", "etp", etp, "tp.reduce_scatter experts"),
         Exchange("all_to_all", "ep", "ep", a2a, "ep.all_to_all {role}")))


def allgather(s: Scenario, z: Sizes) -> Exchanges:
    n = s.parallel.etp * s.parallel.ep
    gathered = n * z.local * (z.hidden_bytes + z.experts * (z.dt + 1)) if n > 1 else 0.0
    back = n * z.local * z.hidden_bytes if n > 1 else 0.0
    return Exchanges(
        (Exchange("all_gather", "ep", "tp_ep", gathered, "ep.all_gather {role}"),),
        (Exchange("reduce_scatter", "ep", "tp_ep", back, "ep.reduce_scatter {role}"),))


def flex(s: Scenario, z: Sizes) -> Exchanges:
    size = z.tokens * z.hidden_bytes if s.parallel.etp * s.parallel.ep > 1 else 0.0
    return Exchanges(
        (Exchange("all_to_all", "ep", "tp_ep", size, "ep.deepep {role}", "dispatch"),),
        (Exchange("all_to_all", "ep", "tp_ep", size, "ep.deepep {role}", "combine"),))


DISPATCHERS: dict[str, Callable[[Scenario, Sizes], Exchanges]] = {
    "alltoall": alltoall, "allgather": allgather, "flex": flex}


def exchanges(s: Scenario, z: Sizes) -> Exchanges:
    return DISPATCHERS[s.parallel.moe_token_dispatcher](s, z)


# ---------------------------------------------------------------- groups


def _stage_base(layout: Layout, rank: int) -> tuple[int, int]:
    """(first rank of ``rank``'s stage, ``rank``'s index among the stage's tp · dp)."""
    per_stage = layout.per_stage
    return rank - rank % per_stage, rank % per_stage


def ep_group(layout: Layout, rank: int, etp: int, ep: int) -> tuple[int, ...]:
    """The ranks that hold the other experts of ``rank``'s layers (and trade tokens)."""
    base, i = _stage_base(layout, rank)
    t, e_dp = i % etp, i // (etp * ep)
    return tuple(base + e_dp * etp * ep + j * etp + t for j in range(ep))


def edp_group(layout: Layout, rank: int, etp: int, ep: int) -> tuple[int, ...]:
    """The ranks that hold the same experts (and reduce their gradients)."""
    base, i = _stage_base(layout, rank)
    t, e = i % etp, (i // etp) % ep
    edp = layout.per_stage // (etp * ep)
    return tuple(base + d * etp * ep + e * etp + t for d in range(edp))


def etp_group(layout: Layout, rank: int, etp: int) -> tuple[int, ...]:
    """The ranks that split each of ``rank``'s experts' matrices."""
    base, i = _stage_base(layout, rank)
    first = base + i - i % etp
    return tuple(range(first, first + etp))


def tp_ep_group(layout: Layout, rank: int, etp: int, ep: int) -> tuple[int, ...]:
    """The expert-TP × EP ranks of ``rank`` (Megatron's ``tp_ep`` group: the expert
    grid's tp-ep block, contiguous in the tp-ep-dp order)."""
    base, i = _stage_base(layout, rank)
    first = base + i - i % (etp * ep)
    return tuple(range(first, first + etp * ep))


def group(layout: Layout, rank: int, name: GroupName, etp: int, ep: int) -> tuple[int, ...]:
    if name == "ep":
        return ep_group(layout, rank, etp, ep)
    if name == "etp":
        return etp_group(layout, rank, etp)
    return tp_ep_group(layout, rank, etp, ep)
