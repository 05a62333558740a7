"""Compressed gradient reductions: the tasks of
:mod:`simulator.strategies.compression.arithmetic`'s methods.

The data pass hands each full gradient bucket to :meth:`Compressor.reduce` instead
of reducing it itself, and calls :meth:`Compressor.exchange` before the optimizer
step. All tasks of one bucket sit on the data pass's stream (``dp`` with
``overlap.dp``, else the compute stream), one after the other, as the hook chains
them:

- PowerSGD: the hook's first kernels (error feedback, P = M·Q), the all-reduce of
  the uncompressed tensors, of P, the kernels between (orthogonalise P, Q = Mᵀ·P),
  the all-reduce of Q, the decompression. On the ``dp`` stream the hook's kernels
  overlap the backward freely; on a GPU they share its SMs, so the overlap is an
  optimistic bound by at most their time (``compression_compute_s`` in the results).
- bf16 / fp8: the cast, the reduction of the smaller bucket, the cast back.
- 1-bit Adam: no reduction during the backward; before the optimizer step, on the
  compute stream, the worker's compression, the sign all-to-all and the scale
  all-gather, the server's compression, the two all-gathers, the unpacking.

Compression compute is ``optimizer`` work (kind ``optimizer``), priced in fp32 by
the scenario's cost model (its ``--what-if`` speed factors included).
"""

from __future__ import annotations

from dataclasses import replace

from simulator.builder.context import Context
from simulator.builder.tasks import Stream, Task
from simulator.model.inventory.ops import Op
from simulator.strategies.compression import arithmetic as cmp
from simulator.system.units import CollectiveName

Unit = tuple[int, int]  # (stage, index of the unit among the stage's gradient units)


class Compressor:
    def __init__(self, ctx: Context, stream: Stream) -> None:
        self.ctx, self.stream = ctx, stream
        self.method = cmp.effective_method(ctx.s)
        self.g = cmp.spec_of(ctx.s)
        self.cost = replace(ctx.cost, dtype="fp32")
        self.shapes: dict[int, list[list[tuple[int, int]]]] = {}

    @property
    def in_backward(self) -> bool:
        """Whether gradients are reduced bucket by bucket during the backward."""
        return self.method != "onebit_adam"

    def _unit(self, stage: int, index: int) -> list[tuple[int, int]]:
        units = self.shapes.get(stage)
        if units is None:
            ctx = self.ctx
            units = cmp.unit_shapes(ctx.s.model, len(ctx.layers_of(stage)),
                                    ctx.sched.is_first(stage), ctx.sched.is_last(stage),
                                    ctx.tied_copy_params() > 0)
            self.shapes[stage] = units
        return units[index]

    def _compute(self, rank: int, stream: Stream, name: str, ops: list[Op], after: Task | None,
                 chunk: int) -> Task:
        t = self.ctx.add(rank, stream, op=name, kind="optimizer", name=name,
                         duration=self.cost.ops_time(ops), chunk=chunk)
        if after is not None:
            t.deps.append(after.id)
        return t

    def _collective(self, rank: int, stream: Stream, op: CollectiveName, size: float,
                    name: str, after: Task, chunk: int) -> Task:
        ctx = self.ctx
        t = ctx.collective(rank, stream, op, "dp", ctx.layout.dp_group(rank), size, name,
                           chunk=chunk)
        if t is None:
            return after
        t.deps.append(after.id)
        return t

    def reduce(self, rank: int, op: CollectiveName, size: float, units: list[Unit],
               after: Task, chunk: int) -> Task:
        """One full bucket of ``size`` bytes: the method's tasks; returns the last."""
        if self.method == "powersgd":
            return self._powersgd(rank, units, after, chunk)
        wire = cmp.WIRE_BYTES[self.method]
        dt, s = self.ctx.grad_dt, self.stream
        down, up = cmp.cast_ops(size / dt, dt, wire)
        t = self._compute(rank, s, f"{self.method}.cast", down, after, chunk)
        t = self._collective(rank, s, op, size * wire / dt,
                             f"dp.{op} bucket {size / 1e6:.1f} MB as {self.method}", t, chunk)
        return self._compute(rank, s, f"{self.method}.uncast", up, t, chunk)

    def _powersgd(self, rank: int, units: list[Unit], after: Task, chunk: int) -> Task:
        shapes = [shape for stage, i in units for shape in self._unit(stage, i)]
        b = cmp.powersgd_bucket(shapes, cmp.rank_of(self.g), cmp.min_rate(self.g))
        first, second, third = cmp.powersgd_phases(b)
        s, w = self.stream, cmp.HOOK_BYTES
        t = self._compute(rank, s, "powersgd.compress_p", first, after, chunk)
        for what, elements in (("uncompressed", b.uncompressed), ("P", b.p)):
            t = self._collective(rank, s, "all_reduce", w * elements,
                                 f"powersgd.all_reduce {what} {w * elements / 1e6:.2f} MB", t,
                                 chunk)
        t = self._compute(rank, s, "powersgd.compress_q", second, t, chunk)
        t = self._collective(rank, s, "all_reduce", w * b.q,
                             f"powersgd.all_reduce Q {w * b.q / 1e6:.2f} MB", t, chunk)
        return self._compute(rank, s, "powersgd.decompress", third, t, chunk)

    def exchange(self, rank: int) -> None:
        """1-bit Adam's compressed momentum all-reduce, before the optimizer step."""
        if self.method != "onebit_adam":
            return
        ctx = self.ctx
        n = ctx.s.parallel.dp
        elements = ctx.params_of(rank)
        worker, server, final = cmp.onebit_ops(elements, n)
        colls = cmp.onebit_collectives(elements, n)
        last = ctx.programs[rank].streams["compute"][-1]
        t = self._compute(rank, "compute", "onebit.worker_compress", worker, last, 0)
        for phase, ops in (("worker", server), ("server", final)):
            for _, op, size in (c for c in colls if c[0] == phase):
                t = self._collective(rank, "compute", op, size,
                                     f"onebit.{op} {phase} {size / 1e6:.2f} MB", t, 0)
            name = "onebit.server_compress" if phase == "worker" else "onebit.unpack"
            t = self._compute(rank, "compute", name, ops, t, 0)
