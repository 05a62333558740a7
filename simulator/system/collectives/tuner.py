"""NCCL's tuner over the registry's algorithms: which (algorithm, protocol) pairs an
NCCL version may run a collective with, each as a plan of its legs at the protocol's
rate with NCCL's own latency (:mod:`simulator.system.nccl`'s tables), and the one of
smallest time NCCL picks (the first in its loop order, by algorithm index then
protocol, on a tie). The choice is made on the links, never on calibrated collectives:
the tuner knows its model, not the measurement.
"""

from __future__ import annotations

from functools import lru_cache
from typing import cast

from simulator.system import nccl
from simulator.system.collectives.algorithm import Algorithm
from simulator.system.collectives.plan import GroupShape, Phase, Plan
from simulator.system.collectives.registry import ALGORITHMS
from simulator.system.hardware import HardwareProfile
from simulator.system.nccl import DEFAULT_NCCL_VERSION, NcclAlgorithm, Protocol
from simulator.system.units import CollectiveName, LinkName

NCCL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
NCCL_HW: dict[LinkName, nccl.HwKind] = {"intra_node": "nvlink", "inter_node": "net"}


def _entries() -> list[Algorithm]:
    """The registry's NCCL algorithms in NCCL's loop order (its algorithm index)."""
    return sorted((a for a in ALGORITHMS.values() if a.nccl_id is not None),
                  key=lambda a: a.nccl_id or 0)


def _as_nccl_op(op: CollectiveName) -> nccl.Op:
    if op not in NCCL_OPS:
        raise ValueError(f"{op} is not one of NCCL's tuned collectives {NCCL_OPS}")
    return op  # type: ignore[return-value]


def _nccl_shape(shape: GroupShape) -> nccl.Shape:
    return nccl.Shape(shape.n, shape.nodes)


def nccl_algorithms(op: CollectiveName, shape: GroupShape,
                    version: str = DEFAULT_NCCL_VERSION,
                    nvls: bool = False) -> list[NcclAlgorithm]:
    """The algorithms NCCL ``version`` may run ``op`` with on this group, in the tuner's
    loop order: each entry's own rule (tree only for all-reduce; PAT for all-gather and
    reduce-scatter from 2.23 with one rank per node; on NVSwitch gen 3 NVLS for a
    one-node all-reduce and NVLS-tree for a multi-node one)."""
    nop, ns, ver = _as_nccl_op(op), _nccl_shape(shape), nccl.parse_version(version)
    return [cast(NcclAlgorithm, a.name) for a in _entries()
            if a.offered is not None and a.offered(nop, ns, ver, nvls)]


def nccl_gpu(hw: HardwareProfile) -> tuple[int, int]:
    """What NCCL's tuner reads of the GPUs beyond the links: the communicator's channels
    (``gpu.runtime.nccl_channels``) and ``minCompCap`` (80 for compute capability 8.0;
    0 where the profile does not state it)."""
    cc = hw.gpu.compute_capability
    major, minor = (int(x) for x in cc.split(".")) if cc else (0, 0)
    return hw.gpu.runtime_memory().nccl_channels, 10 * major + minor


def nccl_plan(op: CollectiveName, size: float, shape: GroupShape, algo: NcclAlgorithm,
              proto: Protocol, alphas: tuple[float, float], version: str,
              gpu: tuple[int, int] = (0, 0)) -> Plan:
    """NCCL's ``algo`` with ``proto``: its legs at the protocol's rate (the ring's volumes;
    NVLS: the whole buffer through the NVSwitch port), in one phase of NCCL's latency
    (``alphas``: the NVLink and network α, seconds; ``gpu``: :func:`nccl_gpu`, for the
    ring plateau of :func:`simulator.system.nccl.ring_plateau`)."""
    nop, ns = _as_nccl_op(op), _nccl_shape(shape)
    factor = nccl.bandwidth_factor(algo, proto, nop, ns, size, version)
    legs_of = ALGORITHMS[algo].nccl_legs
    assert legs_of is not None, algo
    legs, steps = legs_of(op, size, shape, factor, version)
    units = nccl.latency_units(algo, proto, nop, ns, {"nvlink": alphas[0], "net": alphas[1]},
                               version)
    plateau = nccl.ring_plateau(algo, proto, nop, ns, size, version, *gpu)
    alpha_units = tuple((cls, units[hw] * plateau) for cls, hw in NCCL_HW.items()
                        if units[hw])
    return Plan(op, algo, size, shape.n, (Phase(legs, steps, alpha_units),), proto)


def nccl_plans(op: CollectiveName, size: float, shape: GroupShape, hw: HardwareProfile,
               nccl_version: str = DEFAULT_NCCL_VERSION) -> list[Plan]:
    """Every (algorithm, protocol) NCCL ``nccl_version`` may run the collective with,
    in its tuner's loop order."""
    alphas = (hw.intra_node.alpha_s, hw.inter_node.alpha_s)
    return [nccl_plan(op, size, shape, algo, proto, alphas, nccl_version, nccl_gpu(hw))
            for algo in nccl_algorithms(op, shape, nccl_version, hw.intra_node.nvls)
            for proto in ALGORITHMS[algo].protocols]


def nccl_time(plan: Plan, hw: HardwareProfile) -> float:
    """NCCL's own estimate of an ``auto`` plan: on the links, never on calibrated
    collectives (the tuner knows its model, not the measurement)."""
    intra, inter = hw.intra_node, hw.inter_node
    return _link_time(plan, (intra.bytes_per_s, inter.bytes_per_s),
                      (intra.alpha_s, inter.alpha_s))


def _link_time(plan: Plan, rate: tuple[float, float], alpha: tuple[float, float]) -> float:
    """Uncontended time of an NCCL plan on links of these rates and α (intra, inter)."""
    rates = {"intra_node": rate[0], "inter_node": rate[1]}
    alphas = {"intra_node": alpha[0], "inter_node": alpha[1]}
    return sum(max((g.bytes_per_rank / (rates[g.link_class] * g.rate_factor)
                    for g in ph.legs), default=0.0)
               + sum(u * alphas[cls] for cls, u in ph.alpha_units or ())
               for ph in plan.phases)


def nccl_choice(op: CollectiveName, size: float, shape: GroupShape, hw: HardwareProfile,
                nccl_version: str = DEFAULT_NCCL_VERSION) -> tuple[NcclAlgorithm, Protocol]:
    """NCCL's tuner: the (algorithm, protocol) of smallest :func:`nccl_time`, the first
    in the tuner's loop order on a tie."""
    intra, inter = hw.intra_node, hw.inter_node
    return _choice(op, size, shape.n, shape.per_node, nccl_version, intra.nvls,
                   intra.bytes_per_s, intra.alpha_s, inter.bytes_per_s, inter.alpha_s,
                   nccl_gpu(hw))


@lru_cache(maxsize=65536)
def _choice(op: CollectiveName, size: float, n: int, per_node: int, version: str,
            nvls: bool, intra_rate: float, intra_alpha: float, inter_rate: float,
            inter_alpha: float, gpu: tuple[int, int]) -> tuple[NcclAlgorithm, Protocol]:
    """:func:`nccl_choice` on the numbers it depends on (cached: the analytic search
    asks for the same collective thousands of times)."""
    shape = GroupShape(n, per_node)
    best: tuple[float, Plan] | None = None
    for algo in nccl_algorithms(op, shape, version, nvls):
        for proto in ALGORITHMS[algo].protocols:
            plan = nccl_plan(op, size, shape, algo, proto, (intra_alpha, inter_alpha), version,
                             gpu)
            t = _link_time(plan, (intra_rate, inter_rate), (intra_alpha, inter_alpha))
            if best is None or t < best[0]:
                best = (t, plan)
    assert best is not None  # every NCCL op has a ring
    return best[1].algorithm, best[1].protocol  # type: ignore[return-value]
