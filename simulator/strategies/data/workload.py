"""Data-parallel pass: gradient synchronisation, ZeRO sharding and the optimizer step.

DDP (Li et al. 2020): gradients are bucketed (``dp_bucket_MB``; the stack's
``ddp_first_bucket_MB`` for the first bucket of a backward, as torch DDP does) in the
order the last micro-batch's backward produces them, each bucket all-reduced on the
``dp`` stream as soon as it is full (on the compute stream without
``overlap.dp``); the optimizer step waits for all of them. Gradients
accumulate locally over the other micro-batches.

ZeRO (Rajbhandari et al. 2020): stages 1 and 2 reduce-scatter the buckets
instead (ZeRO-1 may all-reduce; Megatron's distributed optimizer scatters) and
all-gather the updated parameters after the step, 2Ψ per rank like DDP's
all-reduce. ZeRO-2 and ZeRO-3 keep only a gradient shard, so they
reduce-scatter after *every* micro-batch's backward (DeepSpeed's and FSDP's
behaviour under gradient accumulation: m × the traffic of one reduction).
ZeRO-3 / FSDP reduce-scatters each unit (layer) as its gradients complete;
:class:`Zero3Pass` gathers the units' parameters. Under hybrid sharding (HSDP,
``parallel.dp_shard``) the reduce-scatter runs over the unit's shard group and its
1/shard output is then all-reduced across the replicate group on a ``replicate`` stream
of its own that waits for the reduce-scatter (FSDP1 ``_runtime_utils._reduce_grad``
and FSDP2 ``foreach_reduce``: an all-reduce stream that waits for the reduce-scatter
stream), so the next unit's reduce-scatter may run beside it; in line on the compute
stream without ``overlap.dp``. The parameters outside the
layers (embedding, final norm, output layer: :meth:`Context.root_params`) are
sharded too, as FSDP2's root unit (``fully_shard`` on the stage's module): their
gradients are reduce-scattered as one more unit after the micro-batch's
backward (FSDP2's root post-backward callback), and nothing is gathered after
the step.

The optimizer step (AdamW on the rank's shard as the stack runs it:
:func:`simulator.model.inventory.optimizer.optimizer_op`, clipping included) runs on the compute
stream after every reduction; under ZeRO-Offload the offload pass runs it on the host instead.
Clipping ZeRO-3's gradient shards first all-reduces the norm over the shard group, on the
compute stream before the step (:mod:`simulator.strategies.data.grad_norm`).
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass, part_label
from simulator.builder.tasks import Stream, Task
from simulator.model import transformer as mdl
from simulator.model.inventory.layer import layer_tensors
from simulator.model.inventory.ops import Op
from simulator.model.inventory.sharding import (
    ROOT_TENSORS,
    ddp_copy_ops,
    fsdp_reduce_parts,
    fsdp_task_name,
)
from simulator.schedules.action import Action
from simulator.strategies.compression.arithmetic import bucket_caps, effective_method
from simulator.strategies.compression.workload import Compressor, Unit
from simulator.strategies.data.grad_norm import GRAD_NORM_BYTES, grad_norm_reduced
from simulator.strategies.zero3.deferred import accumulate_after, deferred
from simulator.strategies.zero3.experts import dense_unit
from simulator.system.units import CollectiveName


class DataPass(Pass):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        par = ctx.s.parallel
        self.pending: dict[int, list[tuple[float, Task, Unit]]] = {r: [] for r in ctx.ranks}
        self.caps = bucket_caps(ctx.s)  # (the first bucket's of a backward, the others')
        self.flushed: dict[int, bool] = dict.fromkeys(ctx.ranks, False)  # in this backward
        self.last: dict[int, bool] = dict.fromkeys(ctx.ranks, True)  # the stage's last backward
        self.issued: dict[int, list[Task]] = {r: [] for r in ctx.ranks}  # this backward's
        self.reduce: CollectiveName = "all_reduce" if par.zero == 0 else "reduce_scatter"
        self.stream: Stream = "dp" if ctx.overlap.dp else "compute"
        # gradient compression (training.gradient_compression) reduces the buckets instead
        self.compressor = Compressor(ctx, self.stream) \
            if effective_method(ctx.s) != "none" else None
        self.deferred = deferred(ctx.s)  # reductions at each stage's last backward only
        self.backwards: set[tuple[int, int]] = set()  # (rank, stage) that ran a backward
        self.copied: dict[int, Task] = {}  # the last FSDP copy a deferred reduction placed

    def weight_grads(self, rank: int, index: int, action: Action, done: list[Task],
                     chunk: int) -> None:
        par, pending = self.ctx.s.parallel, self.pending[rank]
        if par.dp * par.cp == 1 and not par.zero_offload:  # no replica holds these weights
            return
        if self.compressor is not None and not self.compressor.in_backward:
            return  # 1-bit Adam exchanges the momentum in the optimizer step instead
        self.flushed[rank] = False  # a backward's buckets start with the first one's cap
        self.last[rank] = self.ctx.last_backward(self.ctx.layout.coord(rank).pp) \
            .get(action.stage) == index  # both memoised (Context, Layout.coord)
        if self.deferred:
            self.deferred_grads(rank, action, done, chunk, pending)
        elif par.zero >= 2:  # sharded gradients: reduce after every micro-batch
            self.issued[rank] = []
            self.bucket(rank, action.stage, done, chunk, pending)
            self.flush(rank, pending, chunk)
            if par.zero == 3:
                self.reduce_wait(rank, action, chunk)
        elif self.last[rank]:  # accumulated: reduce once
            self.bucket(rank, action.stage, done, chunk, pending)

    def deferred_grads(self, rank: int, action: Action, done: list[Task], chunk: int,
                       pending: list[tuple[float, Task, Unit]]) -> None:
        """ZeRO-3 under ``torch.distributed.pipelining``
        (:mod:`simulator.strategies.zero3.deferred`): each backward accumulates the
        units' unsharded gradients (a kernel per unit on the compute stream as its
        gradients complete); after the stage's last backward every unit is
        reduce-scattered, the root first, then the blocks in order (``REDUCE_GRAD``'s
        ``post_backward`` calls), and the compute stream waits for them."""
        ctx, key = self.ctx, (rank, action.stage)
        fresh = key not in self.backwards
        self.backwards.add(key)
        units = list(enumerate(self.zero3_units(action.stage, done)))
        for _, (size, task) in units:
            accumulate_after(ctx, rank, task, size / ctx.grad_dt, fresh, action.microbatch)
        if not self.last[rank] or not done:
            return
        self.issued[rank] = []
        ids = ctx.layers_of(action.stage)
        layers = len(ids)
        self.copied[rank] = done[-1]
        for i, (size, _) in [u for u in units if u[0] >= layers] \
                + [u for u in reversed(units) if u[0] < layers]:  # the root, then blocks
            pending.append((size, self.copied[rank], (action.stage, i)))
            start = len(ctx.tasks)
            self.flush(rank, pending, chunk)
            for t in ctx.tasks[start:]:  # each block's by its layer (the memory timeline's)
                if t.kind == "dp" and i < layers:
                    t.layer = ids[layers - 1 - i]
        self.reduce_wait(rank, action, chunk)

    def bucket(self, rank: int, stage: int, done: list[Task], chunk: int,
               pending: list[tuple[float, Task, Unit]]) -> None:
        """Bucket the gradients that ``done`` complete, flushing full buckets."""
        par = self.ctx.s.parallel
        if par.zero == 3:  # FSDP reduce-scatters each unit's gradients
            for i, (size, task) in enumerate(self.zero3_units(stage, done)):
                pending.append((size, task, (stage, i)))
                self.flush(rank, pending, chunk)
            return
        for i, (size, task) in enumerate(zip(self.ctx.grad_bytes(stage), done, strict=True)):
            pending.append((size, task, (stage, i)))
            if sum(p[0] for p in pending) >= self.caps[self.flushed[rank]]:
                self.flush(rank, pending, chunk)
                self.flushed[rank] = True

    def zero3_units(self, stage: int, done: list[Task]) -> list[tuple[float, Task]]:
        """ZeRO-3's gradient units of a backward of ``stage`` with the task each waits for:
        every layer as its gradients complete, then the root (embedding, head) after the
        backward's last gradient, as FSDP2's root post-backward reduce-scatters it."""
        ctx = self.ctx
        layers = len(ctx.layers_of(stage))
        if ctx.s.model.is_moe:  # each layer's dense unit, in the backward's order (its
            # routed experts reduce over edp: simulator.strategies.expert.workload)
            ids = reversed(ctx.layers_of(stage))
            units = [(dense_unit(ctx.s, i) * ctx.grad_dt, task)
                     for i, task in zip(ids, done[:layers], strict=False)]
        else:
            layer = mdl.layer_params(ctx.s.model) / ctx.s.parallel.tp * ctx.grad_dt
            units = [(layer, task) for task in done[:layers]]
        root = ctx.root_params(stage) * ctx.grad_dt
        if root and done:
            units.append((root, done[-1]))
        return units

    def flush(self, rank: int, pending: list[tuple[float, Task, Unit]], chunk: int) -> None:
        if not pending:
            return
        size, after = sum(p[0] for p in pending), pending[-1][1]
        units = [p[2] for p in pending]
        pending.clear()
        ctx, op = self.ctx, self.reduce
        t: Task | None
        if ctx.s.parallel.zero == 0 and len(ctx.layout.dp_group(rank)) > 1:
            after = self.ddp_pack(rank, units, after)
        if self.compressor is not None and len(ctx.layout.dp_group(rank)) > 1:
            t = self.compressor.reduce(rank, op, size, units, after, chunk)
        else:
            stage, index = units[0]
            zero3 = ctx.s.parallel.zero == 3
            root = zero3 and index >= len(ctx.layers_of(stage))  # its root
            parts = ctx.zero3_parts if zero3 and not root else 1
            group = ctx.layout.shard_group(rank) if zero3 else ctx.layout.dp_group(rank)
            pack, pre, accumulate = self.fsdp_copies(rank, size, root, after) \
                if zero3 and len(group) > 1 else (None, None, ())
            # the unit's last gradient first: the post-backward hook's issue point, which
            # the communicator's order reads (simulator.strategies.zero3.communicator)
            waits = [after.id] + [k.id for k in (pack, pre) if k is not None]
            for part in range(parts):
                t = ctx.collective(rank, self.stream, op, "dp", group,
                                   size / parts, f"dp.{op} {'root' if root else 'bucket'} "
                                   f"{size / 1e6:.1f} MB{part_label(part, parts)}",
                                   after.microbatch if root else -1, chunk=chunk)
                if t is not None and part == 0:
                    t.deps.extend(waits)
                if zero3:
                    t = self.replicate(rank, size / parts, group, t, chunk)
            if accumulate and t is not None:
                t = ctx.add(rank, self.stream, op="Z", kind="optimizer",
                            name=f"fsdp.{fsdp_task_name(accumulate)} mb{after.microbatch}",
                            duration=ctx.cost_of(rank).ops_time(accumulate),
                            microbatch=after.microbatch, chunk=chunk)
            if t is not None:
                self.issued[rank].append(t)
        for bucket_reduced in ctx.hooks.bucket_reduced:
            bucket_reduced(rank, size, t or after, chunk)

    def reduce_wait(self, rank: int, action: Action, chunk: int) -> None:
        """ZeRO-3: the compute stream waits for the backward's reductions before anything
        after the backward runs: FSDP1's root post-backward callback
        (torch/distributed/fsdp/_runtime_utils.py ``_post_backward_final_callback``:
        ``current_stream.wait_stream(root_state._post_backward_stream)``, and the
        all-reduce stream's under hybrid sharding), FSDP2's ``finalize_backward``
        (_fsdp_param_group.py ``_wait_for_post_backward``: ``wait_event(
        self._post_reduce_event)``), DeepSpeed's ZeRO-3 epilogue (runtime/zero/stage3.py
        ``independent_gradient_partition_epilogue``: ``reduce_and_partition_stream.
        synchronize()``); after every micro-batch's backward, each reducing. A zero-second
        compute task that waits for the last reduction on each stream."""
        issued = self.issued[rank]
        if self.stream == "compute" or not issued:  # in line: nothing to wait for
            return
        last = {t.stream: t.id for t in issued}
        w = self.ctx.compute(rank, "Z", "backward", f"zero3.reduce_wait mb{action.microbatch}",
                             0.0, action.microbatch, -1, chunk)
        w.deps.extend(last.values())

    def replicate(self, rank: int, size: float, shard: tuple[int, ...], t: Task | None,
                  chunk: int) -> Task | None:
        """Hybrid sharding: the reduce-scatter ``t`` of ``size`` bytes over ``shard``
        followed by the all-reduce of its output across the replicas, on the
        ``replicate`` stream where the reduction has a stream of its own (``t`` itself
        without hybrid sharding, where no reduce-scatter was issued, or before the
        stage's last backward under ``stack.hsdp_all_reduce: last``)."""
        ctx = self.ctx
        group = ctx.layout.replicate_group(rank)
        if t is None or len(group) == 1 or (ctx.s.stack.hsdp_all_reduce == "last"
                                            and not self.last[rank]):
            return t
        out = size / len(shard)
        stream: Stream = "replicate" if self.stream == "dp" else self.stream
        ctx.programs[rank].streams.setdefault(stream, [])  # only hybrid programs have it
        r = ctx.collective(rank, stream, "all_reduce", "dp", group, out,
                           f"dp.all_reduce replicas {out / 1e6:.2f} MB", t.microbatch,
                           chunk=chunk)
        if r is not None:
            r.deps.append(t.id)
        return r or t

    def fsdp_copies(self, rank: int, size: float, root: bool, after: Task
                    ) -> tuple[Task | None, Task | None, tuple[Op, ...]]:
        """The stack's FSDP kernels around one unit's reduce-scatter of ``size`` bytes
        (:func:`simulator.model.inventory.sharding.fsdp_reduce_parts`): those on the compute
        stream as a task right after ``after`` (FSDP2's pack, FSDP1's gradient concat),
        those the framework issues on the reduce-scatter's stream before it (FSDP1's cast
        and pre-divide) as a task on the compute stream right after that one (each None
        without any), and the ops after the reduce-scatter, which run after it on its
        stream. The cast and pre-divide run on FSDP1's post-backward stream, but none of
        their thread blocks fits on an SM beside a GEMM's or an attention kernel's (those
        hold an SM's registers and shared memory whole), so the SMs run them in turn with
        the compute issued after them: they take their time from the compute stream,
        from where the post-backward hook issues them (docs/model.md, "Kernels beside the
        compute")."""
        ctx = self.ctx
        tensors = ROOT_TENSORS if root else layer_tensors(ctx.s.model, ctx.s.stack)
        shard = len(ctx.layout.shard_group(rank))
        compute, before, post = fsdp_reduce_parts(
            ctx.s.stack, size / ctx.grad_dt, shard, ctx.dt_bytes, ctx.grad_dt, tensors,
            after.microbatch > 0 and not self.deferred, len(ctx.layout.replicate_group(rank)))
        cost, mb = ctx.cost_of(rank), after.microbatch
        pack = pre = None
        if compute:
            pack = ctx.compute_after(rank, after, "Z", "backward",
                                     f"fsdp.{fsdp_task_name(compute)} mb{mb}",
                                     cost.ops_time(compute))
            pack.weight_s = pack.duration  # gradient work: the backward's weight share
        if before:
            pre = ctx.compute_after(rank, pack or after, "Z", "backward",
                                    f"fsdp.{fsdp_task_name(before)} mb{mb}",
                                    cost.ops_time(before))
            pre.weight_s = pre.duration  # gradient work: the backward's weight share
        if self.deferred:  # the next unit's copies run after these
            self.copied[rank] = pre or pack or after
        return pack, pre, post

    def ddp_pack(self, rank: int, units: list[Unit], after: Task) -> Task:
        """torch DDP's copies of a bucket's gradients into it (``units`` of it;
        :func:`simulator.model.inventory.sharding.ddp_copy_ops`) as a task right after ``after`` on
        the
        compute stream, which the bucket's reduction then waits for; ``after`` itself
        without the copies."""
        ctx = self.ctx
        seconds = self.ddp_copies_s(rank, units, back=False)
        if not seconds:
            return after
        t = ctx.compute_after(rank, after, "D", "backward", "ddp.bucket_in", seconds)
        t.weight_s = t.duration  # gradient work: the backward's weight share
        return t

    def ddp_copies_s(self, rank: int, units: list[Unit], back: bool) -> float:
        """Seconds of DDP's copies of ``units`` into their buckets, or ``back``."""
        ctx = self.ctx
        sizes = {st: ctx.grad_units(st) for st, _ in units}
        cost, stack = ctx.cost_of(rank), ctx.s.stack
        return sum(cost.ops_time(ddp_copy_ops(stack, sizes[st][i][0], ctx.grad_dt,
                                              sizes[st][i][1], back)) for st, i in units)

    def sync_end(self, rank: int) -> None:
        self.flush(rank, self.pending[rank], 0)

    def step(self, rank: int) -> None:
        ctx, par = self.ctx, self.ctx.s.parallel
        if par.zero_offload:  # the offload pass steps on the host
            return
        if self.compressor is not None:
            self.compressor.exchange(rank)
        params = ctx.params_of(rank)
        shard = params / par.shard if par.zero >= 1 else params  # over dp_shard · cp
        streams = ctx.programs[rank].streams
        if par.zero == 0 and len(ctx.layout.dp_group(rank)) > 1 \
                and (self.compressor is None or self.compressor.in_backward):
            # DDP's finalize: every reduced bucket back into the gradients
            units = [(st, i) for st in ctx.stages_of(rank)
                     for i in range(len(ctx.grad_units(st)))]
            seconds = self.ddp_copies_s(rank, units, back=True)
            if seconds:
                back = ctx.compute(rank, "D", "backward", "ddp.bucket_out", seconds, -1, -1, 0)
                back.weight_s = seconds
                back.deps.extend(d.id for d in streams["dp"])
        norm = ctx.collective(rank, "compute", "all_reduce", "dp", ctx.layout.shard_group(rank),
                              GRAD_NORM_BYTES, "dp.grad_norm") if grad_norm_reduced(ctx.s) \
            else None
        t = ctx.compute(rank, "optimizer", "optimizer", "optimizer step",
                        ctx.optimizer_time(rank, shard), -1, -1, 0)
        for waits in filter(None, (norm, t)):  # the norm needs every reduced gradient
            waits.deps.extend(d.id for d in streams["dp"])
            waits.deps.extend(d.id for d in streams.get("replicate", ()))  # hybrid sharding's
            waits.deps.extend(d.id for d in streams["zero"][-1:])

    def after_step(self, rank: int) -> None:
        """ZeRO-1/2: all-gather the updated parameters (ZeRO-3 gathers every unit at
        use instead)."""
        ctx, par = self.ctx, self.ctx.s.parallel
        if par.zero not in (1, 2):
            return
        ctx.collective(rank, "compute", "all_gather", "dp", ctx.layout.dp_group(rank),
                       ctx.params_of(rank) * ctx.dt_bytes, "dp.all_gather updated params")

