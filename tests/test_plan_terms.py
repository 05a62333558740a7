"""Each memoised term's key covers what it reads (:mod:`simulator.search.terms`).

A term keyed without knob k must be the same for candidates that differ in k alone (and
in the other knobs its key leaves out): for anchors drawn from a plan's enumeration,
every candidate sharing an anchor's key (the anchor with its left-out knobs perturbed
every way the plan tries) gives the term computed afresh, with no memo, equal to the
anchor's. A key that leaves out a knob the term reads is caught the same way.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from test_plan_fast import DENSE_BASE, DENSE_CANDIDATES
from test_plan_shared import moe_request

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.search.candidates import Candidate, base_scenario, candidate_scenario, candidates
from simulator.search.candidates import knobs as knob_names
from simulator.search.plan import ceiling, peak_memory_bytes
from simulator.search.terms import IGNORES, key_picker
from simulator.spec.rules import consistency_problems, not_yet_simulated
from simulator.spec.scenario import Scenario

T = TypeVar("T")
Recorded = dict[tuple[str, int], Any]


def terms_of(base: Scenario, cand: Candidate) -> Recorded | None:
    """Every term the peak, the estimate and the MFU ceiling ask for, computed afresh, by
    (name, stage);
    None for a candidate the planner does not price."""
    s = candidate_scenario(base, cand)
    if consistency_problems(s) or not_yet_simulated(s):
        return None
    seen: Recorded = {}

    def record(name: str, stage: int, compute: Callable[[], T]) -> T:
        out = seen[name, stage] = compute()
        return out

    peak_memory_bytes(s, record)
    analytic_estimate(s, breakdown=False, price=record)
    ceiling(s, record)
    return seen


def unequal_groups(base: Scenario, cands: list[Candidate], name: str,
                   ignored: frozenset[str], anchors: int = 8, most: int = 10,
                   seed: int = 0) -> tuple[int, list[str]]:
    """(groups of two or more priced candidates checked, the groups whose term ``name``
    differs) over ``anchors`` keys of ``cands`` drawn at random, keyed without
    ``ignored``, each group's members drawn at random, ``most`` of them."""
    pick = key_picker(knob_names(), ignored)
    groups: dict[Any, list[Candidate]] = defaultdict(list)
    for c in cands:
        groups[pick(c)].append(c)
    shared = [g for g in groups.values() if len(g) > 1]
    checked, bad, rng = 0, [], random.Random(seed)
    for group in rng.sample(shared, min(anchors, len(shared))):
        values: dict[int, list[Any]] = defaultdict(list)
        for c in rng.sample(group, min(most, len(group))):
            for (term, stage), value in (terms_of(base, c) or {}).items():
                if term == name:
                    values[stage].append(value)
        for stage, got in values.items():
            checked += len(got) > 1
            if any(v != got[0] for v in got):
                bad.append(f"{name} stage {stage}: {len(set(map(repr, got)))} values")
    return checked, bad


@pytest.mark.parametrize("name", sorted(IGNORES))
def test_a_term_is_the_same_whatever_its_key_leaves_out(name: str) -> None:
    checked, bad = unequal_groups(DENSE_BASE, DENSE_CANDIDATES, name, IGNORES[name])
    assert checked >= 4 and not bad


@pytest.mark.parametrize("name", sorted(IGNORES))
def test_a_term_keys_the_experts_knobs(name: str, tmp_path: Path) -> None:
    """A mixture of experts: EP and the token dispatcher besides."""
    req = moe_request(tmp_path)
    base = base_scenario(req)
    checked, bad = unequal_groups(base, candidates(req, base), name, IGNORES[name], seed=1)
    assert checked >= 4 and not bad


@pytest.mark.parametrize(("name", "read"), [("activations", "micro_batch"),
                                            ("gradients", "zero"), ("states", "zero"),
                                            ("allocator rounding", "recompute"),
                                            ("pipeline", "schedule"),
                                            ("NCCL buffers", "dp_shard")])
def test_a_key_missing_a_knob_it_reads_is_caught(name: str, read: str) -> None:
    """The check has power: keyed without a knob the term reads, some group differs."""
    _, bad = unequal_groups(DENSE_BASE, DENSE_CANDIDATES, name, IGNORES[name] | {read},
                            anchors=16)
    assert bad
