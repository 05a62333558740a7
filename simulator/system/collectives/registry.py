"""The collective algorithms by name.

:data:`ALGORITHMS` is the one place that lists them; a new algorithm is a module with
its :class:`~simulator.system.collectives.algorithm.Algorithm` and one entry here.
NCCL's tuner (:mod:`simulator.system.collectives.tuner`) reads the entries with an NCCL
form; the scenario schema lists :func:`choosable`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.direct import DIRECT
from simulator.system.collectives.hierarchical import HIERARCHICAL
from simulator.system.collectives.nvls import NVLS, NVLS_TREE
from simulator.system.collectives.pairwise import PAIRWISE
from simulator.system.collectives.pat import PAT
from simulator.system.collectives.ring import RING
from simulator.system.collectives.tree import TREE

ALGORITHMS: Mapping[str, Algorithm] = MappingProxyType({
    a.name: a for a in (RING, TREE, HIERARCHICAL, NVLS, NVLS_TREE, PAT, PAIRWISE, DIRECT)})


def choosable() -> list[str]:
    """What ``simulation.collective_algorithm`` may name: ``auto`` and the algorithms a
    scenario may ask for by name."""
    return ["auto", *(name for name, a in ALGORITHMS.items() if a.choosable)]
