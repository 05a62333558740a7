"""The plan of one collective: ``auto`` as NCCL would run it
(:mod:`simulator.system.collectives.tuner`), or a named algorithm of the registry in its
textbook α-β form where it has one for the op and group, else the op's default (the
ring; pairwise for all-to-all; direct for send/recv).
"""

from __future__ import annotations

from simulator.system.collectives.channels import with_channels
from simulator.system.collectives.plan import AlgorithmName, GroupShape, Plan
from simulator.system.collectives.registry import ALGORITHMS
from simulator.system.collectives.tuner import (
    nccl_algorithms,
    nccl_choice,
    nccl_gpu,
    nccl_plan,
)
from simulator.system.hardware import HardwareProfile
from simulator.system.nccl import DEFAULT_NCCL_VERSION
from simulator.system.units import CollectiveName


def _default(op: CollectiveName) -> str:
    return {"all_to_all": "pairwise", "send_recv": "direct"}.get(op, "ring")


def candidates(op: CollectiveName, shape: GroupShape, nccl_version: str = DEFAULT_NCCL_VERSION,
               nvls: bool = False) -> list[AlgorithmName]:
    """The algorithms ``auto`` chooses among: NCCL's for the op, version and group (never
    ``hierarchical``, which is only ever an explicit choice); the op's default where NCCL
    does not tune it."""
    if shape.n <= 1:
        return ["direct"]
    if op in ("send_recv", "all_to_all"):  # NCCL does not tune them
        return [ALGORITHMS[_default(op)].name]
    return list(nccl_algorithms(op, shape, nccl_version, nvls))


def make_plan(op: CollectiveName, size: float, shape: GroupShape, algorithm: str,
              hw: HardwareProfile, nccl_version: str = DEFAULT_NCCL_VERSION) -> Plan:
    """The plan for one collective: ``auto`` as NCCL ``nccl_version`` would run it, a
    named algorithm in its textbook form (the op's default where it has none); an
    NCCL kernel's with the SMs it holds (:mod:`simulator.system.collectives.channels`)."""
    if shape.n <= 1:
        return Plan(op, "direct", size, shape.n, ())
    if algorithm == "auto" and op not in ("send_recv", "all_to_all"):
        algo, proto = nccl_choice(op, size, shape, hw, nccl_version)
        return with_channels(nccl_plan(op, size, shape, algo, proto,
                                       (hw.intra_node.alpha_s, hw.inter_node.alpha_s),
                                       nccl_version, nccl_gpu(hw)), hw)
    named = ALGORITHMS.get(algorithm)
    if named is None or named.textbook is None or not named.named(op, shape):
        named = ALGORITHMS[_default(op)]
    assert named.textbook is not None
    return with_channels(named.textbook(op, size, shape), hw)
