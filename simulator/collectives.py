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
  nodes (``TREE_INTER_EFFICIENCY``).
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

``auto`` picks, per collective, the algorithm with the smallest uncontended
estimate, as NCCL's tuner does from its own cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from simulator.hardware import CollectiveName, HardwareProfile, LinkName

AlgorithmName = Literal["ring", "tree", "hierarchical", "direct", "pairwise"]
TREE_INTER_EFFICIENCY = 0.9  # NCCL rates tree below ring for large inter-node messages


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


@dataclass(frozen=True)
class Phase:
    legs: tuple[Leg, ...]
    steps: int  # latency steps, each charged the α of the slowest class in the phase


@dataclass(frozen=True)
class Plan:
    op: CollectiveName
    algorithm: AlgorithmName
    size: float  # S, bytes (the whole array for all-gather / reduce-scatter)
    n: int
    phases: tuple[Phase, ...]


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
    k, nodes = shape.per_node, shape.nodes
    legs = tuple(Leg(g.link_class, g.bytes_per_rank / TREE_INTER_EFFICIENCY)
                 if g.link_class == "inter_node" else g for g in ring.phases[0].legs)
    log_steps = 2 * math.ceil(math.log2(nodes)) if nodes > 1 else 0
    return Plan(op, "tree", size, shape.n, (Phase(legs, 2 * (k - 1) + log_steps),))


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


def candidates(op: CollectiveName, shape: GroupShape) -> list[AlgorithmName]:
    if op == "send_recv" or shape.n <= 1:
        return ["direct"]
    if op == "all_to_all":  # hierarchical only when asked for (make_plan)
        return ["pairwise"]
    out: list[AlgorithmName] = ["ring"]
    if op in ("all_reduce", "broadcast"):
        out.append("tree")
    if op in ("all_reduce", "all_gather", "reduce_scatter") and shape.nodes > 1 \
            and shape.per_node > 1:
        out.append("hierarchical")
    return out


def make_plan(op: CollectiveName, size: float, shape: GroupShape, algorithm: str,
              hw: HardwareProfile) -> Plan:
    """The plan for one collective; ``auto`` picks the cheapest uncontended candidate."""
    if shape.n <= 1:
        return Plan(op, "direct", size, shape.n, ())
    if op == "all_to_all":
        if algorithm == "hierarchical" and shape.nodes > 1 and shape.per_node > 1:
            return _hierarchical_all_to_all(size, shape)
        return _pairwise(size, shape)
    options = candidates(op, shape)
    if algorithm == "auto":
        plans = [make_plan(op, size, shape, a, hw) for a in options]
        return min(plans, key=lambda p: estimate(p, hw))
    chosen = algorithm if algorithm in options else "ring"
    if op == "send_recv":
        cls: LinkName = "intra_node" if shape.nodes == 1 else "inter_node"
        return Plan(op, "direct", size, shape.n, (Phase((Leg(cls, size),), 1),))
    if chosen == "tree":
        return _tree(op, size, shape)
    if chosen == "hierarchical":
        return _hierarchical(op, size, shape)
    return _ring(op, size, shape)


def leg_rate(leg: Leg, op: CollectiveName, hw: HardwareProfile) -> float:
    """Bytes/s of one leg alone: the link's achievable rate, or a calibrated busbw."""
    cal = hw.collectives.get(op, {}).get(leg.link_class)
    if cal is not None:
        return cal.busbw_GBps * 1e9
    return hw.link(leg.link_class).bytes_per_s


def phase_alpha(phase: Phase, op: CollectiveName, hw: HardwareProfile) -> float:
    alphas = []
    for leg in phase.legs:
        cal = hw.collectives.get(op, {}).get(leg.link_class)
        alphas.append(cal.alpha_us * 1e-6 if cal is not None else hw.link(leg.link_class).alpha_s)
    return max(alphas, default=0.0) * phase.steps


def estimate(plan: Plan, hw: HardwareProfile) -> float:
    """Uncontended time: per phase, the slowest leg plus its latency steps."""
    total = 0.0
    for phase in plan.phases:
        legs = [leg.bytes_per_rank / leg_rate(leg, plan.op, hw) for leg in phase.legs]
        total += max(legs, default=0.0) + phase_alpha(phase, plan.op, hw)
    return total


def expand(plan: Plan) -> Plan:
    """Step-by-step form: every latency step becomes its own phase with its share of
    the bytes. For small groups, as a check on the aggregated form."""
    phases: list[Phase] = []
    for phase in plan.phases:
        steps = max(phase.steps, 1)
        legs = tuple(Leg(g.link_class, g.bytes_per_rank / steps) for g in phase.legs)
        phases.extend(Phase(legs, 1) for _ in range(steps))
    return Plan(plan.op, plan.algorithm, plan.size, plan.n, tuple(phases))
