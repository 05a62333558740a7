"""The scenario's cluster section: how many nodes of which system, and the overrides of
the system's numbers (:class:`ClusterSpec`); :func:`effective_hardware` applies them.
Re-exported by :mod:`simulator.spec.scenario`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from simulator.errors import Problem, UserError
from simulator.spec.base import MAX_SIZE, Frozen
from simulator.system.hardware import HardwareProfile
from simulator.system.profiles import load_system


class ClusterSpec(Frozen):
    """How many nodes of which system; optional overrides of the system's numbers."""

    system: str
    """A system preset name (``clustersim presets``) or the path of a hardware-profile
    YAML (``clustersim calibrate`` writes one)."""
    nodes: int = Field(gt=0, le=MAX_SIZE)
    """Nodes in the cluster."""
    gpus_per_node: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    """GPUs per node; default the system's."""
    intra_node_bandwidth_GBps: float | None = Field(default=None, ge=1e-3, le=1e12)
    """NVLink/NVSwitch bandwidth per GPU, per direction, GB/s (1e9 bytes/s); default
    the system's."""
    inter_node_bandwidth_GBps: float | None = Field(default=None, ge=1e-3, le=1e12)
    """Network bandwidth per GPU (its NIC), per direction, GB/s; default the system's."""
    link_latency_us: float | None = Field(default=None, ge=0, le=1e7)
    """Latency α per algorithm step of both link classes, µs; default the system's."""
    oversubscription: float | None = Field(default=None, ge=1, le=1e4)
    """Fat-tree core taper (1 = non-blocking); default the system's."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_system(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("system"), str):
            return data
        try:
            hw = load_system(data["system"])
        except UserError:
            return data  # _check_system reports it against cluster.system
        if data.get("gpus_per_node") is None:  # absent or null: the system's
            return {**data, "gpus_per_node": hw.gpus_per_node}
        return data

    @field_validator("system")
    @classmethod
    def _check_system(cls, name: str) -> str:
        try:
            load_system(name)
        except UserError as exc:
            first = exc.problems[0]
            raise ValueError(first.fix if isinstance(first, Problem) else first) from None
        return name

    @property
    def gpus(self) -> int:
        assert self.gpus_per_node is not None
        return self.nodes * self.gpus_per_node


def effective_hardware(cluster: ClusterSpec) -> HardwareProfile:
    hw = load_system(cluster.system)
    intra, inter = hw.intra_node, hw.inter_node
    if cluster.intra_node_bandwidth_GBps is not None:
        intra = intra.model_copy(update={"bandwidth_GBps": cluster.intra_node_bandwidth_GBps})
    if cluster.inter_node_bandwidth_GBps is not None:
        inter = inter.model_copy(update={"bandwidth_GBps": cluster.inter_node_bandwidth_GBps})
    if cluster.link_latency_us is not None:
        intra = intra.model_copy(update={"latency_us": cluster.link_latency_us})
        inter = inter.model_copy(update={"latency_us": cluster.link_latency_us})
    if cluster.oversubscription is not None:
        inter = inter.model_copy(update={"oversubscription": cluster.oversubscription})
    return hw.model_copy(update={"gpus_per_node": cluster.gpus_per_node,
                                 "intra_node": intra, "inter_node": inter})
