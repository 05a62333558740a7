"""A collective as a plan: which link class carries how many bytes per rank, in how
many latency steps, phase by phase.

A plan is a sequence of *phases* run one after another; a phase is a set of
concurrent *legs*, one per link class, each carrying ``bytes_per_rank`` from every
member over that class, followed by ``steps × α`` of latency. The engine turns a
leg into one flow per simulated member; it never expands a 1,024-rank ring into
2,046 per-link events (:func:`simulator.system.collectives.cost.expand` gives the
step-by-step form for small groups, a validation mode). Volumes follow nccl-tests'
conventions (``doc/PERFORMANCE.md``: algbw = S / t, busbw = algbw × the op's factor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from simulator.system.nccl import Protocol
from simulator.system.units import CollectiveName, LinkName

AlgorithmName = Literal["ring", "tree", "hierarchical", "direct", "pairwise", "nvls", "nvls_tree",
                        "pat", "deepep"]  # deepep: simulator.strategies.expert.deepep


@dataclass(frozen=True)
class GroupShape:
    n: int  # ranks in the group
    per_node: int  # ranks of the group on each node (k)

    @property
    def nodes(self) -> int:
        return self.n // self.per_node


@dataclass(frozen=True)
class Leg:
    link_class: LinkName
    bytes_per_rank: float
    rate_factor: float = 1.0  # the protocol's share of the link's rate (NCCL plans)


@dataclass(frozen=True)
class Phase:
    legs: tuple[Leg, ...]
    steps: int  # latency steps, each charged the α of the slowest class in the phase
    # NCCL's latency for the whole phase as multiples of each class's α (an ``auto``
    # plan), replacing steps × the slowest α
    alpha_units: tuple[tuple[LinkName, float], ...] | None = None


@dataclass(frozen=True)
class Plan:
    op: CollectiveName
    algorithm: AlgorithmName
    size: float  # S, bytes (the whole array for all-gather / reduce-scatter)
    n: int
    phases: tuple[Phase, ...]
    protocol: Protocol = "Simple"  # NCCL's LL, LL128 or Simple
    # SMs its kernels hold for their whole run, taken from the compute beside them
    # (DeepEP's; NCCL's channels: :mod:`simulator.system.collectives.channels`)
    sms: int = 0


def busbw_factor(op: CollectiveName, n: int) -> float:
    """nccl-tests' busbw / algbw factor (doc/PERFORMANCE.md)."""
    if op in ("broadcast", "send_recv"):
        return 1.0
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algbw(size: float, seconds: float) -> float:
    return size / seconds


def busbw(op: CollectiveName, n: int, size: float, seconds: float) -> float:
    return algbw(size, seconds) * busbw_factor(op, n)
