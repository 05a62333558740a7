"""The strategies, in the order their passes are installed (the hooks of the pipeline
walk call them in this order, and task ids follow it: the golden workloads pin it).

:data:`STRATEGIES` is the one list: the workload builder installs the passes of the
active ones, the scenario rules ask each for its problems, the accounting takes each
one's communication kinds, the planner each one's dimensions. A new strategy is its
module and one line here. Everything reads :func:`strategies` when it runs, so nothing
caches a list that a strategy added later (a test's toy strategy) would not be in.
"""

from __future__ import annotations

from simulator.strategies.base import Strategy
from simulator.strategies.compression.strategy import COMPRESSION
from simulator.strategies.context.strategy import CONTEXT
from simulator.strategies.data.strategy import DATA
from simulator.strategies.expert.strategy import EXPERT
from simulator.strategies.offload import OFFLOAD
from simulator.strategies.pipeline.strategy import PIPELINE
from simulator.strategies.tensor.strategy import TENSOR
from simulator.strategies.zero3.strategy import ZERO3

STRATEGIES: tuple[Strategy, ...] = (PIPELINE, EXPERT, TENSOR, CONTEXT, ZERO3, DATA, OFFLOAD,
                                    COMPRESSION)


def strategies() -> tuple[Strategy, ...]:
    """Every registered strategy, in install order."""
    return STRATEGIES


def strategy(name: str) -> Strategy | None:
    """The registered strategy ``name``, or None."""
    return next((s for s in STRATEGIES if s.name == name), None)

