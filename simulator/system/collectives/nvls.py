"""NVLink SHARP (NCCL's NVLS, from 2.17: an all-reduce on one NVSwitch-gen-3 node, the
whole buffer through the switch's multicast) and NVLS-tree (from 2.18: NVLS in each node,
a tree over the NICs, S/k per NIC; NCCL 2.18 prices it as a chain of 2(N − 1) network
hops at one link's rate, :func:`simulator.system.nccl.nvls_tree_factors`). NCCL-only
algorithms: ``auto`` may pick them, a scenario cannot name them. Across nodes plain NVLS
needs CollNet, which is not modelled.
"""

from __future__ import annotations

from simulator.system import nccl
from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg
from simulator.system.collectives.tree import tree_steps
from simulator.system.units import CollectiveName


def nvls_legs(op: CollectiveName, size: float, shape: GroupShape, factor: float,
              version: str = nccl.DEFAULT_NCCL_VERSION) -> tuple[tuple[Leg, ...], int]:
    return (Leg("intra_node", size, factor),), 1


def nvls_tree_legs(op: CollectiveName, size: float, shape: GroupShape, factor: float,
                   version: str = nccl.DEFAULT_NCCL_VERSION) -> tuple[tuple[Leg, ...], int]:
    """S through the NVSwitch port at ``factor`` and S / k per NIC at the network's
    factor of ``version`` (:func:`simulator.system.nccl.nvls_tree_factors`)."""
    inter = Leg("inter_node", size / shape.per_node,
                nccl.nvls_tree_inter_factor(nccl.Shape(shape.n, shape.nodes), version))
    chain = nccl.parse_version(version) < nccl.NVLS_2_19  # 2.18: 2(N − 1) network hops
    hops = 2 * (shape.nodes - 1) if chain else tree_steps(GroupShape(shape.nodes, 1))
    return (Leg("intra_node", size, factor), inter), 1 + hops


def _nvls(op: nccl.Op, shape: nccl.Shape, version: tuple[int, int], nvls: bool) -> bool:
    return op == "all_reduce" and nvls and version >= nccl.NVLS_SINCE and shape.nodes == 1 \
        and shape.ranks > 1


def _nvls_tree(op: nccl.Op, shape: nccl.Shape, version: tuple[int, int], nvls: bool) -> bool:
    return op == "all_reduce" and nvls and version >= nccl.NVLS_TREE_SINCE \
        and shape.nodes > 1 and shape.per_node > 1


NVLS = Algorithm("nvls", nccl_id=4, offered=_nvls, nccl_legs=nvls_legs)
NVLS_TREE = Algorithm("nvls_tree", nccl_id=5, offered=_nvls_tree, nccl_legs=nvls_tree_legs)
