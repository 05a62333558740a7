"""The hierarchical algorithms, which NCCL does not have: only ever an explicit choice.

All-reduce: intra-node reduce-scatter → inter-node all-reduce of S/k over the rails →
intra-node all-gather, three phases in sequence; all-gather: the inter-node all-gather
of shards, then intra-node; reduce-scatter: intra-node first, then across nodes.
All-to-all: an intra-node all-to-all that gathers on each rank the node's data for the
ranks of its rail ((k−1)/k·S, k−1 steps), then an all-to-all over the rails
((N−1)/N·S per NIC, N−1 steps): the same NIC bytes as pairwise in fewer, larger
messages. For groups spanning nodes with more than one rank on each.
"""

from __future__ import annotations

from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg, Phase, Plan
from simulator.system.units import CollectiveName


def _all_to_all(size: float, shape: GroupShape) -> Plan:
    k, nodes = shape.per_node, shape.nodes
    intra = Phase((Leg("intra_node", (k - 1) / k * size),), k - 1)
    inter = Phase((Leg("inter_node", (nodes - 1) / nodes * size),), nodes - 1)
    return Plan("all_to_all", "hierarchical", size, shape.n, (intra, inter))


def hierarchical_plan(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    if op == "all_to_all":
        return _all_to_all(size, shape)
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


def _named(op: CollectiveName, shape: GroupShape) -> bool:
    return op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") \
        and shape.nodes > 1 and shape.per_node > 1


HIERARCHICAL = Algorithm("hierarchical", hierarchical_plan, _named, choosable=True)
