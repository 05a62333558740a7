"""Cost model: seconds for an operation on a given hardware profile.

Compute ops are rooflined: ``max(flops / (peak × eff(size)), bytes / (hbm × eff(bytes)))``
plus a fixed per-kernel overhead, where the efficiency curves come from the
profile (datasheet presets or calibration) — GEMMs use ``gemm_efficiency`` over
the FLOPs of the single GEMM call, attention its own curve, memory-bound kernels
``memory_efficiency`` over bytes moved. Nothing here knows what a transformer is:
it prices :class:`simulator.model.Op` records by kind, FLOPs and bytes.

Cost classes: an op's kind (``gemm``, ``attention``, ``memory``) is its class,
and a pass over memory (the optimizer step) is ``memory``. ``speed`` makes a
class that many times faster — every op of the class, kernel overhead included,
takes its roofline time divided by the factor — which is how ``clustersim run
--what-if`` asks what bounds a step without touching the hardware profile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from simulator.hardware import Dtype, HardwareProfile


class CostedOp(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def flops(self) -> float: ...
    @property
    def bytes(self) -> float: ...
    @property
    def gemm_flops(self) -> float: ...


ComputeClass = Literal["gemm", "attention", "memory"]
#: The compute cost classes, in display order.
COMPUTE_CLASSES: tuple[ComputeClass, ...] = ("gemm", "attention", "memory")


@dataclass(frozen=True)
class CostModel:
    hw: HardwareProfile
    dtype: Dtype
    #: how many times faster than the profile each class runs (absent: 1, as profiled)
    speed: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.speed.items() if k not in COMPUTE_CLASSES or not v > 0}
        if bad:
            raise ValueError(f"speed factors {bad}: classes are {COMPUTE_CLASSES}, factors > 0")

    @property
    def peak(self) -> float:
        return self.hw.gpu.peak_flops(self.dtype)

    @property
    def hbm(self) -> float:
        return self.hw.gpu.hbm_bandwidth_GBps * 1e9

    def op_time(self, op: CostedOp) -> float:
        gpu = self.hw.gpu
        mem = op.bytes / (self.hbm * gpu.memory_efficiency(max(op.bytes, 1.0))) if op.bytes else 0.0
        if op.kind == "memory" or op.flops <= 0:
            compute = 0.0
        else:
            curve = gpu.attention_efficiency if op.kind == "attention" else gpu.gemm_efficiency
            compute = op.flops / (self.peak * curve(max(op.gemm_flops, 1.0)))
        seconds = max(compute, mem) + gpu.kernel_overhead_us * 1e-6
        return seconds / self.speed.get(op.kind, 1.0)

    def ops_time(self, ops: Iterable[CostedOp]) -> float:
        return sum(self.op_time(op) for op in ops)

    def memory_time(self, nbytes: float) -> float:
        """A bandwidth-bound pass over ``nbytes`` (e.g. the optimizer step)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.hbm * self.hw.gpu.memory_efficiency(nbytes)) \
            / self.speed.get("memory", 1.0)
