"""The planner's shared layer terms (simulator/search/shared.py) give every candidate
the estimate it gets on its own, bit for bit, in any order of the candidates."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.memory import peak_memory
from simulator.search import shared
from simulator.search.candidates import (
    Candidate,
    PlanRequest,
    base_scenario,
    candidate_scenario,
    candidates,
    knobs,
)
from simulator.search.plan import assess, assess_chunk
from simulator.search.shared import SharedTerms
from simulator.spec.scenario import Scenario
from simulator.system.profiles import load_system

# a dense model with context parallelism: every layer knob and the stage knobs vary
DENSE = PlanRequest("llama2-7b", 16, "dgx-a100-80gb", 64, seq_len=8192, micro_batches=(1, 2),
                    context_parallel=(1, 2))
DENSE_BASE = base_scenario(DENSE)
DENSE_CANDIDATES = candidates(DENSE, DENSE_BASE, variants=False)  # the first round


def moe_request(tmp: Path) -> PlanRequest:
    """Mixtral's layers, four of them with a dense first, planned with expert parallelism."""
    path = tmp / "moe.yaml"
    path.write_text(yaml.safe_dump({"preset": "mixtral-8x7b", "layers": 4, "seq_len": 8192,
                                    "first_dense_layers": 1}))
    return PlanRequest(str(path), 16, "dgx-h100", 32, micro_batches=(1, 2),
                       expert_parallel=(1, 2, 4, 8))


def _fresh(base: Scenario, cand: Candidate) -> tuple[float, float]:
    """(peak memory in GB, analytic step time) of one candidate computed on its own."""
    s = candidate_scenario(base, cand)
    return peak_memory(s).total / 1e9, analytic_estimate(s)["step_time_s"]


def _mismatches(base: Scenario, cands: Sequence[Candidate]) -> list[Candidate]:
    """Candidates whose row (a fresh memo, in the order given) differs from ``_fresh``."""
    shared._memo.cache_clear()
    out = []
    for cand, row in zip(cands, assess_chunk(base, cands)["rows"], strict=True):
        if row["fits"] and (row["peak_memory_GB"], row["analytic_step_time_s"]) \
                != _fresh(base, cand):
            out.append(cand)
    return out


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_shared_terms_equal_each_candidate_alone(rng: random.Random) -> None:
    """Any order: the first candidate of a layer key fills the memo for the others."""
    picked = rng.sample(DENSE_CANDIDATES, 40)
    assert not _mismatches(DENSE_BASE, picked)


def test_mixture_of_experts_and_every_candidate(tmp_path: Path) -> None:
    req = moe_request(tmp_path)
    base = base_scenario(req)
    cands = candidates(req, base)
    assert {c[knobs().index("ep")] for c in cands} == {1, 2, 4, 8}
    assert not _mismatches(base, cands[::13])


def test_the_memo_is_shared() -> None:
    """A few layer keys for many fitting candidates: each layer is priced once."""
    shared._memo.cache_clear()
    cands = DENSE_CANDIDATES[:1200]
    rows = assess_chunk(DENSE_BASE, cands)["rows"]
    fits = sum(r["fits"] for r in rows)
    memo = shared._memo(shared.base_key(DENSE_BASE))
    assert 0 < len(memo) * 10 < fits
    assert len(memo) == len({shared.layer_key(c) for c, r in zip(cands, rows, strict=True)
                             if r["fits"]})


# CP with its exchange (None at CP 1, p2p above: either tells CP 1 from 2)
@pytest.mark.parametrize("left_out", [("micro_batch",), ("recompute",), ("sequence_parallel",),
                                      ("cp", "cp_comm", "cp_a2a")])
def test_a_layer_knob_left_out_of_the_key_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                      left_out: tuple[str, ...]) -> None:
    """The equivalence above has power: a key without one of the layer's knobs hands a
    candidate another's terms, and some estimate moves."""
    monkeypatch.setattr(shared, "STAGE_KNOBS", shared.STAGE_KNOBS | set(left_out))
    assert _mismatches(DENSE_BASE, DENSE_CANDIDATES[::29])


def test_assess_without_a_memo_is_the_same_row() -> None:
    cand = DENSE_CANDIDATES[len(DENSE_CANDIDATES) // 2]
    alone = assess(DENSE_BASE, cand)
    shared._memo.cache_clear()
    assert alone == assess_chunk(DENSE_BASE, [cand])["rows"][0]
    assert alone["fits"] and not math.isnan(alone["analytic_step_time_s"])


def test_a_profile_edited_between_plans_is_another_memo(tmp_path: Path) -> None:
    """The memo's key is the base scenario with what its system name resolves to: the
    same file, edited, gives the plan new layer terms."""
    profile = tmp_path / "gpu.yaml"
    data = load_system("dgx-a100-80gb").model_dump(mode="json")
    profile.write_text(yaml.safe_dump(data))
    req = replace(DENSE, system=str(profile))
    first = SharedTerms(base_scenario(req))
    data["gpu"]["peak_tflops"] = {k: v / 2 for k, v in data["gpu"]["peak_tflops"].items()}
    profile.write_text(yaml.safe_dump(data))
    os.utime(profile, (1e9, 1e9))  # another modification time, however fast the write
    second = SharedTerms(base_scenario(req))
    assert first._terms is not second._terms
    assert SharedTerms(base_scenario(req))._terms is second._terms
