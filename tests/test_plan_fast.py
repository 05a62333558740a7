"""The planner's first pass computed the fast way equals the slow way, bit for bit.

The fast way: the estimate's step time alone (``analytic_estimate(..., breakdown=False)``),
the memory model's and the estimate's terms looked up by the knobs each reads
(:mod:`simulator.search.terms`),
schedule makespans from each schedule's order worked out once
(:func:`simulator.schedules.action.makespan`), collectives priced once per plan
(:func:`simulator.strategies.timing.collective_time`), layer placements and the GPU's
best kernel efficiency looked up. The slow way: every candidate's scenario priced on
its own with none of those memos (each emptied and kept empty) and the full estimate.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plan_shared import moe_request

from simulator.analysis import ceiling
from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.ceiling import mfu_ceiling
from simulator.builder.workload import layout_of
from simulator.schedules import registry as schedules
from simulator.schedules.action import execute, makespan
from simulator.search import shared, terms
from simulator.search.candidates import (
    Candidate,
    PlanRequest,
    base_scenario,
    candidate_scenario,
    candidates,
    knobs,
)
from simulator.search.headroom import DEFAULT_HEADROOM
from simulator.search.plan import assess_chunk, peak_memory_bytes, usable_bytes
from simulator.spec import placement
from simulator.spec.rules import consistency_problems, not_yet_simulated
from simulator.spec.scenario import Scenario
from simulator.strategies import timing

# a dense model with context parallelism and every schedule (ZB-V and DualPipe makespans)
DENSE = PlanRequest("llama2-7b", 32, "dgx-a100-80gb", 64, seq_len=8192, micro_batches=(1, 2),
                    context_parallel=(1, 2))


class _Forgetful(dict):  # type: ignore[type-arg]
    """A memo that keeps nothing: every lookup misses."""

    def __setitem__(self, key: Any, value: Any) -> None:
        """Drop the value (the slow way prices everything afresh)."""


def _forget(m: pytest.MonkeyPatch) -> None:
    """The slow way: every memo of the fast one empty and kept empty, and the ZB-V and
    DualPipe makespans placed by the executor."""
    m.setattr(timing, "_priced", lambda hw: _Forgetful())
    m.setattr(placement, "_RUNS", _Forgetful())
    m.setattr(ceiling, "_BEST", _Forgetful())
    m.setattr("simulator.schedules.zbv.makespan", _executed)
    m.setattr("simulator.schedules.dualpipe.makespan", _executed)


@pytest.fixture
def no_memos(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The slow way (:func:`_forget`)."""
    _forget(monkeypatch)
    yield


def _executed(schedule: Any, f: float, b: float, w: float) -> float:
    timed = execute(schedule, t_f=f, t_b=b, t_w=w)
    return max(t.end for t in timed) - min(t.start for t in timed)


def _slow_row(base: Scenario, cand: Candidate) -> dict[str, Any]:
    """The row's figures computed for the candidate alone, the full estimate's."""
    s = candidate_scenario(base, cand)
    if consistency_problems(s) or not_yet_simulated(s):
        return {"verdict": "invalid or not yet simulated"}
    peak = peak_memory_bytes(s)
    if peak > usable_bytes(s, DEFAULT_HEADROOM):  # the requests' headroom
        return {"verdict": "out of memory", "peak_memory_GB": peak / 1e9}
    return {"verdict": "fits", "peak_memory_GB": peak / 1e9,
            "analytic_step_time_s": analytic_estimate(s)["step_time_s"],
            "mfu_ceiling": mfu_ceiling(s)}


def _fast_row(row: dict[str, Any]) -> dict[str, Any]:
    if row["verdict"] in ("invalid", "not yet simulated"):
        return {"verdict": "invalid or not yet simulated"}
    keys = ["verdict", "peak_memory_GB"] + (
        ["analytic_step_time_s", "mfu_ceiling"] if row["verdict"] == "fits" else [])
    return {k: row[k] for k in keys}


DENSE_BASE = base_scenario(DENSE)
DENSE_CANDIDATES = candidates(DENSE, DENSE_BASE)


def _compare(base: Scenario, cands: list[Candidate], monkeypatch: pytest.MonkeyPatch
             ) -> list[tuple[Candidate, dict[str, Any], dict[str, Any]]]:
    """(candidate, fast, slow) where they differ: the fast rows first, the memos warm."""
    shared._memo.cache_clear()
    terms.memo.cache_clear()
    fast = [_fast_row(r) for r in assess_chunk(base, cands)["rows"]]
    with monkeypatch.context() as m:
        _forget(m)
        slow = [_slow_row(base, c) for c in cands]
    return [(c, f, s) for c, f, s in zip(cands, fast, slow, strict=True) if f != s]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_fast_rows_equal_slow_rows(rng: Any) -> None:
    """Any candidates in any order (the memos filled by those before)."""
    picked = rng.sample(DENSE_CANDIDATES, 30)
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert not _compare(DENSE_BASE, picked, monkeypatch)


def test_every_schedule_is_priced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample holds fitting candidates of ZB-V and DualPipe, whose makespans the
    executor places."""
    by_schedule = {name: [c for c in DENSE_CANDIDATES if name in c] for name in
                   ("zbv", "dualpipe")}
    picked = [c for cands in by_schedule.values() for c in cands[::90]]
    rows = assess_chunk(DENSE_BASE, picked)["rows"]
    assert {r["schedule"] for r in rows if r["fits"]} == {"zbv", "dualpipe"}
    assert not _compare(DENSE_BASE, picked, monkeypatch)


def test_mixture_of_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    req = moe_request(tmp_path)
    base = base_scenario(req)
    cands = candidates(req, base)
    assert not _compare(base, cands[::40], monkeypatch)


class _Blind(dict):  # type: ignore[type-arg]
    """A placement memo blind to the pipeline's depth (the key's second field)."""

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(key[:1] + key[2:], default)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key[:1] + key[2:], value)


def test_a_memo_blind_to_a_field_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison has power: a placement memo blind to the pipeline's depth hands
    one depth's layers to another's candidates, and some row moves."""
    picked = DENSE_CANDIDATES[::300]
    assert len({c[knobs().index("pp")] for c in picked}) > 2
    with monkeypatch.context() as m:
        m.setattr(placement, "_RUNS", _Blind())
        shared._memo.cache_clear()
        fast = [_fast_row(r) for r in assess_chunk(DENSE_BASE, picked)["rows"]]
    slow = [_slow_row(DENSE_BASE, c) for c in picked]
    assert fast != slow


def test_a_terms_key_blind_to_a_knob_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison has power over the terms memo too: activations keyed without the
    micro-batch hand one micro-batch's to another's candidates, and some row moves."""
    picked = DENSE_CANDIDATES[:1200:4]
    monkeypatch.setitem(terms.IGNORES, "activations",
                        terms.IGNORES["activations"] | {"micro_batch"})
    assert _compare(DENSE_BASE, picked, monkeypatch)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(schedules.SCHEDULES)), p=st.integers(1, 6),
       m=st.integers(1, 12), v=st.integers(1, 3),
       times=st.tuples(*[st.floats(0.0, 4.0, allow_subnormal=False)] * 3))
def test_makespan_is_the_executed_one(name: str, p: int, m: int, v: int,
                                      times: tuple[float, float, float]) -> None:
    """The order worked out once gives the executor's makespan, bit for bit."""
    try:
        sched = schedules.build_schedule(name, p, m, v)
    except ValueError:
        return
    f, b, w = times
    assert makespan(sched, f, b, w) == _executed(sched, f, b, w)


def test_collectives_priced_once_are_the_same(no_memos: None) -> None:
    """A collective priced with and without the memo (the fixture empties it)."""
    s = candidate_scenario(DENSE_BASE, DENSE_CANDIDATES[0])
    layout = layout_of(s)
    group = tuple(range(16))
    alone = timing.collective_time(s, layout, "all_reduce", 3e8, group, s.hardware)
    memo: dict[Any, float] = {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(timing, "_priced", lambda hw: memo)
        first = timing.collective_time(s, layout, "all_reduce", 3e8, group, s.hardware)
        again = timing.collective_time(s, layout, "all_reduce", 3e8, group, s.hardware)
    assert alone == first == again and len(memo) == 1 and not math.isnan(alone)
