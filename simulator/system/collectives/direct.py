"""Direct point-to-point: a send/recv of S bytes in one step, over NVLink within a node
and the NIC across nodes; and the empty plan of a group of one.
"""

from __future__ import annotations

from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg, Phase, Plan
from simulator.system.units import CollectiveName, LinkName


def direct_plan(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    if shape.n <= 1:
        return Plan(op, "direct", size, shape.n, ())
    cls: LinkName = "intra_node" if shape.nodes == 1 else "inter_node"
    return Plan(op, "direct", size, shape.n, (Phase((Leg(cls, size),), 1),))


DIRECT = Algorithm("direct", direct_plan, lambda op, shape: op == "send_recv")
