"""Cost model: seconds for an operation on a given hardware profile.

An op's device time is its roofline,
``max(flops·scale / (peak × eff(class, call FLOPs)), bytes / (hbm × eff_mem(class, bytes)))``,
plus the profile's per-kernel overhead for each of its kernels (an FP8 GEMM against the
fp8 peak, on ``gpu.fp8_gemm_efficiency`` where the profile has it); the efficiency curves
come from the profile (datasheet presets or calibration) per cost class, falling back
to ``gemm_efficiency`` / ``attention_efficiency`` / ``memory_efficiency`` where the
profile has no curve of its own for the class; a fused attention call is priced on its
kernel's curves by sequence length and head dimension where the profile has them
(:mod:`simulator.system.attention_kernels`); a GEMM whose shape the op carries keeps its
tile and wave quantisation's share of its curve where the profile lists the GPU's CTA
tiles (:mod:`simulator.system.gemm_shape`). A GPU's GEMM curve is read at the FLOPs a
bf16 GEMM of the same ideal duration would have, ``call FLOPs × peak_bf16 / peak`` (1 for
bf16 and fp16, a sixteenth-as-long fp32 SIMT GEMM reads the curve sixteen times further
on, an FP8 GEMM half as far): what a GEMM loses is its fixed time (launch, prologue,
the last wave) against its ideal one (:func:`curve_flops`). ``scale`` is the fraction of the counted
FLOPs the kernel executes (a causal flash kernel skips the masked half; its backward
recomputes the scores). A memory-bound kernel's compute side is its own arithmetic on
the CUDA cores where it has some worth counting (``Op.alu_flops``, e.g. PyTorch's exact
GeLU's erf) against the GPU's fp32 peak: ``max(alu / peak_fp32, bytes / (hbm × eff_mem))``.

Host-bound regime: a stream cannot issue kernels faster than the host prepares them,
so an op costs at least ``kernels × host_us`` (the stack's per-kernel host overhead,
0 under CUDA graphs, plus DTensor's dispatch per op on DTensors where the profile measured
it, ``gpu.dtensor_overhead_us``): ``time = max(device, kernels × host_us)``. On a CPU "device"
(``gpu.host_serial``) one thread runs both, so ``time = device + kernels × host_us``,
with the host cost measured on that CPU (``gpu.host_overhead_us``) when the profile
has it; the optimizer step's kernels (``gpu.host_optimizer_us``) and a GEMM's DTensor
dispatch (``gpu.dtensor_gemm_us``) use their own measured figures where the profile has
them.
Short kernels cost their launch time; long ones hide it.

Rank spread: ranks given the same work do not finish it together, and every
synchronisation of a step waits for the slowest. With a rank's compute time normal
with relative spread c (``gpu.rank_spread``, calibrated by
:mod:`calibration.microbench.rank_spread`), the slowest of n ranks takes ``1 + c · e_n``
times as long, e_n the expected maximum of n standard normals
(:func:`expected_max_normal`; Hoefler, Schneider and Lumsdaine, SC 2010, on noise
amplified by synchronisation); where the profile has a GPU population's measured
excess of the slowest of n (``gpu.rank_excess``: the A100 presets, from per-GPU GEMM
times on Perlmutter, whose slow tail is heavier than a normal's), ``1 + excess(n)``. A
step's cost model (``ranks``: its world) stretches every op by that factor: the wait at
each synchronisation grows with the compute before it. ``ranks = 1`` prices one rank
alone (``clustersim ops``).

Nothing here knows what a transformer is: it prices :class:`simulator.model.inventory.ops.Op`
records by kind, class, FLOPs, bytes and kernels. The kinds (``gemm``, ``attention``,
``memory``) are what ``speed`` addresses: it makes a kind that many times faster —
every op of the kind, overheads included, takes its time divided by the factor —
which is how ``clustersim run --what-if`` asks what bounds a step without touching
the hardware profile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Literal, Protocol

from simulator.system.attention_kernels import AttentionCall
from simulator.system.gemm_shape import GemmCall
from simulator.system.hardware import HardwareProfile
from simulator.system.units import Dtype


class CostedOp(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def cost_class(self) -> str: ...
    @property
    def kernels(self) -> int: ...
    @property
    def compute_scale(self) -> float: ...
    @property
    def flops(self) -> float: ...
    @property
    def bytes(self) -> float: ...
    @property
    def gemm_flops(self) -> float: ...
    @property
    def dtensor(self) -> int: ...
    @property
    def host_ops(self) -> int: ...
    @property
    def attn(self) -> AttentionCall | None: ...
    @property
    def precision(self) -> str: ...
    @property
    def gemm_call(self) -> GemmCall | None: ...
    @property
    def alu_flops(self) -> float: ...
    @property
    def synced(self) -> bool: ...


ComputeClass = Literal["gemm", "attention", "memory"]
#: The compute cost classes, in display order.
COMPUTE_CLASSES: tuple[ComputeClass, ...] = ("gemm", "attention", "memory")


def curve_flops(hw: HardwareProfile, cost_class: str, flops: float, peak: float,
                precision: str = "") -> float:
    """The FLOPs at which a GEMM of ``flops`` run at ``peak`` reads its GPU's GEMM curve:
    those of a bf16 GEMM of the same ideal duration, ``flops × peak_bf16 / peak``. The
    presets' and GPU calibration's curves are bf16 GEMMs', and what a small GEMM loses is
    time of its own (launch, prologue, the last wave) against its ideal duration: on a
    B200 an FP8 GEMM of F FLOPs reaches what a bf16 one of F / 2 does (XLA's published
    table, ``sm_100_B200``: 0.038, 0.074, 0.129 and 0.317 of the FP8 peak at 1.1e9, 2.1e9,
    4.3e9 and 1.7e10 FLOPs against the bf16 curve's 0.040, 0.073, 0.128 and 0.317 at half
    of them), and on an A100 an fp32 GEMM of 256^3 takes 16 us where the bf16 one takes
    10 (triton-lang/triton#2491, #7085). Unchanged: a CPU "device" (its curves are its own
    fp32 kernels'), a profile without a bf16 peak, an FP8 GEMM on the profile's own
    ``fp8_gemm_efficiency``, and every class but the GEMMs'."""
    gpu = hw.gpu
    if gpu.host_serial or not cost_class.startswith("gemm_") or "bf16" not in gpu.peak_tflops \
            or (precision == "fp8" and gpu.fp8_gemm_efficiency is not None):
        return flops
    return flops * gpu.peak_flops("bf16") / peak


@dataclass(frozen=True)
class CostModel:
    hw: HardwareProfile
    dtype: Dtype
    #: how many times faster than the profile each class runs (absent: 1, as profiled)
    speed: Mapping[str, float] = field(default_factory=dict)
    #: host time to issue one kernel (the stack's ``host_us``): an op costs at least that
    host_us: float = 0.0
    #: ranks whose synchronisations the step waits on (its world; 1: one rank alone)
    ranks: int = 1

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.speed.items() if k not in COMPUTE_CLASSES or not v > 0}
        if bad:
            raise ValueError(f"speed factors {bad}: classes are {COMPUTE_CLASSES}, factors > 0")

    @cached_property
    def rank_stretch(self) -> float:
        """How many times longer the slowest of :attr:`ranks` takes the same compute:
        ``1 + gpu.rank_excess(n)`` where the profile has a population's curve, else
        ``1 + gpu.rank_spread · e_n`` (1 for one rank or no spread)."""
        gpu, n, term = self.hw.gpu, self.ranks, self.rank_term
        if n <= 1 or term is None:
            return 1.0
        if term == "rank_excess":
            assert gpu.rank_excess is not None
            return 1.0 + gpu.rank_excess(n)
        return 1.0 + gpu.rank_spread * expected_max_normal(n)

    @property
    def rank_term(self) -> str | None:
        """The profile's term the rank stretch reads: a population's curve
        (``rank_excess``) before a spread (``rank_spread``), else none."""
        gpu = self.hw.gpu
        return "rank_excess" if gpu.rank_excess is not None else \
            "rank_spread" if gpu.rank_spread else None

    @property
    def peak(self) -> float:
        return self.hw.gpu.peak_flops(self.dtype)

    @property
    def hbm(self) -> float:
        return self.hw.gpu.hbm_bandwidth_GBps * 1e9

    def op_parts(self, op: CostedOp) -> tuple[float, float, float, float]:
        """(compute, memory, device overhead, host) seconds of one op, before ``speed``."""
        gpu, cls = self.hw.gpu, op.cost_class
        mem = op.bytes / (self.hbm * gpu.efficiency(_memory_class(cls), max(op.bytes, 1.0))) \
            if op.bytes else 0.0
        if op.kind == "memory" or op.flops <= 0:
            compute = self.alu_time(op.alu_flops)
        else:
            peak = gpu.peak_flops("fp8") if op.precision == "fp8" else self.peak
            size = curve_flops(self.hw, cls, op.gemm_flops, peak, op.precision)
            eff = gpu.efficiency(cls, max(size, 1.0), op.attn, op.precision, op.gemm_call)
            compute = op.flops * op.compute_scale / (peak * eff)
        host_us = self.host_us
        step = cls == "optimizer"  # the optimizer's figures where measured apart
        measured = gpu.host_optimizer_us if step and gpu.host_optimizer_us is not None \
            else gpu.host_overhead_us
        if measured is not None and host_us > 0:  # measured on this device
            host_us = measured
        # DTensor's dispatch on the host, measured on this device (none under CUDA graphs)
        dt_us = gpu.dtensor_gemm_us if cls.startswith("gemm") and \
            gpu.dtensor_gemm_us is not None else gpu.dtensor_overhead_us
        host_us_dt = op.dtensor * (dt_us or 0.0) if host_us > 0 else 0.0
        return (compute, mem, op.kernels * gpu.kernel_overhead_us * 1e-6,
                (op.host_ops * host_us + host_us_dt) * 1e-6)

    def alu_time(self, alu_flops: float) -> float:
        """Seconds of a memory-bound kernel's own arithmetic on the CUDA cores
        (``Op.alu_flops``) at the GPU's fp32 peak: its compute floor. 0 without such
        arithmetic, on a profile without an fp32 peak, and on a CPU "device" (the count is
        a CUDA kernel's; a CPU profile's curves measured its own kernels whole)."""
        gpu = self.hw.gpu
        if alu_flops <= 0 or gpu.host_serial or "fp32" not in gpu.peak_tflops:
            return 0.0
        return alu_flops / gpu.peak_flops("fp32")

    def op_time(self, op: CostedOp) -> float:
        compute, mem, overhead, host = self.op_parts(op)
        if self.hw.gpu.host_serial or op.synced:  # one thread runs the framework and the
            seconds = max(compute, mem) + overhead + host  # kernels, or the host waits for them
        else:
            seconds = max(max(compute, mem) + overhead, host)
        return seconds * self.rank_stretch / self.speed.get(op.kind, 1.0)

    def bound(self, op: CostedOp) -> str:
        """What sets the op's time: compute, memory, or overhead (launch or host)."""
        compute, mem, overhead, host = self.op_parts(op)
        if host > max(compute, mem) + overhead or overhead > max(compute, mem):
            return "overhead"  # (a synced op's host and device add; the larger names it)
        return "compute" if compute >= mem else "memory"

    def ops_time(self, ops: Iterable[CostedOp]) -> float:
        """Seconds of ``ops`` run in order on one stream. On a GPU the host issues kernels
        ahead of the device (CUDA's launch queue): op i ends no sooner than op i−1's end
        plus its device time, nor than the host's issue time up to and including it,
        ``end_i = max(end_{i−1} + device_i, Σ_{j≤i} host_j)``. So host time banks behind
        long kernels and only a run of short ones waits for the host; one op alone is
        :meth:`op_time`'s ``max(device, host)``. A ``synced`` op's host first waits for the
        device (a read-back), then issues, then the device runs it. On a CPU "device"
        (``host_serial``) everything adds."""
        if self.hw.gpu.host_serial:
            return sum(self.op_time(op) for op in ops)
        end = issued = 0.0
        for op in ops:
            compute, mem, overhead, host = self.op_parts(op)
            scale = self.rank_stretch / self.speed.get(op.kind, 1.0)
            if op.synced:  # the host waits for the device, then issues, then the device runs
                issued = max(issued, end) + host * scale
                end = issued + (max(compute, mem) + overhead) * scale
                continue
            issued += host * scale
            end = max(end + (max(compute, mem) + overhead) * scale, issued)
        return end

    def pipeline_action_s(self, runtime: str) -> float:
        """Host seconds a pipeline runtime spends per F or B action beyond its kernels and
        sends: the profile's ``gpu.pipeline_action_us`` under ``torch.distributed.pipelining``
        (``runtime == "torch"``) where the stack has a per-kernel host cost, else 0."""
        return self._host_term(self.hw.gpu.pipeline_action_us, runtime == "torch")

    def funcol_s(self, dtensor: bool, link_class: str = "intra_node",
                 kind: str = "all_reduce", nbytes: float = 0.0) -> float:
        """Seconds a functional collective (one of DTensor's redistributions) of ``kind``
        and ``nbytes`` costs the issuing thread beyond a plain c10d one, under a DTensor
        stack with a per-kernel host cost (else 0): the profile's ``gpu.funcol_host``
        line of that kind where calibration measured it (on two ranks, by kind), else a
        profile's older ``gpu.funcol_sync_us`` of the group's link class, else the
        one-rank host figure ``gpu.funcol_overhead_us``."""
        line = self.hw.gpu.funcol_host.get(kind)  # type: ignore[call-overload]
        if line is not None:
            return line.seconds(nbytes) if dtensor and self.host_us > 0 else 0.0
        pair = self.hw.gpu.funcol_sync_us.get(link_class)  # type: ignore[call-overload]
        return self._host_term(self.hw.gpu.funcol_overhead_us if pair is None else pair,
                               dtensor)

    def _host_term(self, us: float | None, applies: bool) -> float:
        """Seconds of a measured host term where it applies and the stack issues kernels
        from the host (a per-kernel host cost: none under CUDA graphs)."""
        return us * 1e-6 if applies and us and self.host_us > 0 else 0.0

    def memory_time(self, nbytes: float) -> float:
        """A bandwidth-bound pass over ``nbytes`` (e.g. the optimizer step)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.hbm * self.hw.gpu.memory_efficiency(nbytes)) \
            * self.rank_stretch / self.speed.get("memory", 1.0)


@lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n ≤ 1; 1/√π for 2, 3/(2√π) for
    3): ∫ x · n φ(x) Φ(x)^(n−1) dx by the trapezoid rule on [−12, 12], step 10⁻² (for an
    integrand this smooth that vanishes at both ends the rule converges exponentially:
    the closed forms agree to 1e-15), with Φ^(n−1) taken through logarithms so that it
    holds for millions of ranks."""
    if n <= 1:
        return 0.0
    import numpy as np

    x = np.linspace(-12.0, 12.0, 2401)
    # log Φ(x): from Φ itself below 0, from 1 − Φ above (each side's accurate tail)
    log_cdf = np.array([math.log(0.5 * math.erfc(-v / math.sqrt(2.0))) if v < 0
                        else math.log1p(-0.5 * math.erfc(v / math.sqrt(2.0))) for v in x])
    density = n * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) * np.exp((n - 1) * log_cdf)
    y = x * density
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2.0)


def _memory_class(cls: str) -> str:
    """The curve a class's bytes are priced on: its own for memory-bound classes, the
    plain memory curve for the operands of GEMM and attention kernels."""
    return "elementwise" if cls.startswith(("gemm", "attention")) else cls
