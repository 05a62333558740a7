"""The workload builder's passes: the pipeline walk and the strategies' passes.

:func:`build_programs` walks the pipeline schedule for every simulated rank
(:class:`~simulator.strategies.pipeline.workload.PipelinePass`: compute tasks and p2p
sends) and lets the passes of the active strategies add their tasks at the walk's hooks
(:class:`~simulator.builder.context.Pass`), in the registry's order
(:mod:`simulator.strategies.registry`): a mixture of experts' all-to-alls and experts,
TP collectives, the context-parallel exchange, ZeRO-3's gathers, the data-parallel
reductions and optimizer step, ZeRO-Offload's host copies.

Task ids are positions in one list, so this order is part of what a program
is; the golden test of :mod:`tests.test_workload_golden` pins it.
"""

from __future__ import annotations

from simulator.builder.context import Context, Pass
from simulator.builder.tasks import gc_paused
from simulator.strategies import registry
from simulator.strategies.pipeline.workload import PipelinePass


def install_passes(ctx: Context) -> list[Pass]:
    """The passes of the strategies this scenario uses, in hook order."""
    passes: list[Pass] = []
    for strategy in registry.strategies():
        if strategy.active(ctx.s):
            made = strategy.make_pass(ctx)
            if made is not None:
                passes.append(made)
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
    # the passes hold the context, whose hooks hold them: let go of them, so that the
    # build is freed when its workload is (not at the collector's next full pass)
    ctx.install([])
