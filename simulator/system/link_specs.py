"""The links, host and power of a hardware profile, and a calibrated collective's
α-β cost: the plain records :class:`simulator.system.hardware.HardwareProfile` holds
beside its GPU (every field's source in the system presets' comments)."""

from __future__ import annotations

from pydantic import Field

from simulator.system.units import RATE, TIME_US, Frozen


class LinkSpec(Frozen):
    bandwidth_GBps: float = RATE  # per GPU, per direction, line rate
    latency_us: float = TIME_US  # α: per algorithm step
    efficiency: float = Field(default=1.0, gt=1e-4, le=1)  # achieved busbw / line rate

    @property
    def bytes_per_s(self) -> float:
        """Achievable bandwidth in bytes/s (line rate × efficiency)."""
        return self.bandwidth_GBps * 1e9 * self.efficiency

    @property
    def alpha_s(self) -> float:
        return self.latency_us * 1e-6


class IntraNodeSpec(LinkSpec):
    # NVLink SHARP: the NVSwitch (third generation, H100/H200/H800 HGX) reduces and
    # multicasts, which NCCL's NVLS algorithm uses (simulator/system/nccl.py); optional in a
    # profile file, absent = false
    nvls: bool = False


class InterNodeSpec(LinkSpec):
    nics_per_node: int = Field(gt=0, le=10_000)
    nic_Gbps: float = RATE  # line rate of one NIC, gigabits/s
    oversubscription: float = Field(default=1.0, ge=1, le=1e4)  # fat-tree taper (1 = none)


class HostSpec(Frozen):
    pcie_bandwidth_GBps: float = RATE  # per GPU, per direction (host <-> device)
    cpu_adam_params_per_s: float = Field(ge=1, le=1e16)  # CPU AdamW parameters/s of a host


class PowerSpec(Frozen):
    """Electrical power under training load (energy of ``clustersim train``)."""

    gpu_W: float = Field(ge=0, le=1e6)  # board power of one GPU at its power limit, W
    host_W: float = Field(ge=0, le=1e7)  # one node without its GPUs (CPUs, NICs, fans), W


class AlphaBeta(Frozen):
    """A calibrated collective cost: t(S) = alpha + S / busbw × (algorithm factor)."""

    alpha_us: float = TIME_US
    busbw_GBps: float = RATE
    samples: int = Field(default=0, ge=0)
    median_rel_error: float | None = Field(default=None, ge=0)
