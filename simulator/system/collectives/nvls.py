"""NVLink SHARP (NCCL's NVLS, from 2.17: an all-reduce on one NVSwitch-gen-3 node, the
whole buffer through the switch's multicast) and NVLS-tree (from 2.18: NVLS in each node,
a tree over the NICs, S/k per NIC). NCCL-only algorithms: ``auto`` may pick them, a
scenario cannot name them. Across nodes plain NVLS needs CollNet, which is not modelled.
"""

from __future__ import annotations

from simulator.system import nccl
from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg
from simulator.system.collectives.tree import tree_steps
from simulator.system.units import CollectiveName


def nvls_legs(op: CollectiveName, size: float, shape: GroupShape,
              factor: float) -> tuple[tuple[Leg, ...], int]:
    return (Leg("intra_node", size, factor),), 1


def nvls_tree_legs(op: CollectiveName, size: float, shape: GroupShape,
                   factor: float) -> tuple[tuple[Leg, ...], int]:
    inter = Leg("inter_node", size / shape.per_node,
                nccl.nvls_tree_inter_factor(nccl.Shape(shape.n, shape.nodes)))
    return (Leg("intra_node", size, factor), inter), 1 + tree_steps(GroupShape(shape.nodes, 1))


def _nvls(op: nccl.Op, shape: nccl.Shape, version: tuple[int, int], nvls: bool) -> bool:
    return op == "all_reduce" and nvls and version >= nccl.NVLS_SINCE and shape.nodes == 1 \
        and shape.ranks > 1


def _nvls_tree(op: nccl.Op, shape: nccl.Shape, version: tuple[int, int], nvls: bool) -> bool:
    return op == "all_reduce" and nvls and version >= nccl.NVLS_TREE_SINCE \
        and shape.nodes > 1 and shape.per_node > 1


NVLS = Algorithm("nvls", nccl_id=4, offered=_nvls, nccl_legs=nvls_legs)
NVLS_TREE = Algorithm("nvls_tree", nccl_id=5, offered=_nvls_tree, nccl_legs=nvls_tree_legs)
