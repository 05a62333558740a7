"""How the memory model and the estimate compute their terms: through a :class:`Price`.

:func:`~simulator.analysis.memory.stage_breakdown` and
:func:`~simulator.analysis.analytic.estimate.analytic_estimate` ask for each of their
costlier terms (a stage's parameter states, its activations, each device term; the
pipeline phase, the gradients' reduction, the optimizer step) by name and stage, with
how to compute it. Alone they compute it (:func:`direct`). A planner that prices
thousands of layouts of one model passes a price that looks the term up by the
candidate's knobs the term reads (:mod:`simulator.search.terms`): the DP reduction
does not read the micro-batch, the activations do not read the ZeRO stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Price(Protocol):
    """Term ``name`` of pipeline ``stage`` (-1: not a stage's), ``compute()`` unless known."""

    def __call__(self, name: str, stage: int, compute: Callable[[], T]) -> T: ...


def direct(name: str, stage: int, compute: Callable[[], T]) -> T:
    """The term computed (``name`` and ``stage`` unread)."""
    del name, stage
    return compute()
