"""What one collective algorithm is, as a registry entry (:class:`Algorithm`).

An algorithm may have a *textbook* form, the α-β plan of its own volumes and latency
steps that a scenario gets by naming it (``simulation.collective_algorithm``), and an
*NCCL* form, which NCCL's tuner (:mod:`simulator.system.collectives.tuner`) may pick
for ``auto``: when NCCL offers it (op, group shape, version, NVLink SHARP), with which
protocols, and how its legs and latency steps carry the bytes at a protocol's rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from simulator.system import nccl
from simulator.system.collectives.plan import AlgorithmName, GroupShape, Leg, Plan
from simulator.system.nccl import Protocol
from simulator.system.units import CollectiveName

#: (op, size, shape) -> the textbook plan
Textbook = Callable[[CollectiveName, float, GroupShape], Plan]
#: (op, size, shape, the protocol's bandwidth factor, NCCL's version) -> its NCCL legs and
#: latency steps
NcclLegs = Callable[[CollectiveName, float, GroupShape, float, str],
                    tuple[tuple[Leg, ...], int]]
#: (op, NCCL's view of the group, NCCL's (major, minor), NVSwitch multicast) -> offered
Offered = Callable[[nccl.Op, nccl.Shape, tuple[int, int], bool], bool]


def never(op: CollectiveName, shape: GroupShape) -> bool:
    return False


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm: its textbook form (``textbook``; ``named(op, shape)``
    says where a scenario may name it, ``choosable`` whether the schema lists it) and
    its NCCL form (``nccl_id``: NCCL's algorithm index, the tuner's loop order;
    ``offered``, ``protocols``, ``nccl_legs``), either of which may be absent."""

    name: AlgorithmName
    textbook: Textbook | None = None
    named: Callable[[CollectiveName, GroupShape], bool] = never
    choosable: bool = False
    nccl_id: int | None = None  # NCCL_ALGO_TREE 0, RING 1, NVLS 4, NVLS_TREE 5, PAT 6
    offered: Offered | None = None
    protocols: tuple[Protocol, ...] = ("Simple",)
    nccl_legs: NcclLegs | None = None
