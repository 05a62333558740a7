"""The sections of a long run (``clustersim train``): failures, checkpoints, and the
energy and price of the GPU-hours.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from simulator.spec.base import Frozen


class ReliabilitySpec(Frozen):
    """Interruptions of a long run (``clustersim train``): hours between failures of
    one component, scaled by how many the cluster has (one interruption stops the
    whole synchronous job). A field left out takes the preset's rate."""

    preset: Literal["llama3", "none"] = "llama3"
    """Rates to start from: llama3 (Dubey et al. 2024, "The Llama 3 Herd of Models",
    Table 5: 466 interruptions in 54 days on 16,384 H100), or none (no interruptions
    unless a field below sets a rate)."""
    gpu_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    """Hours between failures of one GPU (faulty GPU, HBM, SRAM, system processor, ...);
    default the preset's."""
    host_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    """Hours between failures of one host (CPU, memory, SSD, power supply, unplanned
    maintenance, ...); default the preset's."""
    nic_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    """Hours between failures of one NIC; default the preset's."""
    switch_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    """Hours between failures of one NIC link's share of the fabric (cable, switch
    ports); default the preset's."""
    software_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    """Hours between software failures per host (bugs, dependencies, collective
    timeouts); default the preset's."""
    planned_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    """Hours between planned interruptions per host (upgrades): checkpoint, then
    restart; default the preset's."""
    restart_s: float = Field(default=600.0, ge=0, le=1e7)
    """Seconds from an interruption to training again, before the reload: detection,
    replacing the node, relaunching the job (an assumption: set your cluster's)."""


class CheckpointSpec(Frozen):
    """Checkpoints of a long run: where they go, how fast, and how often."""

    interval: Literal["auto", "young", "daly"] | float = "auto"
    """Seconds of training between checkpoints, or how to choose them: young (Young
    1974), daly (Daly 2006), auto (simulate a range of intervals, keep the best
    goodput)."""
    storage_write_GBps: float = Field(default=2000.0, ge=1e-3, le=1e9)
    """Aggregate write bandwidth from the job to storage, GB/s (1e9 bytes/s; Llama 3
    §3.3.1: Tectonic sustains 2 TB/s for 16K GPUs; scale it to your cluster)."""
    storage_read_GBps: float | None = Field(default=None, ge=1e-3, le=1e9)
    """Aggregate read bandwidth for the reload after a restart, GB/s; default the
    write bandwidth."""
    asynchronous: bool = False
    """false: training waits for the write to storage; true: it waits only for the
    copy to host memory (over PCIe), the write proceeds in the background."""

    @field_validator("interval", mode="before")
    @classmethod
    def _interval(cls, value: Any) -> Any:
        """One error line for the union (not one per member)."""
        if value in ("auto", "young", "daly"):
            return value
        if isinstance(value, bool) or not isinstance(value, float | int) \
                or not 1e-3 <= value <= 1e9:
            raise ValueError("must be auto, young, daly or seconds in [0.001, 1e9]")
        return float(value)


class CostSpec(Frozen):
    """Energy and money of a long run."""

    usd_per_gpu_hour: float = Field(default=2.0, ge=0, le=1e6)
    """Price of one GPU-hour, US dollars (an assumption: set your contract's price)."""
    pue: float = Field(default=1.1, ge=1, le=10)
    """Power usage effectiveness of the data centre: facility / IT energy (Google's
    fleet reported a trailing-twelve-month PUE of 1.10 for 2023)."""
    gpu_power_W: float | None = Field(default=None, ge=0, le=1e6)
    """Board power of one GPU under load, W; default the system's ``power.gpu_W``."""
    host_power_W: float | None = Field(default=None, ge=0, le=1e7)
    """Power of one node without its GPUs (CPUs, memory, NICs, fans), W; default the
    system's ``power.host_W``."""
