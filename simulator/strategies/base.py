"""The Strategy protocol: what one parallelism owns, behind one interface.

A strategy (tensor, pipeline, data, ZeRO-3, offload, expert, context, gradient
compression, or a new one) is one module, or one small package, with one
:class:`Strategy` object that the registry (:mod:`simulator.strategies.registry`)
lists. Everything that asks "which strategies are there" asks the registry; nothing
outside a strategy tests its fields by name. What it owns:

- ``kinds``: the communication kinds its tasks carry; the accounting gives each a
  ``<kind>_transfer`` and a ``<kind>_wait`` category (:mod:`simulator.analysis.accounting`);
- ``options``: for a strategy that is not one of the scenario's ``parallel`` fields,
  the model of its own section ``strategies.<name>`` (validated strictly, like every
  section: :func:`options_problems`);
- ``problems`` / ``unsupported`` / ``warnings``: its scenario rules (field, value,
  fix), what validates but has no workload yet, and legal but doubtful choices;
- ``make_pass``: its workload pass (:class:`~simulator.builder.context.Pass`), installed
  in registry order when ``active``;
- ``analytic_terms``: seconds it adds to the closed-form step, by accounting category;
- ``memory_terms``: bytes it adds to a stage's memory, by breakdown field;
- ``dimensions``: the planner's search dimensions it owns (:class:`Dimension`);
- ``tasks_per_layer``: the tasks its pass adds per layer and micro-batch (the engine's
  size budget, :mod:`simulator.builder.budget`).

The built-in strategies' analytic and memory terms enter closed forms whose order of
operations the figures depend on (:mod:`simulator.analysis.analytic`,
:mod:`simulator.analysis.memory` call their modules' functions in place); the generic
hooks add a new strategy's terms after them. A new strategy is its module plus one
registry line; ``tests/toy_strategy.py`` is one, and its test sees it validated,
simulated by the engine and the closed form, counted in memory and searched by ``plan``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from simulator.errors import Problem

if TYPE_CHECKING:
    from simulator.builder.context import Context, Pass
    from simulator.spec.base import Frozen
    from simulator.spec.scenario import Scenario
    from simulator.system.costs import CostModel
    from simulator.system.hardware import HardwareProfile
    from simulator.system.layout import Layout


@dataclass(frozen=True)
class AnalyticView:
    """What a strategy's closed-form terms may read: the scenario (a context-parallel
    rank's local view), its layout, cost model and hardware, and the pipeline phase and
    micro-batches the terms add to."""

    s: Scenario
    layout: Layout
    cost: CostModel
    hw: HardwareProfile
    pipeline_s: float


@dataclass(frozen=True)
class Dimension:
    """One dimension of the planner's search (:mod:`simulator.search.plan`).

    ``knobs`` are the plan table's columns it fills (one, or several chosen together,
    as a schedule and its virtual stages) and ``fields`` the scenario field of each
    (``parallel.tp``, ``strategies.toy.enabled``). ``values(request, base, chosen)``
    yields a tuple of values per choice, given the request, the base scenario and the
    knobs chosen so far (an empty iterable prunes the branch). Dimensions nest by
    ``order``: a lower one varies more slowly."""

    knobs: tuple[str, ...]
    fields: tuple[str, ...]
    order: int
    values: Callable[[Any, Scenario, Mapping[str, Any]], Iterable[tuple[Any, ...]]]


class Strategy:
    """One parallelism; every hook's default is "nothing" (see the module notes)."""

    name: str = ""
    kinds: tuple[str, ...] = ()
    options: type[Frozen] | None = None

    def active(self, s: Scenario) -> bool:
        """Whether the scenario uses the strategy (its pass is installed)."""
        return False

    def problems(self, s: Scenario) -> list[Problem]:
        return []

    def unsupported(self, s: Scenario) -> list[Problem]:
        return []

    def warnings(self, s: Scenario) -> list[str]:
        return []

    def make_pass(self, ctx: Context) -> Pass | None:
        return None

    def analytic_terms(self, view: AnalyticView) -> dict[str, float]:
        return {}

    def memory_terms(self, s: Scenario, stage: int) -> dict[str, float]:
        return {}

    def dimensions(self) -> tuple[Dimension, ...]:
        return ()

    def tasks_per_layer(self, s: Scenario) -> int:
        return 0

    def settings(self, s: Scenario) -> Any:
        """Its validated options (``strategies.<name>``; defaults when the scenario has
        no such section), or None for a strategy without options."""
        if self.options is None:
            return None
        return self.options.model_validate(s.strategies.get(self.name, {}), strict=True)
