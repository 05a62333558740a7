"""Pairwise exchange, the all-to-all (Thakur et al. 2005, MPICH: in step i rank r sends
to r + i and receives from r − i; S = each rank's send buffer, S/n to every member, as
nccl-tests' ``alltoall_perf``), n−1 steps: every rank's (k−1)/n·S for its node's peers
crosses NVLink and its (n−k)/n·S for the other nodes its own NIC, concurrently, so the
time is (n−1)/n·S over the bottleneck link class when the group is on one class.
"""

from __future__ import annotations

from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg, Phase, Plan
from simulator.system.units import CollectiveName, LinkName


def pairwise_plan(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    n, k = shape.n, shape.per_node
    peers: tuple[tuple[LinkName, int], ...] = (("intra_node", k - 1), ("inter_node", n - k))
    legs = tuple(Leg(cls, count / n * size) for cls, count in peers if count)
    return Plan("all_to_all", "pairwise", size, n, (Phase(legs, n - 1),))


PAIRWISE = Algorithm("pairwise", pairwise_plan, lambda op, shape: op == "all_to_all")
