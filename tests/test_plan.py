"""The planner: enumeration, schema validation, memory pruning, ranking, the choice."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analytic import analytic_estimate
from simulator.api import simulate_scenario
from simulator.cache import ResultCache
from simulator.cli import main
from simulator.errors import ScenarioError, UserError
from simulator.memory import peak_memory
from simulator.plan import (
    KNOBS,
    PlanRequest,
    assess,
    base_scenario,
    candidate_scenario,
    candidates,
    pareto_mask,
    run_plan,
)
from simulator.scenario import load_scenario, scenario_from_dict

SCENARIOS = Path(__file__).parent.parent / "scenarios"
# Llama-2 7B on 16 A100 (2 nodes): 32 heads, 32 layers
SMALL = PlanRequest("llama2-7b", 16, "dgx-a100-80gb", 64, seq_len=2048, top_k=3,
                    micro_batches=(1, 2, 4))
SMALL_BASE = base_scenario(SMALL)
SMALL_CANDIDATES = candidates(SMALL, SMALL_BASE)


def test_enumeration_covers_the_space_once() -> None:
    cands = SMALL_CANDIDATES
    assert len(set(cands)) == len(cands)
    # TP: divisors of 32 heads up to a node (1, 2, 4, 8); PP: divisors of 32 layers
    # dividing 16 / tp; DP the rest
    pairs = {(c[0], c[1]) for c in cands}
    assert pairs == {(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8, 16) if 16 % (t * p) == 0}
    for tp, pp, dp, schedule, v, zero, recompute, sp, b in cands:
        assert tp * pp * dp == 16
        assert (schedule == "interleaved") == (v > 1)
        assert v == 1 or (32 // pp) % v == 0
        assert pp > 1 or schedule == "1f1b"  # one stage: every schedule is the same step
        assert tp > 1 or not sp
        assert b * dp <= 64 and zero in (0, 1, 2, 3) and recompute in ("none", "selective",
                                                                        "full")
    # the count, factor by factor: (tp, pp) -> schedules x 4 ZeRO x 3 recompute x SP x b
    def schedules(pp: int) -> int:
        return 1 if pp == 1 else 3 + sum(1 for v in range(2, 33) if (32 // pp) % v == 0)

    def batches(dp: int) -> int:
        return sum(1 for b in (1, 2, 4) if b * dp <= 64)

    expected = sum(schedules(p) * 12 * (2 if t > 1 else 1) * batches(16 // (t * p))
                   for t, p in pairs)
    assert len(cands) == expected


def test_tp_beyond_node_only_when_asked() -> None:
    req = PlanRequest("llama2-7b", 32, "dgx-a100-80gb", 64, micro_batches=(1,))
    assert max(c[0] for c in candidates(req, base_scenario(req))) == 8
    wide = PlanRequest("llama2-7b", 32, "dgx-a100-80gb", 64, micro_batches=(1,),
                       tp_beyond_node=True)
    assert max(c[0] for c in candidates(wide, base_scenario(wide))) == 32


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SMALL_CANDIDATES))
def test_verdict_is_the_schema_verdict(cand: tuple) -> None:  # type: ignore[type-arg]
    """A candidate is invalid exactly when the full scenario validation rejects it, and its
    memory peak and estimate are memory.py's and analytic.py's."""
    row = assess(SMALL_BASE, cand)
    data = candidate_scenario(SMALL_BASE, cand).to_dict()
    try:
        s = scenario_from_dict(data)
    except ScenarioError as exc:
        assert row["error"] == "; ".join(exc.lines())
        return
    assert row["error"] == ""
    assert row["peak_memory_GB"] * 1e9 == pytest.approx(peak_memory(s).total, rel=1e-12)
    assert row["fits"] == peak_memory(s).fits
    if row["fits"]:
        assert row["analytic_step_time_s"] == analytic_estimate(s)["step_time_s"]


def test_invalid_candidates_are_counted_not_raised() -> None:
    # 1536 = 3 * 512: dp 1024 divides no global batch of 1536 -> invalid rows
    req = PlanRequest("gpt3-175b", 1024, "dgx-a100-80gb", 1536, top_k=0, micro_batches=(1,),
                      schedules=("1f1b", "interleaved"), zero_stages=(0,),
                      recompute=("none",))
    plan = run_plan(req, ThreadPoolExecutor(1))
    bad = plan.table[plan.table["error"] != ""]
    assert plan.counts["invalid"] == len(bad) > 0
    assert bad["error"].str.contains("global_batch").all()
    assert plan.counts["candidates"] == (plan.counts["invalid"] + plan.counts["out_of_memory"]
                                         + plan.counts["fit"])


def test_pareto_mask() -> None:
    memory = pd.Series([10.0, 20.0, 30.0, 15.0, 20.0])
    step = pd.Series([5.0, 3.0, 3.0, 6.0, 2.0])
    assert list(pareto_mask(memory, step)) == [True, False, False, False, True]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=25))
def test_pareto_mask_is_the_non_dominated_set(points: list[tuple[int, int]]) -> None:
    memory = pd.Series([float(m) for m, _ in points])
    step = pd.Series([float(t) for _, t in points])
    mask = pareto_mask(memory, step)
    for i, (m, t) in enumerate(points):
        dominated = any((m2 <= m and t2 < t) or (m2 < m and t2 <= t) for m2, t2 in points)
        # among equal points the first is kept
        duplicate = any(points[j] == (m, t) and mask[j] for j in range(i))
        assert mask[i] == (not dominated and not duplicate)


def test_plan_ranks_simulates_and_chooses(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path / "cache")
    plan = run_plan(SMALL, ThreadPoolExecutor(2), cache)
    t = plan.table
    assert len(t) == len(SMALL_CANDIDATES) and cache.stored == 3
    sim = t[t["engine_step_time_s"].notna()]
    fits = t[t["fits"]]
    # the simulated ones are the best three by the estimate
    assert sorted(sim.index) == sorted(fits.nsmallest(3, "analytic_step_time_s").index)
    assert plan.chosen == sim["engine_step_time_s"].idxmin() and t["chosen"].sum() == 1
    chosen = candidate_scenario(SMALL_BASE, tuple(t.loc[plan.chosen, list(KNOBS)]))
    results, _ = simulate_scenario(chosen, "engine", "folded")
    assert t.loc[plan.chosen, "engine_step_time_s"] == results["step_time_s"]
    # a second plan computes nothing: all three engine runs come from the cache
    again = run_plan(SMALL, ThreadPoolExecutor(2), ResultCache(tmp_path / "cache"))
    assert again.chosen == plan.chosen
    pd.testing.assert_series_equal(again.table["engine_step_time_s"], t["engine_step_time_s"])


def test_cli_plan_writes_table_figure_and_summary(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    assert main(["plan", "--model", "llama2-7b", "--gpus", "16", "--system", "dgx-a100-80gb",
                 "--global-batch", "64", "--micro-batches", "1,2", "--top", "2", "--workers",
                 "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "candidates considered" in text and "best: TP" in text
    table = pd.read_csv(out / "plan.csv")
    parquet = pd.read_parquet(out / "plan.parquet")
    assert list(parquet.columns) == list(table.columns) and len(parquet) == len(table)
    pd.testing.assert_series_equal(parquet["analytic_step_time_s"],
                                   table["analytic_step_time_s"])
    meta = json.loads((out / "plan.json").read_text())
    assert meta["counts"]["candidates"] == len(table) and meta["gpu_memory_GB"] == 80
    assert meta["chosen"]["engine_step_time_s"] == table["engine_step_time_s"].min()
    assert (out / "pareto.png").stat().st_size > 10_000
    (out / "pareto.png").unlink()
    assert main(["plot", str(out)]) == 0 and (out / "pareto.png").exists()


@pytest.mark.parametrize(("args", "needle"), [
    (["--gpus", "12"], "--gpus = 12"),
    (["--model", "gpt-5"], "--model = 'gpt-5': not a model preset; did you mean 'gpt3-175b'?"),
    (["--micro-batches", "1,x"], "--micro-batches"),
    (["--global-batch", "0"], "--global-batch = 0"),
    (["--system", "nope"], "--system = 'nope': not a preset"),
])
def test_cli_plan_bad_input(args: list[str], needle: str, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--model": "llama2-7b", "--gpus": "16", "--system": "dgx-a100-80gb",
            "--global-batch": "64", "--out": str(tmp_path)}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = ["plan", *(x for kv in base.items() for x in kv), "--top", "0", "--workers", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def _bundled(model: str, gpus: int) -> list[Path]:
    out = []
    for path in sorted(SCENARIOS.glob("*.yaml")):
        s = load_scenario(path)
        # the plan compares symmetric layouts: a straggler variant is not one
        if s.model.preset == model and s.parallel.world == gpus and not s.variability.active:
            out.append(path)
    return out


def _at_least_as_fast_as_bundled(req_kwargs: dict, top_k: int) -> None:  # type: ignore[type-arg]
    paths = _bundled("gpt3-175b", 1024)
    assert paths, "a bundled GPT-3 175B scenario on 1,024 GPUs"
    for path in paths:
        s = load_scenario(path)
        req = PlanRequest("gpt3-175b", 1024, s.cluster.system, s.training.global_batch,
                          s.model.seq_len, top_k=top_k, **req_kwargs)
        plan = run_plan(req, ThreadPoolExecutor(2))
        bundled, _ = simulate_scenario(s, "engine", "folded")
        assert plan.chosen is not None
        assert plan.table.loc[plan.chosen, "engine_step_time_s"] <= bundled["step_time_s"]


def test_plan_beats_the_bundled_gpt3_scenario_reduced_search() -> None:
    """A reduced search (one micro-batch size, two schedules, no ZeRO-3, no full
    recompute) already finds a layout at least as fast as the bundled one."""
    _at_least_as_fast_as_bundled({"micro_batches": (1,), "schedules": ("1f1b", "interleaved"),
                                  "zero_stages": (0, 1), "recompute": ("none", "selective")},
                                 top_k=1)


@pytest.mark.slow
def test_full_plans_consider_ten_thousand_candidates() -> None:
    _at_least_as_fast_as_bundled({}, top_k=5)
    for req in (PlanRequest("gpt3-175b", 1024, "dgx-a100-80gb", 1536, top_k=0),
                PlanRequest("llama3-70b", 512, "dgx-h100", 1024, 8192, top_k=0)):
        plan = run_plan(req, ThreadPoolExecutor(1))
        assert plan.counts["candidates"] >= 10_000 and plan.counts["fit"] > 0


def test_base_scenario_rejects_what_no_candidate_can_fix() -> None:
    with pytest.raises(UserError, match="--gpus"):
        base_scenario(PlanRequest("llama2-7b", 12, "dgx-a100-80gb", 64))
    assert base_scenario(PlanRequest("llama2-7b", 4, "dgx-a100-80gb", 64)).cluster.gpus == 4
