"""Cost model: seconds for an operation on a given hardware profile.

Compute ops are rooflined: ``max(flops / (peak × eff(size)), bytes / (hbm × eff(bytes)))``
plus a fixed per-kernel overhead, where the efficiency curves come from the
profile (datasheet presets or calibration) — GEMMs use ``gemm_efficiency`` over
the FLOPs of the single GEMM call, attention its own curve, memory-bound kernels
``memory_efficiency`` over bytes moved. Nothing here knows what a transformer is:
it prices :class:`simulator.model.Op` records by kind, FLOPs and bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

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


@dataclass(frozen=True)
class CostModel:
    hw: HardwareProfile
    dtype: Dtype

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
        return max(compute, mem) + gpu.kernel_overhead_us * 1e-6

    def ops_time(self, ops: Iterable[CostedOp]) -> float:
        return sum(self.op_time(op) for op in ops)

    def memory_time(self, nbytes: float) -> float:
        """A bandwidth-bound pass over ``nbytes`` (e.g. the optimizer step)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.hbm * self.hw.gpu.memory_efficiency(nbytes))
