"""What the planner's candidates share: the layer terms of the analytic estimate.

A candidate's estimate (:func:`~simulator.analysis.analytic.estimate.analytic_estimate`)
starts from one layer's costs per micro-batch on one rank
(:class:`~simulator.analysis.analytic.estimate.LayerTerms`: its blocks priced op by op,
its TP, expert and CP collectives). They read the layer's knobs only, not the pipeline
depth (beyond whether there is a pipeline), the data-parallel degree, the schedule or
the ZeRO stage (:data:`STAGE_KNOBS`), so the thousands of candidates that differ only
in those share them: GPT-3 175B on 1,024 A100 has 4,085 fitting candidates and 87
distinct layers, Llama-3 70B at 128K tokens on 2,048 GB200 41,871 and 969. A knob a
strategy registers later is part of the key unless named here, so a new dimension can
only make the memo miss, never return another candidate's terms.
``tests/test_plan_shared.py`` holds the memo to the estimate computed afresh. The
estimate is its step time alone (``breakdown=False``); the collectives, schedule
makespans and layer placements it prices are looked up where a candidate before asked
the same (:func:`~simulator.strategies.timing.collective_time`,
:func:`~simulator.schedules.action.makespan`,
:func:`~simulator.spec.placement.stage_layers`), and ``tests/test_plan_fast.py`` holds
every row to the one computed without them.

The memo is per base scenario, keyed by its content with the hardware profile and the
stack its names resolve to (a profile file edited between two plans is another plan),
and kept per process (a worker sees chunk after chunk of the same plan), a few plans
at most.
"""

from __future__ import annotations

import functools
from typing import Any

from simulator.analysis.analytic.estimate import (
    LayerTerms,
    analytic_estimate,
    cost_model,
    layer_terms,
)
from simulator.analysis.priced import Price
from simulator.search import terms
from simulator.search.candidates import Candidate, CandidateScenarios, knobs
from simulator.spec.scenario import Scenario
from simulator.system.costs import CostModel

#: The knobs the layer terms do not read (``pp`` only as whether there is a pipeline:
#: the pipeline runtime's host time per action)
STAGE_KNOBS = frozenset({"pp", "dp", "schedule", "virtual_stages", "zero"})


def layer_key(cand: Candidate, names: tuple[str, ...] | None = None) -> tuple[Any, ...]:
    """The candidate's layer knobs: every knob but :data:`STAGE_KNOBS`, and pp > 1
    (``names``: :func:`~simulator.search.candidates.knobs`, when already listed)."""
    named = dict(zip(names or knobs(), cand, strict=True))
    return (named["pp"] > 1, *(v for k, v in named.items() if k not in STAGE_KNOBS))


Memo = dict[tuple[Any, ...], tuple[CostModel, LayerTerms]]


def base_key(base: Scenario) -> str:
    """``base``'s content: its JSON, its hardware profile's and its stack's."""
    return "\n".join(x.model_dump_json() for x in (base, base.hardware, base.stack))


@functools.lru_cache(maxsize=4)
def _memo(key: str) -> Memo:
    """The layer terms of the plan whose base scenario has :func:`base_key` ``key``,
    kept in this process."""
    del key  # the key only tells plans apart
    return {}


class SharedTerms:
    """What one base scenario's candidates share: how to make their scenarios
    (:class:`~simulator.search.candidates.CandidateScenarios`) and their layer terms,
    computed once per layer key in this process."""

    def __init__(self, base: Scenario) -> None:
        self.scenarios = CandidateScenarios(base)
        self.names = self.scenarios.names
        key = base_key(base)
        self._terms = _memo(key)
        self.memo = terms.memo(key, self.names)  # the memory model's and the estimate's

    def price(self, cand: Candidate) -> Price:
        """How candidate ``cand``'s terms are computed: looked up by the knobs each reads
        (:mod:`simulator.search.terms`)."""
        return self.memo.price(cand)

    def estimate(self, s: Scenario, cand: Candidate) -> dict[str, Any]:
        """:func:`analytic_estimate` of candidate ``cand`` (whose scenario is ``s``)."""
        key = layer_key(cand, self.names)
        found = self._terms.get(key)
        if found is None:
            cost = cost_model(s)
            found = self._terms[key] = cost, layer_terms(s, cost, s.hardware)
        cost, terms = found
        return analytic_estimate(s, cost=cost, terms=terms, breakdown=False,
                                 price=self.price(cand))
