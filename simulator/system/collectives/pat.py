"""PAT, NCCL's parallel aggregated trees for all-gather and reduce-scatter (from 2.23,
one rank per node, Simple only): the ring's volumes in a Bruck-like log2(N) rounds.
NCCL-only: ``auto`` may pick it, a scenario cannot name it.
"""

from __future__ import annotations

from simulator.system import nccl
from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg
from simulator.system.collectives.ring import ring_legs
from simulator.system.units import CollectiveName


def pat_legs(op: CollectiveName, size: float, shape: GroupShape, factor: float,
             version: str = nccl.DEFAULT_NCCL_VERSION) -> tuple[tuple[Leg, ...], int]:
    return ring_legs(op, size, shape, factor)[0], nccl.pat_steps(shape.nodes)


def _offered(op: nccl.Op, shape: nccl.Shape, version: tuple[int, int], nvls: bool) -> bool:
    return op in ("all_gather", "reduce_scatter") and version >= nccl.PAT_SINCE \
        and shape.per_node == 1 and shape.nodes > 1


PAT = Algorithm("pat", nccl_id=6, offered=_offered, nccl_legs=pat_legs)
