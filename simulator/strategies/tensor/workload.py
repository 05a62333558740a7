"""Tensor-parallel pass: Megatron-LM's collectives on the compute stream.

Per layer and micro-batch, two collectives in forward and two in backward
(Shoeybi et al. 2019, §3): an all-reduce after the attention block and after
the MLP block; with sequence parallelism (Korthikanti et al. 2022, §4.2.2) an
all-gather before each block and a reduce-scatter after it instead, in both
directions, of the same b·s·h activation. Recomputation repeats the forward's
collectives its checkpointed function holds (all of them under full recomputation;
:func:`~simulator.model.inventory.recompute_comm.reissued`). They run on the compute
stream: the next block needs their result.

The vocab-parallel ends (Megatron's ``VocabParallelEmbedding`` and
``vocab_parallel_cross_entropy``): the embedding's partial sums are
all-reduced (reduce-scattered with SP) after its forward, and with SP its
backward all-gathers the incoming gradient; the output layer takes a replicated
input (all-gathered with SP) and all-reduces (reduce-scatters) its input
gradient in backward; the cross-entropy all-reduces three fp32 values per
token (the logits' max, the target logit, the sum of exponentials).

TP as DTensor (a stack with ``dtensor: true``, PyTorch's ``parallelize_module`` as
our measured runs use it) issues what its parallel styles do instead: in backward
without sequence parallelism one all-reduce per ``ColwiseParallel`` projection
(:func:`~simulator.model.inventory.tensor_parallel.tp_block_collectives`); the embedding's output is
all-reduced to a replicated tensor even under sequence parallelism (then cut
locally); the output layer (``ColwiseParallel`` with a replicated output)
all-gathers the logits, b·s·V, and the cross-entropy runs on them whole, with no
collective of its own. Under sequence parallelism the norms' replicated parameters
get partial gradients (their inputs are sequence shards) that stay partial until
the per-tensor AdamW reads them: each op with the gradient as an operand all-reduces
it (torch/optim/adam.py ``_single_tensor_adam``: ``exp_avg.lerp_(grad)`` and
``exp_avg_sq.mul_(beta2).addcmul_(grad, grad)``), three small all-reduces per norm
parameter tensor before the step (the profiler of our measured TP 2 run shows them
inside ``aten::lerp_`` and ``aten::addcmul_``).

Under DTensor each of these collectives is a functional collective
(``torch.distributed._functional_collectives``), whose host time beyond a plain c10d
call the profile may have measured by kind and bytes on two ranks
(``gpu.funcol_host``; older profiles: one figure, ``gpu.funcol_sync_us`` or
``gpu.funcol_overhead_us``); a task of that length on the compute stream before each
one (:meth:`TensorPass.issue`), then the plain collective with its own cost after
compute.

TP communication overlap (``stack.tp_overlap``; which collective meets which GEMM,
and why: :mod:`simulator.strategies.tensor.overlap`): the block's task is split into pieces around
its overlapped collectives, which run on a ``tp`` stream, [ring chunks ‖ all-gather] →
``tp.wait`` → the rest of the block → [reduce-scatter ‖ chunks or weight-gradient
GEMM] → ``tp.wait`` (:meth:`TensorPass.split`; ``block`` returns the last piece, which
then stands for the block); a zero-second ``tp.wait`` holds the compute stream for
what the GEMM did not hide. A device that cannot overlap communication (a CPU
process) runs them all in line.

Installed only when tp > 1 (a group of one has no collective).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from simulator.builder.context import Context, Pass
from simulator.builder.tasks import Task
from simulator.model import transformer as mdl
from simulator.model.inventory.recompute_comm import Reissue
from simulator.model.inventory.tensor_parallel import (
    tp_block_collectives,
    tp_end_collectives,
    tp_optimizer_collectives,
)
from simulator.strategies.tensor import overlap as tp_overlap
from simulator.strategies.tensor.overlap import overlap_sides
from simulator.system.collectives.plan import Plan
from simulator.system.units import CollectiveName


class TensorPass(Pass):
    stamps = True  # per block, stateless between actions (``start`` is popped in the block)
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        s = ctx.s
        self.sp = s.parallel.sequence_parallel
        self.tp_bytes = mdl.tp_comm_bytes_per_layer(s.model, s.training.micro_batch,
                                                    s.training.dtype)
        self.end_bytes = mdl.tp_end_bytes(s.model, s.training.micro_batch, s.training.dtype)
        self.dtensor = s.stack.dtensor
        tp = self.tp = s.parallel.tp
        self.after = {(label, bwd): tp_block_collectives(s.model, s.stack, tp, self.sp, label,
                                                         bwd)
                      for label in ("attn", "mlp") for bwd in (False, True)}
        # a device that cannot overlap communication runs every collective in line
        self.mode = s.stack.tp_overlap if tp_overlap.active(s) else "none"
        if self.mode != "none":
            for prog in ctx.programs.values():
                prog.streams.setdefault("tp", [])
        self.start: dict[int, Task] = {}  # rank -> where its next overlapped all-gather starts
        # (rank, collective, bytes) -> the cost of one functional collective
        self.issue_s: dict[tuple[int, str, float], float] = {}
        # (collective, bytes, group) -> the plan of one TE userbuffers collective
        self.ub_plans: dict[tuple[str, float, tuple[int, ...]], Plan] = {}

    def issue(self, rank: int, kind: str, op: CollectiveName, nbytes: float, mb: int = -1,
              layer: int = -1, chunk: int = 0) -> Task | None:
        """The cost of one functional collective ``op`` of ``nbytes``, where it is
        charged."""
        seconds = self.issue_s.get((rank, op, nbytes))
        if seconds is None:
            link = self.ctx.layout.group_link(self.ctx.layout.tp_group(rank))
            seconds = self.issue_s[rank, op, nbytes] = self.ctx.cost_of(rank).funcol_s(
                self.dtensor, link, op, nbytes)
        if not seconds:
            return None
        return self.ctx.compute(rank, "T", kind, "tp.funcol issue", seconds, mb, layer, chunk)

    def block(self, rank: int, label: str, before: bool, mb: int, layer: int,
              chunk: int, backward: bool) -> Task | None:
        """All-reduce after a block, or with SP all-gather before and reduce-scatter after;
        under TP overlap the block's task split around the overlapped ones (its last
        piece returned)."""
        if before and not self.sp:
            return None
        windows = self.ctx.c_of(rank).tp_windows  # none priced (given costs): in line
        ag, rs = overlap_sides(self.mode, backward)
        ag = ag and (label, "ag", backward) in windows
        rs = rs and (label, "rs", backward) in windows
        if before:
            if ag:  # where the overlapped all-gather starts: its host issue, or a mark
                kind = "backward" if backward else "forward"
                self.start[rank] = self.issue(rank, kind, "all_gather", self.tp_bytes, mb,
                                              layer, chunk) or \
                    self.ctx.compute(rank, "T", kind, f"tp.start L{layer} mb{mb}", 0.0, mb,
                                     layer, chunk)
            else:
                self.in_line(rank, "all_gather", 1, mb, layer, chunk, backward)
            return None
        block = self.ctx.programs[rank].streams["compute"][-1]
        if rs and backward and block.op == "I":  # no weight gradient to hide behind
            rs = not windows[label, "rs", True].weight
        end = self.split(rank, label, block, ag, rs, mb, layer, chunk, backward) \
            if ag or rs else None
        if not rs:
            op: CollectiveName = "reduce_scatter" if self.sp else "all_reduce"
            self.in_line(rank, op, self.after[label, backward], mb, layer, chunk, backward)
        return end

    def recompute_block(self, rank: int, label: str, before: bool, mb: int, layer: int,
                        chunk: int, again: Reissue) -> Task | None:
        """A block a finer policy re-runs whole issues its forward's collectives as
        :meth:`block` does (overlapped as the forward's); one that re-runs only its
        all-gather's or its all-reduce's consumers issues that one alone, in line."""
        if label in again.blocks:
            return self.block(rank, label, before, mb, layer, chunk, False)
        if before and self.sp and label in again.gathers:
            self.in_line(rank, "all_gather", 1, mb, layer, chunk, False)
        elif not before and not self.sp and label in again.reduces:
            self.in_line(rank, "all_reduce", self.after[label, False], mb, layer, chunk,
                         False)
        return None

    def in_line(self, rank: int, op: CollectiveName, count: int, mb: int, layer: int,
                chunk: int, backward: bool) -> None:
        """``count`` blocking collectives on the compute stream."""
        for _ in range(count):
            self.issue(rank, "backward" if backward else "forward", op, self.tp_bytes, mb,
                       layer, chunk)
            self.ctx.collective(rank, "compute", op, "tp", self.ctx.layout.tp_group(rank),
                                self.tp_bytes, f"tp.{op} L{layer} mb{mb}", mb, layer, chunk)

    def split(self, rank: int, label: str, block: Task, ag: bool, rs: bool, mb: int,
              layer: int, chunk: int, backward: bool) -> Task:
        """Split ``block`` (the block's task, just added) around its overlapped
        collectives: [ring chunks ‖ all-gather] → wait → rest (with the last chunk) →
        [reduce-scatter (Megatron's async backward without SP: all-reduce) ‖ chunks or
        weight GEMM] → wait → the sum of the received partials (symmetric memory) or the
        last chunk's reduce-scatter in line (TE's pipeline). Returns the last compute
        piece."""
        ctx = self.ctx
        compute = ctx.programs[rank].streams["compute"]
        assert block.plan is None and block.op in ("F", "B", "I", "R"), block.name
        # the block's tp.start or host issue (another pass may have added a task since)
        start = self.start.pop(rank) if ag else None
        weight, name = block.weight_s, block.name
        rest, rest_w = block.duration, weight
        g = self.ctx.c_of(rank).tp_windows[label, "ag", backward] if ag else None
        r = self.ctx.c_of(rank).tp_windows[label, "rs", backward] if rs else None
        if g is not None:  # the block's task becomes the ring's chunks
            gather = self.side(rank, "all_gather", mb, layer, chunk)
            assert start is not None
            gather.deps.append(start.id)  # with the block (a received input gates the start)
            block.duration, block.weight_s = g.hidden, 0.0
            block.name = f"{name} {g.gemm} chunks ‖ tp.all_gather"
            self.wait(rank, block, gather, mb, layer, chunk)
            rest += g.first - g.whole  # the last chunk, after the ring
            piece = ctx.compute(rank, block.op, block.kind, name, 0.0, mb, layer, chunk)
        else:
            piece = block
        if r is not None:  # the reduce-scatter starts after the first chunk (pipelined)
            rest += r.first + r.aside - r.whole  # the first chunk and the margin's aside
            if r.weight:  # the bulk overlap hides a weight-gradient GEMM
                rest_w -= r.whole
        piece.duration, piece.weight_s = max(rest, 0.0), max(rest_w, 0.0) if backward else 0.0
        if r is None:
            return piece
        op: CollectiveName = "all_reduce" if not self.sp else "reduce_scatter"
        self.issue(rank, "backward" if backward else "forward", op, self.tp_bytes, mb, layer,
                   chunk)
        scatter = self.side(rank, op, mb, layer, chunk, 1 - r.tail)
        scatter.deps.append(compute[-1].id)  # after the rest (and its host issue)
        what = f"{r.gemm} wgrad" if r.weight else f"{r.gemm} chunks"
        last = ctx.compute(rank, piece.op, piece.kind, f"{name} {what} ‖ tp.{op}",
                           r.hidden, mb, layer, chunk)
        last.weight_s = r.hidden if r.weight else 0.0
        self.wait(rank, last, scatter, mb, layer, chunk)
        if r.after:  # symmetric memory's sum of the received partials
            last = ctx.compute(rank, piece.op, piece.kind, f"tp.partials_sum L{layer} mb{mb}",
                               r.after, mb, layer, chunk)
        if r.tail:  # the last chunk's reduce-scatter, after the last GEMM chunk
            group = ctx.layout.tp_group(rank)
            nbytes = self.tp_bytes * r.tail
            ctx.collective(rank, "compute", "reduce_scatter", "tp", group, nbytes,
                           f"tp.reduce_scatter L{layer} mb{mb} (last chunk)", mb, layer, chunk,
                           self.ub_plan("reduce_scatter", nbytes, group))
        return last

    def ub_plan(self, op: CollectiveName, nbytes: float, group: tuple[int, ...]) -> Plan:
        """NCCL's plan of a collective TE's userbuffers run, holding no SMs (made once, so
        that equal layers keep equal programs)."""
        key = (op, nbytes, group)
        plan = self.ub_plans.get(key)
        if plan is None:
            plan = self.ub_plans[key] = replace(self.ctx.plan_of(op, nbytes, group), sms=0)
        return plan

    def side(self, rank: int, op: CollectiveName, mb: int, layer: int, chunk: int,
             share: float = 1.0) -> Task:
        """One overlapped collective on the ``tp`` stream (its host issue, under DTensor,
        is on the compute stream before the GEMM it meets: :meth:`block`, :meth:`split`).
        TE's userbuffers move it, not NCCL's kernels: its plan holds no SMs (a ring
        exchange runs on copy engines; the others' SMs are the GEMM's margin,
        :func:`~simulator.strategies.tensor.overlap.margin`). Megatron's ``async``
        backward issues NCCL's own, which holds its channels' SMs."""
        ctx, group, nbytes = self.ctx, self.ctx.layout.tp_group(rank), self.tp_bytes * share
        plan = None if self.mode == "async" else self.ub_plan(op, nbytes, group)
        t = ctx.collective(rank, "tp", op, "tp", group, nbytes,
                           f"tp.{op} L{layer} mb{mb} (overlapped)", mb, layer, chunk, plan)
        assert t is not None  # tp > 1
        return t

    def wait(self, rank: int, after: Task, transfer: Task, mb: int, layer: int,
             chunk: int) -> None:
        """The compute stream waits for an overlapped collective (zero seconds)."""
        w = self.ctx.compute(rank, after.op, after.kind, f"tp.wait L{layer} mb{mb}", 0.0, mb,
                             layer, chunk)
        w.deps.append(transfer.id)

    def edge(self, rank: int, where: str, forward: bool, mb: int, chunk: int) -> None:
        end: Literal["embed", "head", "mtp_proj"] = \
            "embed" if where == "embed" else "mtp_proj" if where == "mtp_proj" else "head"
        for op, payload in tp_end_collectives(self.ctx.s.stack, self.tp, self.sp, end,
                                              forward):
            nbytes = self.end_bytes[payload]
            self.issue(rank, "forward" if forward else "backward", op, nbytes, mb, -1, chunk)
            self.ctx.collective(rank, "compute", op, "tp", self.ctx.layout.tp_group(rank),
                                nbytes, f"tp.{op} {where} mb{mb}", mb, -1, chunk)

    def loss(self, rank: int, mb: int, chunk: int) -> None:
        ends = tp_end_collectives(self.ctx.s.stack, self.tp, self.sp, "loss", True)
        for (op, payload), what in zip(ends, ("max", "target", "sum"), strict=False):
            if payload == "logits":  # the replicated logits of the output layer, whole
                self.issue(rank, "forward", op, self.end_bytes[payload], mb, -1, chunk)
                name = f"tp.{op} logits mb{mb}"
            else:
                name = f"tp.{op} loss {what} mb{mb}"
            self.ctx.collective(rank, "compute", op, "tp", self.ctx.layout.tp_group(rank),
                                self.end_bytes[payload], name, mb, -1, chunk)

    def step(self, rank: int) -> None:
        ctx, s = self.ctx, self.ctx.s
        stages = ctx.stages_of(rank)
        n = tp_optimizer_collectives(s.model, s.stack, self.tp, self.sp,
                                     sum(len(ctx.layers_of(st)) for st in stages),
                                     any(ctx.sched.is_last(st) for st in stages))
        group, nbytes = ctx.layout.tp_group(rank), s.model.hidden * ctx.grad_dt
        for i in range(n):
            self.issue(rank, "optimizer", "all_reduce", nbytes)
            ctx.collective(rank, "compute", "all_reduce", "tp", group, nbytes,
                           f"tp.all_reduce norm grad {i // 3} (optimizer)")
