"""The double binary tree (NCCL's all-reduce tree): the ring's NVLink volume, the node's
share 2(N−1)/N·S/k on each NIC (the node reduces within itself before the trees
between nodes), 2(k−1) intra-node steps plus 2⌈log2 N⌉ across nodes, and NCCL's lower
tree bandwidth across nodes (``nccl.TREE_BW``). All-reduce only.
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.system import nccl
from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg, Phase, Plan
from simulator.system.collectives.ring import rail_legs
from simulator.system.nccl import PROTOCOLS
from simulator.system.units import CollectiveName


def tree_steps(shape: GroupShape) -> int:
    nodes = shape.nodes
    log_steps = 2 * math.ceil(math.log2(nodes)) if nodes > 1 else 0
    return 2 * (shape.per_node - 1) + log_steps


def tree_plan(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    legs = tuple(replace(g, rate_factor=nccl.TREE_BW) if g.link_class == "inter_node" else g
                 for g in rail_legs(op, size, shape, shape.nodes))
    return Plan(op, "tree", size, shape.n, (Phase(legs, tree_steps(shape)),))


def tree_legs(op: CollectiveName, size: float, shape: GroupShape, factor: float,
              version: str = nccl.DEFAULT_NCCL_VERSION) -> tuple[tuple[Leg, ...], int]:
    """The tree's volumes at its protocol's rate, in the tree's steps."""
    legs = rail_legs(op, size, shape, shape.nodes)
    return tuple(replace(g, rate_factor=factor) for g in legs), tree_steps(shape)


TREE = Algorithm("tree", tree_plan, lambda op, shape: op == "all_reduce", choosable=True,
                 nccl_id=0, offered=lambda op, shape, version, nvls: op == "all_reduce",
                 protocols=PROTOCOLS, nccl_legs=tree_legs)
