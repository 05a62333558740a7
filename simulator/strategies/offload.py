"""ZeRO-Offload (Ren et al. 2021) as a strategy: optimizer states and the step on the host.

Each gradient bucket's shard (1/dp of it under ZeRO ≥ 1) is copied to host
memory over PCIe on the ``host`` stream as soon as its reduction ends,
overlapping the rest of the backward. Once all of them are there, CPU Adam
updates the rank's shard (the profile's ``host.cpu_adam_params_per_s``, shared
by the node's GPUs), the updated 16-bit shard returns over PCIe, and the step
ends on the GPU when it has arrived; the data pass then all-gathers the
parameters over DP. The GPU runs no optimizer step. Installed with
``zero_offload``.

Memory: the optimizer states live in host memory, and with ZeRO-2/3 the gradient
shards too (each micro-batch's shard goes to the host). The closed form: CPU Adam on the
rank's shard, then the shard back over PCIe.
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass
from simulator.builder.tasks import Task
from simulator.errors import Problem
from simulator.model.inventory.ops import dtype_bytes
from simulator.spec.scenario import Scenario
from simulator.strategies.base import Strategy
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout


class OffloadPass(Pass):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.pcie = ctx.s.hardware.host.pcie_bandwidth_GBps * 1e9

    def bucket_reduced(self, rank: int, size: float, after: Task, chunk: int) -> None:
        par = self.ctx.s.parallel
        shard = size / par.shard if par.zero >= 1 else size
        d2h = self.ctx.add(rank, "host", op="offload.d2h", kind="offload",
                           name=f"offload.d2h grads {shard / 1e6:.1f} MB",
                           duration=shard / self.pcie, nbytes=shard, chunk=chunk)
        d2h.deps.append(after.id)

    def step(self, rank: int) -> None:
        ctx = self.ctx
        shard = ctx.params_of(rank) / ctx.s.parallel.dp
        dt_bytes = ctx.dt_bytes
        ctx.add(rank, "host", op="optimizer", kind="optimizer", name="cpu adam step",
                duration=shard * ctx.layout.gpus_per_node
                / ctx.s.hardware.host.cpu_adam_params_per_s)
        h2d = ctx.add(rank, "host", op="offload.h2d", kind="offload",
                      name="offload.h2d params", duration=shard * dt_bytes / self.pcie,
                      nbytes=shard * dt_bytes)
        # the step ends when the new parameters are back on the GPU (and gathered)
        wait = ctx.compute(rank, "optimizer", "optimizer", "wait for host step",
                           0.0, -1, -1, 0)
        wait.deps.append(h2d.id)


def cpu_adam_s(layout: Layout, hw: HardwareProfile, shard: float) -> float:
    """CPU Adam on a rank's ``shard`` of parameters, the node's GPUs sharing the host."""
    return shard * layout.gpus_per_node / hw.host.cpu_adam_params_per_s


def offload_step_s(s: Scenario, layout: Layout, hw: HardwareProfile, shard: float) -> float:
    """The optimizer step under ZeRO-Offload: CPU Adam, then the updated 16-bit shard back
    over PCIe."""
    return cpu_adam_s(layout, hw, shard) \
        + shard * dtype_bytes(s.training.dtype) / (hw.host.pcie_bandwidth_GBps * 1e9)


def offloaded(s: Scenario, gradients: float, optimizer: float) -> tuple[float, float]:
    """(gradients, optimizer) bytes left on the GPU: the states are on the host, and the
    gradient shards too under ZeRO-2/3."""
    if not s.parallel.zero_offload:
        return gradients, optimizer
    return (0.0 if s.parallel.zero >= 2 else gradients), 0.0


class Offload(Strategy):
    name = "offload"
    kinds = ("offload",)

    def active(self, s: Scenario) -> bool:
        return s.parallel.zero_offload

    def problems(self, s: Scenario) -> list[Problem]:
        if s.parallel.zero_offload and s.parallel.zero == 0:
            return [Problem("parallel.zero_offload", True,
                            "ZeRO-Offload shards the optimizer; set zero: 1, 2 or 3")]
        return []

    def make_pass(self, ctx: Context) -> Pass | None:
        return OffloadPass(ctx)


OFFLOAD = Offload()
