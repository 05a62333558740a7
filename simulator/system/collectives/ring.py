"""The ring: every op NCCL tunes, and the fallback of an explicit choice.

All-reduce moves 2(n−1)/n·S per rank in 2(n−1) steps; all-gather and reduce-scatter
(S = the whole array) (n−1)/n·S in n−1 steps; broadcast (pipelined ring) S per rank in
n−1 steps. Across nodes, the node's k NICs carry the node's share of the traffic
between them (NCCL's channels use every rail): each NIC carries busbw(N)·S/k (S/k for
broadcast) while NVLink carries the rest. NCCL runs it in LL, LL128 or Simple, each at
its bandwidth factor on the link (:func:`simulator.system.nccl.bandwidth_factor`).
"""

from __future__ import annotations

from dataclasses import replace

from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg, Phase, Plan, busbw_factor
from simulator.system.nccl import DEFAULT_NCCL_VERSION, PROTOCOLS
from simulator.system.units import CollectiveName

NCCL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def ring_plan(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
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


def ring_legs(op: CollectiveName, size: float, shape: GroupShape, factor: float,
              version: str = DEFAULT_NCCL_VERSION) -> tuple[tuple[Leg, ...], int]:
    """The ring's volumes at a protocol's rate, in the ring's steps (the same in every
    NCCL version)."""
    ring = ring_plan(op, size, shape).phases[0]
    return tuple(replace(g, rate_factor=factor) for g in ring.legs), ring.steps


RING = Algorithm("ring", ring_plan, lambda op, shape: op in NCCL_OPS, choosable=True,
                 nccl_id=1, offered=lambda op, shape, version, nvls: True,
                 protocols=PROTOCOLS, nccl_legs=ring_legs)
