"""DualPipe's overlapped F&B pairs: one chunk's compute hides the other's all-to-alls.

In the steady state of DualPipe (:mod:`simulator.schedules.dualpipe`) a rank runs the
forward of one micro-batch and the full backward of another (of the other direction)
as one pair, ``_forward_backward_chunk`` in github.com/deepseek-ai/DualPipe, which
hands both to the model's ``overlapped_forward_backward``. The DeepSeek-V3 report
(arXiv:2412.19437 §3.2.1, Figure 4) describes what that does: each chunk is cut at
its MoE all-to-alls (attention, dispatch, MLP, combine; the backward in reverse) and
the two chunks' pieces alternate, so that while one chunk's dispatch or combine is in
flight the GPU computes the other chunk's next piece; the point-to-point sends and
receives of both already run off the compute stream (``overlap.pp``).

The builder expresses exactly that: the pair's expert-parallel all-to-alls (kind
``ep``) leave the compute stream for an ``ep`` stream of their own, each after the
task that precedes it in its chunk, and each chunk's next task waits for it; on the
compute stream the two chunks' pieces between all-to-alls alternate, the forward's
first. Each chunk keeps its own data dependencies (its receive, its layers in order,
its tokens back before the next layer); only the other chunk's work fills the wait.
The pair's tasks on the other streams (its sends, the CP ring, ZeRO-3's gathers, TP's
overlapped collectives) follow that order, each before the next compute task of its
micro-batch. A step gains at most the all-to-all time the pairs hide; with expert
parallelism alone it never loses (the tests check both), while per-layer collectives
of the chunks' own (TP in line, ZeRO-3's gathers) can cost a little: each chunk's last
piece, and what the next stage waits for, ends later than back to back.

Not modelled: the SMs DeepSeek reserves for communication (20 of 132 on an H800),
which slow the overlapped compute; the split of the backward's MLP and attention into
input and weight gradients inside the pair (the engine's B keeps them fused). Without
a mixture of experts over more than one GPU (no all-to-alls) a pair is its two chunks
back to back, as on a device that cannot overlap communication with compute.
"""

from __future__ import annotations

from bisect import bisect_right

from simulator.builder.context import Context
from simulator.builder.tasks import Task
from simulator.schedules.dualpipe import overlapped_pairs
from simulator.schedules.registry import schedule_spec
from simulator.spec.scenario import Scenario
from simulator.strategies.pipeline.strategy import copies_bytes


def overlaps(s: Scenario) -> bool:
    """Whether the scenario's F&B pairs overlap: a two-direction schedule (DualPipe), a
    mixture of experts over ep > 1 GPUs, and a device that overlaps communication."""
    return schedule_spec(s.parallel.schedule).directions == 2 and s.model.is_moe \
        and s.parallel.ep > 1 and s.hardware.gpu.comm_overlaps_compute


def pair_starts(ctx: Context, pp_rank: int) -> frozenset[int]:
    """Positions of the forwards that open an overlapped pair in ``pp_rank``'s order
    (empty when the scenario's pairs do not overlap)."""
    if not overlaps(ctx.s):
        return frozenset()
    return frozenset(overlapped_pairs(ctx.sched, pp_rank))


def _pieces(tasks: list[Task], before: Task | None,
            ) -> tuple[list[list[Task]], list[Task]]:
    """A chunk's compute-stream tasks cut at its all-to-alls: the pieces between them
    (one more than the all-to-alls) and the all-to-alls, each made to wait for the task
    before it (``before`` for a chunk that opens with one: not ahead of the pair) and to
    gate the task after it."""
    pieces: list[list[Task]] = [[]]
    a2a: list[Task] = []
    gate: Task | None = None
    for t in tasks:
        if t.kind == "ep" and t.plan is not None:
            if before is not None:
                t.deps.append(before.id)
            a2a.append(t)
            pieces.append([])
            gate = t
        else:
            if gate is not None:
                t.deps.append(gate.id)
                gate = None
            pieces[-1].append(t)
        before = t
    return pieces, a2a


def _follow(order: list[Task], side: list[Task]) -> list[Task]:
    """``side`` (a stream's tasks of the pair, in build order) in the compute ``order``:
    each before the first compute task of its micro-batch built after it (a send after
    its chunk's last), so that every stream runs the pair in one order and a chunk's
    transfers wait for nothing of the other chunk."""
    ids: dict[int, list[int]] = {}  # micro-batch -> its compute tasks' ids, built order
    for t in sorted(order, key=lambda t: t.id):
        ids.setdefault(t.microbatch, []).append(t.id)
    at = {t.id: i for i, t in enumerate(order)}
    every = sorted(at)

    def key(t: Task) -> float:
        mine = ids.get(t.microbatch, every)
        j = bisect_right(mine, t.id)
        return at[mine[j]] - 0.5 if j < len(mine) else at[mine[-1]] + 0.5

    return sorted(side, key=key)


def interleave(ctx: Context, rank: int, begin: int, middle: int,
               sides: dict[str, int]) -> None:
    """Overlap the pair whose forward's tasks start at ``begin`` on ``rank``'s compute
    stream and whose backward's start at ``middle`` (and run to the stream's end); each
    other stream's tasks from ``sides[name]`` on (the pair's: TP, CP, ZeRO-3, sends)
    follow the new order."""
    streams = ctx.programs[rank].streams
    compute = streams["compute"]
    ahead = compute[begin - 1] if begin else None
    fwd, fwd_a2a = _pieces(compute[begin:middle], ahead)
    bwd, bwd_a2a = _pieces(compute[middle:], ahead)
    order: list[Task] = []
    for i in range(max(len(fwd), len(bwd))):
        order += fwd[i] if i < len(fwd) else []
        order += bwd[i] if i < len(bwd) else []
    compute[begin:] = order
    for name, start in sides.items():
        if name not in ("compute", "ep") and len(streams[name]) > start + 1:
            streams[name][start:] = _follow(order, streams[name][start:])
    ep = streams.setdefault("ep", [])
    for i in range(max(len(fwd_a2a), len(bwd_a2a))):
        for chunk in (fwd_a2a, bwd_a2a):
            if i < len(chunk):
                chunk[i].stream = "ep"
                ep.append(chunk[i])


def copies_sum(ctx: Context, rank: int) -> None:
    """DualPipe: rank r and pp − 1 − r hold the same two model stages; each copy's
    gradients are summed with the other's (the DualPipe example's exchange) once the
    data-parallel reductions have run: an all-reduce of :func:`copies_bytes` (the
    reduced shard under ZeRO) between the two."""
    par = ctx.s.parallel
    if ctx.sched.directions != 2:
        return
    c = ctx.layout.coord(rank)
    group = tuple(sorted((rank, ctx.layout.rank(par.pp - 1 - c.pp, c.dp, c.tp, c.cp))))
    t = ctx.collective(rank, "compute", "all_reduce", "dp", group,
                       copies_bytes(ctx.s, c.pp),
                       "dp.all_reduce gradients with the other copy (DualPipe)")
    if t is not None:
        streams = ctx.programs[rank].streams
        t.deps.extend(d[-1].id for name in ("dp", "zero", "replicate")
                      for d in [streams.get(name, ())] if d)
