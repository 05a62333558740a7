"""The workload builder, one pass per parallelism strategy.

:func:`build_programs` walks the pipeline schedule for every simulated rank
(:mod:`~simulator.strategies.pipeline`: compute tasks and p2p sends) and lets the
installed strategy passes add their tasks at the walk's hooks
(:class:`~simulator.builder.context.Pass`), in this order:

- :mod:`~simulator.strategies.expert`: a mixture of experts' all-to-alls, routed
  experts and expert gradients (model.experts > 0);
- :mod:`~simulator.strategies.tensor`: TP collectives around blocks, the
  vocab-parallel ends and the loss (tp > 1);
- :mod:`~simulator.strategies.context`: the attention's key/value exchange
  over the CP group, as a ring or an all-gather (cp > 1);
- :class:`~simulator.strategies.data.Zero3Pass`: ZeRO-3 / FSDP unit gathers with
  prefetch, and the stage's root unit before each forward (zero = 3, dp > 1);
- :class:`~simulator.strategies.data.DataPass`: DDP buckets, ZeRO reduce-scatters,
  the optimizer step and ZeRO-1/2's parameter all-gather after it (always);
- :mod:`~simulator.strategies.offload`: ZeRO-Offload's host copies and CPU Adam
  (``zero_offload``).

Task ids are positions in one list, so this order is part of what a program
is; the golden test of :mod:`tests.test_workload_golden` pins it. A new
strategy is a new pass module and a line in :func:`install_passes`.
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass
from simulator.builder.tasks import gc_paused
from simulator.strategies.context import ContextParallelPass
from simulator.strategies.data import DataPass, Zero3Pass
from simulator.strategies.expert import ExpertPass
from simulator.strategies.offload import OffloadPass
from simulator.strategies.pipeline import PipelinePass
from simulator.strategies.tensor import TensorPass


def install_passes(ctx: Context) -> list[Pass]:
    """The strategy passes this scenario needs, in hook order."""
    par = ctx.s.parallel
    passes: list[Pass] = []
    if ctx.s.model.is_moe:
        passes.append(ExpertPass(ctx))
    if par.tp > 1:
        passes.append(TensorPass(ctx))
    if par.cp > 1:
        passes.append(ContextParallelPass(ctx))
    if par.zero == 3 and par.dp * par.cp > 1:
        passes.append(Zero3Pass(ctx))
    passes.append(DataPass(ctx))
    if par.zero_offload:
        passes.append(OffloadPass(ctx))
    return passes


def build_programs(ctx: Context) -> None:
    """Fill ``ctx.programs`` and ``ctx.tasks`` for every rank of ``ctx.ranks``."""
    ctx.install(install_passes(ctx))
    pipeline = PipelinePass(ctx)
    with gc_paused():
        for rank in ctx.ranks:
            pipeline.build_rank(rank)
        pipeline.resolve()
        ctx.count_dependents()
