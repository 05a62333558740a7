"""Collective algorithms as plans: which link class carries how many bytes per rank,
in how many latency steps.

A plan is a sequence of *phases* run one after another; a phase is a set of
concurrent *legs*, one per link class, each carrying ``bytes_per_rank`` from every
member over that class, followed by ``steps × α`` of latency. The engine turns a
leg into one flow per simulated member; it never expands a 1,024-rank ring into
2,046 per-link events. :func:`expand` gives the step-by-step form of a ring for
small groups (a validation mode; tests show both agree).

Group shape: ``n`` ranks, ``k`` per node on ``N`` nodes (rails: GPU i of every
node talks over NIC i). Volumes follow nccl-tests (docs/model.md):

- ring all-reduce: 2(n−1)/n·S per rank in 2(n−1) steps. Across nodes, the
  node's k NICs carry the node's 2(N−1)/N·S between them (NCCL's channels use
  every rail), so each NIC carries 2(N−1)/N·S/k while NVLink carries the rest.
- all-gather / reduce-scatter (S = the whole array): (n−1)/n·S in n−1 steps;
  (N−1)/N·S/k per NIC across nodes.
- tree (double binary, all-reduce and broadcast): ring volumes, but
  2(k−1) + 2⌈log2 N⌉ latency steps and NCCL's lower tree bandwidth across
  nodes (``nccl.TREE_BW``).
- hierarchical all-reduce: intra-node reduce-scatter → inter-node all-reduce of
  S/k over the rails → intra-node all-gather, three phases in sequence.
- broadcast (pipelined ring) S per rank, n−1 steps; send/recv S, one step.
- all-to-all (S = each rank's send buffer, S/n to every member, as nccl-tests'
  ``alltoall_perf``): **pairwise** exchange (Thakur et al. 2005, MPICH: in step i
  rank r sends to r + i and receives from r − i), n−1 steps; every rank's
  (k−1)/n·S for its node's peers crosses NVLink and its (n−k)/n·S for the other
  nodes its own NIC, concurrently, so the time is (n−1)/n·S over the bottleneck
  link class when the group is on one link class. **hierarchical** (an explicit
  choice, never ``auto``): an intra-node all-to-all that gathers on each rank the
  node's data for the ranks of its rail ((k−1)/k·S, k−1 steps), then an all-to-all
  over the rails ((N−1)/N·S per NIC, N−1 steps): the same NIC bytes in fewer,
  larger messages.

``auto`` is NCCL (:mod:`simulator.system.nccl`): the algorithms and protocols the stated
NCCL version has for the op and group (ring or tree for all-reduce, NVLS on one
NVSwitch-gen-3 node; ring for all-gather and reduce-scatter, PAT from 2.23 with one
rank per node; ring for broadcast), each priced with NCCL's own latency table and
protocol bandwidth factors, the smallest time taken as NCCL's tuner does. The plan
records the protocol; its legs carry the protocol's rate factor and its phase NCCL's
latency. An explicit ``ring``, ``tree`` or ``hierarchical`` is the textbook α-β form
of that algorithm (link α per step, Simple protocol, no launch latency): the
hierarchical algorithm, which NCCL does not have, only this way. A calibrated
collective (``hw.collectives``) already holds what the library did, so its measured α
and busbw replace the protocol's factor and latency in the time; the choice is still
NCCL's, made on the links.

A collective that follows compute also pays the profile's sync cost once
(``gpu.collective_sync_us``, :func:`sync_cost`): the back-to-back α-β fit misses the
communication threads waking and the ranks arriving skewed. It rides on the first
phase's latency (:func:`phase_latencies`), which the engine and the analytic estimate
both use. Where the profile measured it growing with the compute before the collective
(``gpu.collective_sync_burst``, :func:`sync_burst_cost`), the engine adds the growth at
each collective from its members' compute since their previous one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

from simulator.system import nccl
from simulator.system.hardware import CollectiveName, HardwareProfile, LinkName
from simulator.system.nccl import DEFAULT_NCCL_VERSION, NcclAlgorithm, Protocol

AlgorithmName = Literal["ring", "tree", "hierarchical", "direct", "pairwise", "nvls", "nvls_tree",
                        "pat"]
NCCL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
NCCL_HW: dict[LinkName, nccl.HwKind] = {"intra_node": "nvlink", "inter_node": "net"}


@dataclass(frozen=True)
class GroupShape:
    n: int  # ranks in the group
    per_node: int  # ranks of the group on each node (k)

    @property
    def nodes(self) -> int:
        return self.n // self.per_node


@dataclass(frozen=True)
class Leg:
    link_class: LinkName
    bytes_per_rank: float
    rate_factor: float = 1.0  # the protocol's share of the link's rate (NCCL plans)


@dataclass(frozen=True)
class Phase:
    legs: tuple[Leg, ...]
    steps: int  # latency steps, each charged the α of the slowest class in the phase
    # NCCL's latency for the whole phase as multiples of each class's α (an ``auto``
    # plan), replacing steps × the slowest α
    alpha_units: tuple[tuple[LinkName, float], ...] | None = None


@dataclass(frozen=True)
class Plan:
    op: CollectiveName
    algorithm: AlgorithmName
    size: float  # S, bytes (the whole array for all-gather / reduce-scatter)
    n: int
    phases: tuple[Phase, ...]
    protocol: Protocol = "Simple"  # NCCL's LL, LL128 or Simple


def busbw_factor(op: CollectiveName, n: int) -> float:
    """nccl-tests' busbw / algbw factor (doc/PERFORMANCE.md)."""
    if op in ("broadcast", "send_recv"):
        return 1.0
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algbw(size: float, seconds: float) -> float:
    return size / seconds


def busbw(op: CollectiveName, n: int, size: float, seconds: float) -> float:
    return algbw(size, seconds) * busbw_factor(op, n)


def _ring(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    n, k, nodes = shape.n, shape.per_node, shape.nodes
    factor = busbw_factor(op, n)
    steps = {"all_reduce": 2 * (n - 1), "broadcast": n - 1}.get(op, n - 1)
    if op == "send_recv":
        steps = 1
    if nodes == 1:
        legs: tuple[Leg, ...] = (Leg("intra_node", factor * size),)
    else:
        inter = busbw_factor(op, nodes) * size / k if op != "broadcast" else size / k
        legs = (Leg("inter_node", inter),)
        if k > 1:
            legs = (Leg("intra_node", factor * size), *legs)
    return Plan(op, "ring", size, n, (Phase(legs, steps),))


def _tree(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    ring = _ring(op, size, shape)
    legs = tuple(replace(g, rate_factor=nccl.TREE_BW) if g.link_class == "inter_node" else g
                 for g in ring.phases[0].legs)
    return Plan(op, "tree", size, shape.n, (Phase(legs, _tree_steps(shape)),))


def _tree_steps(shape: GroupShape) -> int:
    nodes = shape.nodes
    log_steps = 2 * math.ceil(math.log2(nodes)) if nodes > 1 else 0
    return 2 * (shape.per_node - 1) + log_steps


def _hierarchical(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    k, nodes = shape.per_node, shape.nodes
    inter_ar = Phase((Leg("inter_node", 2 * (nodes - 1) / nodes * size / k),), 2 * (nodes - 1))
    intra = Phase((Leg("intra_node", (k - 1) / k * size),), k - 1)
    phases: tuple[Phase, ...]
    if op == "all_reduce":
        phases = (intra, inter_ar, intra)
    elif op == "all_gather":  # inter-node all-gather of shards, then intra-node
        phases = (Phase((Leg("inter_node", (nodes - 1) / nodes * size / k),), nodes - 1), intra)
    else:  # reduce_scatter: intra-node first, then across nodes
        phases = (intra, Phase((Leg("inter_node", (nodes - 1) / nodes * size / k),), nodes - 1))
    return Plan(op, "hierarchical", size, shape.n, phases)


def _pairwise(size: float, shape: GroupShape) -> Plan:
    n, k = shape.n, shape.per_node
    peers: tuple[tuple[LinkName, int], ...] = (("intra_node", k - 1), ("inter_node", n - k))
    legs = tuple(Leg(cls, count / n * size) for cls, count in peers if count)
    return Plan("all_to_all", "pairwise", size, n, (Phase(legs, n - 1),))


def _hierarchical_all_to_all(size: float, shape: GroupShape) -> Plan:
    k, nodes = shape.per_node, shape.nodes
    intra = Phase((Leg("intra_node", (k - 1) / k * size),), k - 1)
    inter = Phase((Leg("inter_node", (nodes - 1) / nodes * size),), nodes - 1)
    return Plan("all_to_all", "hierarchical", size, shape.n, (intra, inter))


def candidates(op: CollectiveName, shape: GroupShape, nccl_version: str = DEFAULT_NCCL_VERSION,
               nvls: bool = False) -> list[AlgorithmName]:
    """The algorithms ``auto`` chooses among: NCCL's for the op, version and group
    (never ``hierarchical``, which is only ever an explicit choice)."""
    if op == "send_recv" or shape.n <= 1:
        return ["direct"]
    if op == "all_to_all":  # hierarchical only when asked for (make_plan)
        return ["pairwise"]
    return list(nccl.algorithms(op, _nccl_shape(shape), nccl_version, nvls))


def _explicit(op: CollectiveName, shape: GroupShape) -> list[AlgorithmName]:
    """What an explicit ``collective_algorithm`` may name for this op and group."""
    out: list[AlgorithmName] = ["ring"]
    if op == "all_reduce":
        out.append("tree")
    if op in ("all_reduce", "all_gather", "reduce_scatter") and shape.nodes > 1 \
            and shape.per_node > 1:
        out.append("hierarchical")
    return out


def make_plan(op: CollectiveName, size: float, shape: GroupShape, algorithm: str,
              hw: HardwareProfile, nccl_version: str = DEFAULT_NCCL_VERSION) -> Plan:
    """The plan for one collective: ``auto`` as NCCL ``nccl_version`` would run it, a
    named algorithm in its textbook form (falling back to ring where the op has none)."""
    if shape.n <= 1:
        return Plan(op, "direct", size, shape.n, ())
    if op == "all_to_all":
        if algorithm == "hierarchical" and shape.nodes > 1 and shape.per_node > 1:
            return _hierarchical_all_to_all(size, shape)
        return _pairwise(size, shape)
    if op == "send_recv":
        cls: LinkName = "intra_node" if shape.nodes == 1 else "inter_node"
        return Plan(op, "direct", size, shape.n, (Phase((Leg(cls, size),), 1),))
    if algorithm == "auto":
        algo, proto = nccl_choice(op, size, shape, hw, nccl_version)
        return _nccl_plan(op, size, shape, algo, proto,
                          (hw.intra_node.alpha_s, hw.inter_node.alpha_s), nccl_version)
    chosen = algorithm if algorithm in _explicit(op, shape) else "ring"
    if chosen == "tree":
        return _tree(op, size, shape)
    if chosen == "hierarchical":
        return _hierarchical(op, size, shape)
    return _ring(op, size, shape)


def _nccl_shape(shape: GroupShape) -> nccl.Shape:
    return nccl.Shape(shape.n, shape.nodes)


def _nccl_plan(op: CollectiveName, size: float, shape: GroupShape, algo: NcclAlgorithm,
               proto: Protocol, alphas: tuple[float, float], version: str) -> Plan:
    """NCCL's ``algo`` with ``proto``: the ring's volumes (NVLS: the whole buffer through
    the NVSwitch port) at the protocol's rate, in one phase of NCCL's latency
    (``alphas``: the NVLink and network α, seconds)."""
    nop = _as_nccl_op(op)
    ns = _nccl_shape(shape)
    factor = nccl.bandwidth_factor(algo, proto, nop, ns, size)
    ring = _ring(op, size, shape).phases[0]
    legs: tuple[Leg, ...]
    if algo == "nvls":
        legs, steps = (Leg("intra_node", size, factor),), 1
    elif algo == "nvls_tree":
        inter = Leg("inter_node", size / shape.per_node, nccl.nvls_tree_inter_factor(ns))
        legs, steps = (Leg("intra_node", size, factor), inter), 1 + _tree_steps(
            GroupShape(shape.nodes, 1))
    else:
        legs = tuple(replace(g, rate_factor=factor) for g in ring.legs)
        steps = {"tree": _tree_steps(shape), "pat": nccl.pat_steps(shape.nodes)}.get(
            algo, ring.steps)
    units = nccl.latency_units(algo, proto, nop, ns, {"nvlink": alphas[0], "net": alphas[1]},
                               version)
    alpha_units = tuple((cls, units[hw]) for cls, hw in NCCL_HW.items() if units[hw])
    return Plan(op, algo, size, shape.n, (Phase(legs, steps, alpha_units),), proto)


def _as_nccl_op(op: CollectiveName) -> nccl.Op:
    if op not in NCCL_OPS:
        raise ValueError(f"{op} is not one of NCCL's tuned collectives {NCCL_OPS}")
    return op  # type: ignore[return-value]


def nccl_plans(op: CollectiveName, size: float, shape: GroupShape, hw: HardwareProfile,
               nccl_version: str = DEFAULT_NCCL_VERSION) -> list[Plan]:
    """Every (algorithm, protocol) NCCL ``nccl_version`` may run the collective with,
    in its tuner's loop order."""
    alphas = (hw.intra_node.alpha_s, hw.inter_node.alpha_s)
    return [_nccl_plan(op, size, shape, algo, proto, alphas, nccl_version)
            for algo in nccl.algorithms(_as_nccl_op(op), _nccl_shape(shape), nccl_version,
                                        hw.intra_node.nvls)
            for proto in nccl.protocols(algo)]


def nccl_time(plan: Plan, hw: HardwareProfile) -> float:
    """NCCL's own estimate of an ``auto`` plan: on the links, never on calibrated
    collectives (the tuner knows its model, not the measurement)."""
    intra, inter = hw.intra_node, hw.inter_node
    return _link_time(plan, (intra.bytes_per_s, inter.bytes_per_s),
                      (intra.alpha_s, inter.alpha_s))


def _link_time(plan: Plan, rate: tuple[float, float], alpha: tuple[float, float]) -> float:
    """Uncontended time of an NCCL plan on links of these rates and α (intra, inter)."""
    rates = {"intra_node": rate[0], "inter_node": rate[1]}
    alphas = {"intra_node": alpha[0], "inter_node": alpha[1]}
    return sum(max((g.bytes_per_rank / (rates[g.link_class] * g.rate_factor)
                    for g in ph.legs), default=0.0)
               + sum(u * alphas[cls] for cls, u in ph.alpha_units or ())
               for ph in plan.phases)


def nccl_choice(op: CollectiveName, size: float, shape: GroupShape, hw: HardwareProfile,
                nccl_version: str = DEFAULT_NCCL_VERSION) -> tuple[NcclAlgorithm, Protocol]:
    """NCCL's tuner: the (algorithm, protocol) of smallest :func:`nccl_time`, the first
    in the tuner's loop order on a tie."""
    intra, inter = hw.intra_node, hw.inter_node
    return _choice(op, size, shape.n, shape.per_node, nccl_version, intra.nvls,
                   intra.bytes_per_s, intra.alpha_s, inter.bytes_per_s, inter.alpha_s)


@lru_cache(maxsize=65536)
def _choice(op: CollectiveName, size: float, n: int, per_node: int, version: str,
            nvls: bool, intra_rate: float, intra_alpha: float, inter_rate: float,
            inter_alpha: float) -> tuple[NcclAlgorithm, Protocol]:
    """:func:`nccl_choice` on the numbers it depends on (cached: the analytic search
    asks for the same collective thousands of times)."""
    shape = GroupShape(n, per_node)
    best: tuple[float, Plan] | None = None
    for algo in nccl.algorithms(_as_nccl_op(op), _nccl_shape(shape), version, nvls):
        for proto in nccl.protocols(algo):
            plan = _nccl_plan(op, size, shape, algo, proto, (intra_alpha, inter_alpha), version)
            t = _link_time(plan, (intra_rate, inter_rate), (intra_alpha, inter_alpha))
            if best is None or t < best[0]:
                best = (t, plan)
    assert best is not None  # every NCCL op has a ring
    return best[1].algorithm, best[1].protocol  # type: ignore[return-value]


def leg_rate(leg: Leg, op: CollectiveName, hw: HardwareProfile) -> float:
    """Bytes/s of one leg alone: the link's achievable rate times the protocol's factor,
    or a calibrated busbw (which already is what the library achieved)."""
    cal = hw.collectives.get(op, {}).get(leg.link_class)
    if cal is not None:
        return cal.busbw_GBps * 1e9
    return hw.link(leg.link_class).bytes_per_s * leg.rate_factor


def phase_alpha(phase: Phase, op: CollectiveName, hw: HardwareProfile) -> float:
    """The phase's latency: NCCL's (an ``auto`` plan) unless a leg's link class has a
    calibrated entry for the op; else steps × the slowest class's α."""
    calibrated = hw.collectives.get(op, {})
    if phase.alpha_units is not None and not any(g.link_class in calibrated
                                                 for g in phase.legs):
        return sum(u * hw.link(cls).alpha_s for cls, u in phase.alpha_units)
    alphas = []
    for leg in phase.legs:
        cal = calibrated.get(leg.link_class)
        alphas.append(cal.alpha_us * 1e-6 if cal is not None else hw.link(leg.link_class).alpha_s)
    return max(alphas, default=0.0) * phase.steps


def sync_cost(plan: Plan, hw: HardwareProfile) -> float:
    """What the collective costs after compute beyond its back-to-back time, once per
    collective: ``gpu.collective_sync_curve`` at the collective's bytes (else
    ``gpu.collective_sync_us``) of the slowest link class it crosses (0 for a group of
    one, or a profile without the term)."""
    if plan.n <= 1:
        return 0.0
    return max((hw.gpu.collective_sync_s(leg.link_class, plan.size) for phase in plan.phases
                for leg in phase.legs), default=0.0)


def sync_burst_cost(plan: Plan, hw: HardwareProfile, burst_s: float) -> float:
    """What the collective costs beyond :func:`sync_cost` when its members come from up
    to ``burst_s`` seconds of compute since their previous collective:
    ``gpu.collective_sync_burst`` at that burst, of the slowest link class it crosses (0
    for a group of one, or a profile without the curve). Negative after a burst shorter
    than the calibration's where the profile measured one (less of the sync cost), but
    never more than the sync cost itself off. The engine charges it; the analytic
    estimate, which has no per-collective burst, does not."""
    if plan.n <= 1 or not hw.gpu.collective_sync_burst:
        return 0.0
    growth = max((hw.gpu.collective_sync_burst_s(leg.link_class, burst_s)
                  for phase in plan.phases for leg in phase.legs), default=0.0)
    return growth if growth >= 0 else max(growth, -sync_cost(plan, hw))


def phase_latencies(plan: Plan, hw: HardwareProfile) -> list[float]:
    """Each phase's latency (:func:`phase_alpha`), the first phase's with the collective's
    :func:`sync_cost`: the one place the engine and the analytic estimate take a plan's
    latencies from, so the sync cost is charged once however the plan is split
    (:func:`expand`)."""
    out = [phase_alpha(phase, plan.op, hw) for phase in plan.phases]
    if out:
        out[0] += sync_cost(plan, hw)
    return out


def estimate(plan: Plan, hw: HardwareProfile) -> float:
    """Uncontended time: per phase, the slowest leg plus its latency steps (the first
    phase's with the sync cost)."""
    total = 0.0
    for phase, alpha in zip(plan.phases, phase_latencies(plan, hw), strict=True):
        legs = [leg.bytes_per_rank / leg_rate(leg, plan.op, hw) for leg in phase.legs]
        total += max(legs, default=0.0) + alpha
    return total


def expand(plan: Plan) -> Plan:
    """Step-by-step form: every latency step becomes its own phase with its share of
    the bytes. For small groups, as a check on the aggregated form."""
    phases: list[Phase] = []
    for phase in plan.phases:
        steps = max(phase.steps, 1)
        legs = tuple(replace(g, bytes_per_rank=g.bytes_per_rank / steps) for g in phase.legs)
        units = None if phase.alpha_units is None else tuple(
            (cls, u / steps) for cls, u in phase.alpha_units)
        phases.extend(Phase(legs, 1, units) for _ in range(steps))
    return replace(plan, phases=tuple(phases))
