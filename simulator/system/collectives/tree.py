"""The double binary tree (NCCL's all-reduce tree): ring volumes, but 2(k−1) intra-node
steps plus 2⌈log2 N⌉ across nodes, and NCCL's lower tree bandwidth across nodes
(``nccl.TREE_BW``). All-reduce only.
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.system import nccl
from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg, Phase, Plan
from simulator.system.collectives.ring import ring_legs, ring_plan
from simulator.system.nccl import PROTOCOLS
from simulator.system.units import CollectiveName


def tree_steps(shape: GroupShape) -> int:
    nodes = shape.nodes
    log_steps = 2 * math.ceil(math.log2(nodes)) if nodes > 1 else 0
    return 2 * (shape.per_node - 1) + log_steps


def tree_plan(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    ring = ring_plan(op, size, shape)
    legs = tuple(replace(g, rate_factor=nccl.TREE_BW) if g.link_class == "inter_node" else g
                 for g in ring.phases[0].legs)
    return Plan(op, "tree", size, shape.n, (Phase(legs, tree_steps(shape)),))


def tree_legs(op: CollectiveName, size: float, shape: GroupShape, factor: float,
              version: str = nccl.DEFAULT_NCCL_VERSION) -> tuple[tuple[Leg, ...], int]:
    """The ring's volumes at the tree's protocol rate, in the tree's steps."""
    return ring_legs(op, size, shape, factor)[0], tree_steps(shape)


TREE = Algorithm("tree", tree_plan, lambda op, shape: op == "all_reduce", choosable=True,
                 nccl_id=0, offered=lambda op, shape, version, nvls: op == "all_reduce",
                 protocols=PROTOCOLS, nccl_legs=tree_legs)
