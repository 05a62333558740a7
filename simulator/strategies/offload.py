"""ZeRO-Offload pass (Ren et al. 2021): optimizer states and the step on the host.

Each gradient bucket's shard (1/dp of it under ZeRO ≥ 1) is copied to host
memory over PCIe on the ``host`` stream as soon as its reduction ends,
overlapping the rest of the backward. Once all of them are there, CPU Adam
updates the rank's shard (the profile's ``host.cpu_adam_params_per_s``, shared
by the node's GPUs), the updated 16-bit shard returns over PCIe, and the step
ends on the GPU when it has arrived; the data pass then all-gathers the
parameters over DP. The GPU runs no optimizer step. Installed with
``zero_offload``.
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass
from simulator.builder.tasks import Task


class OffloadPass(Pass):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.pcie = ctx.s.hardware.host.pcie_bandwidth_GBps * 1e9

    def bucket_reduced(self, rank: int, size: float, after: Task, chunk: int) -> None:
        par = self.ctx.s.parallel
        shard = size / (par.dp * par.cp) if par.zero >= 1 else size
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
