"""The ring: every op NCCL tunes, and the fallback of an explicit choice.

All-reduce moves 2(n−1)/n·S per rank in 2(n−1) steps; all-gather and reduce-scatter
(S = the whole array) (n−1)/n·S in n−1 steps; broadcast (pipelined ring) S per rank in
n−1 steps. Across nodes the ring is flat: each channel's ring runs through a node's k
GPUs over NVLink and leaves it through one NIC (NCCL's channels spread over every rail),
and every link of a ring carries the ring's whole per-rank volume, so each NIC carries
busbw(n)·S/k (S/k for broadcast), not the node's share busbw(N)·S/k that a
hierarchical algorithm or a tree puts on it (:func:`rail_legs`). NCCL's own model says
the same: a ring's algorithm bandwidth is ``busBw · nRanks / nsteps`` with ``busBw =
nChannels · bwInter`` beyond two nodes (NVIDIA/nccl ``src/graph/tuning.cc``
``ncclTopoTuneModel``, "Convert bus BW to algorithm BW", v2.18.1-1 and v2.20.3-1), a
time of (n−1)/n·S over the NICs' rate for an all-gather whatever the node count. NCCL
runs it in LL, LL128 or Simple, each at its bandwidth factor on the link
(:func:`simulator.system.nccl.bandwidth_factor`).
"""

from __future__ import annotations

from dataclasses import replace

from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Leg, Phase, Plan, busbw_factor
from simulator.system.nccl import DEFAULT_NCCL_VERSION, PROTOCOLS
from simulator.system.units import CollectiveName

NCCL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def rail_legs(op: CollectiveName, size: float, shape: GroupShape,
              across: int) -> tuple[Leg, ...]:
    """NVLink's per-rank volume busbw(n)·S and, across nodes, each of a node's k NICs
    busbw(``across``)·S/k (S/k for broadcast): ``across`` is n for a flat ring, whose
    every link carries the ring's volume, and N for a tree, which moves only the node's
    share between nodes."""
    n, k, nodes = shape.n, shape.per_node, shape.nodes
    factor = busbw_factor(op, n)
    if nodes == 1:
        return (Leg("intra_node", factor * size),)
    inter = busbw_factor(op, across) * size / k if op != "broadcast" else size / k
    legs: tuple[Leg, ...] = (Leg("inter_node", inter),)
    return (Leg("intra_node", factor * size), *legs) if k > 1 else legs


def ring_plan(op: CollectiveName, size: float, shape: GroupShape) -> Plan:
    n = shape.n
    steps = {"all_reduce": 2 * (n - 1), "broadcast": n - 1}.get(op, n - 1)
    if op == "send_recv":
        steps = 1
    return Plan(op, "ring", size, n, (Phase(rail_legs(op, size, shape, n), steps),))


def ring_legs(op: CollectiveName, size: float, shape: GroupShape, factor: float,
              version: str = DEFAULT_NCCL_VERSION) -> tuple[tuple[Leg, ...], int]:
    """The ring's volumes at a protocol's rate, in the ring's steps (the same in every
    NCCL version)."""
    ring = ring_plan(op, size, shape).phases[0]
    return tuple(replace(g, rate_factor=factor) for g in ring.legs), ring.steps


RING = Algorithm("ring", ring_plan, lambda op, shape: op in NCCL_OPS, choosable=True,
                 nccl_id=1, offered=lambda op, shape, version, nvls: True,
                 protocols=PROTOCOLS, nccl_legs=ring_legs)
