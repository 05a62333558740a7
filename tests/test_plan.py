"""The planner: enumeration, schema validation, memory pruning, ranking, the choice."""

from __future__ import annotations

import json
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.memory import peak_memory
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.errors import ScenarioError, UserError
from simulator.outputs.plots.search import pareto_figure
from simulator.outputs.search_files import write_plan
from simulator.search.cache import ResultCache
from simulator.search.candidates import (
    KNOBS,
    PlanRequest,
    base_scenario,
    candidate_scenario,
    candidates,
)
from simulator.search.headroom import DEFAULT_HEADROOM
from simulator.search.plan import (
    assess,
    degrees_label,
    pareto_mask,
    peak_memory_bytes,
    plan_lines,
    resimulated,
    run_plan,
    usable_bytes,
)
from simulator.spec.load import load_scenario, scenario_from_dict
from simulator.spec.rules import consistency_problems, not_yet_simulated
from simulator.strategies.context.strategy import CP_MIN_TOKENS, cp_degrees
from simulator.strategies.expert.strategy import expert_parallel_problems

SCENARIOS = Path(__file__).parent.parent / "scenarios"
# Llama-2 7B on 16 A100 (2 nodes): 32 heads, 32 layers
SMALL = PlanRequest("llama2-7b", 16, "dgx-a100-80gb", 64, seq_len=2048, top_k=3,
                    micro_batches=(1, 2, 4))
SMALL_BASE = base_scenario(SMALL)
SMALL_CANDIDATES = candidates(SMALL, SMALL_BASE, variants=False)  # the first round


def test_enumeration_covers_the_space_once() -> None:
    cands = SMALL_CANDIDATES
    assert len(set(cands)) == len(cands)
    # TP: divisors of 32 heads up to a node (1, 2, 4, 8); PP: divisors of 32 layers
    # dividing 16 / tp; DP the rest
    pairs = {(c[0], c[2]) for c in cands}
    assert pairs == {(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8, 16) if 16 % (t * p) == 0}
    for (tp, cp, pp, dp, ep, schedule, v, zero, recompute, modules, sp, b, cp_comm, cp_a2a,
         dispatcher, dp_shard) in cands:
        # 2,048 tokens: below two CP chunks of CP_MIN_TOKENS; a dense model: no EP
        assert cp == 1 and ep == 1 and tp * pp * dp == 16
        # the first round: no variant (simulator/search/dominance.py); no CP exchange or
        # dispatcher to choose
        assert modules is cp_comm is cp_a2a is dispatcher is dp_shard is None
        assert (schedule in ("interleaved", "zbv", "dualpipe")) == (v > 1)
        assert v == 1 or (32 // pp) % v == 0 or schedule == "dualpipe"
        assert schedule not in ("zbv", "dualpipe") or v == 2  # two chunks per rank
        assert pp > 1 or schedule == "1f1b"  # one stage: every schedule is the same step
        assert tp > 1 or not sp
        assert b * dp <= 64 and zero in (0, 1, 2, 3) and recompute in ("none", "selective",
                                                                        "full")
    # the count, factor by factor: (tp, pp) -> schedules x 4 ZeRO x 3 recompute x SP x b
    def schedules(pp: int) -> int:
        return 1 if pp == 1 else 3 + sum(1 for v in range(2, 33) if (32 // pp) % v == 0) \
            + ((32 // pp) % 2 == 0) + 1  # zbv, dualpipe (two whole model stages)

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
    assert row["fits"] == (peak_memory(s).total <= usable_bytes(s, DEFAULT_HEADROOM))
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
    sim = t[t["engine_step_time_s"].notna()]
    fits = t[t["fits"]]
    # the simulated ones are the best three by the estimate and the best of each ZeRO
    # stage x CP degree besides
    order = fits.sort_values(["analytic_step_time_s", "peak_memory_GB"], kind="stable")
    families = order.groupby(["zero", "cp"]).head(1).index
    assert set(sim.index) == set(order.index[:3]) | set(families)
    # the first round's rows, then the variants that could win
    n = len(SMALL_CANDIDATES)
    assert [tuple(r) for r in t[list(KNOBS)].head(n).astype(object).where(
        t.head(n).notna(), None).itertuples(index=False)] == SMALL_CANDIDATES
    assert len(t) == plan.counts["candidates"] > n and cache.stored == len(sim) > 3
    assert plan.chosen == sim["engine_step_time_s"].idxmin() and t["chosen"].sum() == 1
    chosen = candidate_scenario(SMALL_BASE, tuple(t.loc[plan.chosen, list(KNOBS)]))
    results, _ = simulate_scenario(chosen, "engine", "folded")
    assert t.loc[plan.chosen, "engine_step_time_s"] == results["step_time_s"]
    # a second plan computes nothing: every engine run comes from the cache
    again = run_plan(SMALL, ThreadPoolExecutor(2), ResultCache(tmp_path / "cache"))
    assert again.chosen == plan.chosen
    pd.testing.assert_series_equal(again.table["engine_step_time_s"], t["engine_step_time_s"])


def test_resimulated_adds_each_familys_best_once() -> None:
    """The K best by the estimate, then the best of each ZeRO stage and CP degree not
    among them, in estimate order; none at all for K = 0."""
    rows = pd.DataFrame({"zero": [3, 3, 3, 2, 1, 2, 3], "cp": [2, 2, 1, 1, 1, 2, 2],
                         "analytic_step_time_s": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.05],
                         "peak_memory_GB": [50.0] * 7})
    assert resimulated(rows, 2) == [0, 6, 2, 3, 4, 5]
    assert resimulated(rows, 0) == []
    assert resimulated(rows, 10) == [0, 6, 1, 2, 3, 4, 5]


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
    (["--context-parallel", "1,0"], "--context-parallel = '1,0': expected positive"),
    (["--expert-parallel", "1,2"], "llama2-7b has no routed experts"),
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


# ---------------------------------------------------------------- CP and EP

# one schedule, ZeRO stage, recompute mode, micro-batch and dispatcher: the CP and EP
# axes alone
ONE_EACH = {"micro_batches": (1,), "schedules": ("1f1b",), "zero_stages": (1,),
            "recompute": ("selective",), "recompute_modules": (), "dispatchers": ("alltoall",),
            "cp_comm": ("p2p",)}
# Mixtral 8x7B (8 experts, 32 layers) on 16 H100, ZeRO-1 or ZeRO-3
MOE = PlanRequest("mixtral-8x7b", 16, "dgx-h100", 32, seq_len=4096, top_k=2,
                  **{**ONE_EACH, "zero_stages": (1, 3)})


@pytest.mark.parametrize(("seq_len", "expected"), [
    (2048, (1,)), (4096, (1,)), (8192, (1, 2)), (16384, (1, 2, 4)),
    (131072, (1, 2, 4, 8, 16, 32)),
])
def test_default_cp_keeps_cp_min_tokens_on_each_rank(seq_len: int,
                                                     expected: tuple[int, ...]) -> None:
    req = PlanRequest("llama3-8b", 16, "dgx-h100", 64, seq_len=seq_len)
    assert cp_degrees(req, base_scenario(req)) == expected
    assert min(seq_len // cp for cp in expected) >= min(seq_len, CP_MIN_TOKENS)


def test_cp_candidates_for_long_sequences_only() -> None:
    long = PlanRequest("llama3-8b", 16, "dgx-h100", 64, **ONE_EACH)  # the preset's 8,192
    cands = candidates(long, base_scenario(long))
    # TP up to a node, PP dividing 32 layers, CP 1 or 2, DP the rest of 16
    assert {c[:4] for c in cands} == {(t, cp, p, 16 // (t * cp * p)) for t in (1, 2, 4, 8)
                                      for cp in (1, 2) for p in (1, 2, 4, 8, 16)
                                      if 16 % (t * cp * p) == 0}
    short = replace(long, seq_len=4096)
    assert {c[1] for c in candidates(short, base_scenario(short))} == {1}
    # a mixture of experts has no CP workload yet: none by default, however long
    mixtral = PlanRequest("mixtral-8x7b", 16, "dgx-h100", 32)
    assert base_scenario(mixtral).model.seq_len == 32768
    assert cp_degrees(mixtral, base_scenario(mixtral)) == (1,)


def test_requested_cp_is_judged_by_the_schema() -> None:
    # 6,002 tokens: two chunks of 3,001 for CP 2 are not whole (2 * cp must divide them)
    req = PlanRequest("llama3-8b", 8, "dgx-h100", 16, seq_len=6002, context_parallel=(1, 2, 3),
                      **ONE_EACH)
    base = base_scenario(req)
    cands = candidates(req, base)
    assert {c[1] for c in cands} == {1, 2}  # 3 divides no layout of 8 GPUs
    rows = [assess(base, cand) for cand in cands]
    assert all(r["verdict"] == "invalid" and "parallel.cp = 2" in r["error"]
               for r in rows if r["cp"] == 2)
    assert any(r["verdict"] == "fits" for r in rows if r["cp"] == 1)


def test_ep_candidates_only_for_experts_and_each_valid() -> None:
    base = base_scenario(MOE)
    cands = candidates(MOE, base)
    by_stage: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for cand in cands:
        by_stage[cand[:4]].add(cand[4])
    # every divisor of the 8 experts that divides cp * dp (expert TP = TP), and only those
    for (_, cp, _, dp), eps in by_stage.items():
        assert eps == {e for e in (1, 2, 4, 8) if (cp * dp) % e == 0}
    assert {c[4] for c in cands} == {1, 2, 4, 8}
    for cand in cands:
        assert expert_parallel_problems(candidate_scenario(base, cand)) == []
    # a requested list keeps, per stage, the degrees the stage admits
    only = candidates(replace(MOE, expert_parallel=(2, 8)), base)
    assert {c[4] for c in only} == {2, 8} and all(c[1] * c[3] % c[4] == 0 for c in only)
    # a dense model: EP 1 only, and asking for more is an error
    assert {c[4] for c in SMALL_CANDIDATES} == {1}
    with pytest.raises(UserError, match="--expert-parallel"):
        candidates(replace(SMALL, expert_parallel=(1, 2)), SMALL_BASE)


def test_moe_plan_chooses_a_layout_the_engine_runs(tmp_path: Path) -> None:
    plan = run_plan(MOE, ThreadPoolExecutor(2))
    t, c = plan.table, plan.counts
    assert c["candidates"] == len(t) == (c["invalid"] + c["not_yet_simulated"]
                                         + c["out_of_memory"] + c["fit"])
    # what the engine refuses (TP without SP) is counted, not ranked; ZeRO-3 with experts
    # is simulated (simulator/strategies/zero3/experts.py)
    refused = t[t["verdict"] == "not yet simulated"]
    assert len(refused) == c["not_yet_simulated"] > 0
    assert ((refused["tp"] > 1) & ~refused["sequence_parallel"]).all()
    assert refused["error"].str.contains("sequence_parallel = False: a mixture").all()
    assert (t.loc[t["fits"], "zero"] == 3).any()
    assert refused["analytic_step_time_s"].isna().all() and not refused["fits"].any()
    assert t.loc[t["fits"], "ep"].nunique() > 1
    assert plan.chosen is not None and c["simulated"] == 2
    best = t.loc[plan.chosen]
    s = candidate_scenario(base_scenario(MOE), tuple(best[list(KNOBS)]))
    assert not_yet_simulated(s) == []
    results, _ = simulate_scenario(s, "engine", "folded")
    assert best["engine_step_time_s"] == results["step_time_s"]
    lines = plan_lines(plan)
    assert "not yet simulated" in lines[0] and " ep " in lines[1]
    assert lines[-1].startswith(f"best: {degrees_label(best)},")
    write_plan(plan, tmp_path, plots=False)
    table = pd.read_csv(tmp_path / "plan.csv", keep_default_na=False, na_values=[""])
    fig = pareto_figure(table, json.loads((tmp_path / "plan.json").read_text()))
    assert f"({c['not_yet_simulated']:,} not yet simulated)" in fig.axes[0].get_title()
    label = next(x.get_text() for x in fig.axes[0].texts if x.get_text().startswith("chosen"))
    assert label.startswith(f"chosen: {degrees_label(best)},")


def test_peak_of_mixed_dense_and_moe_layers_is_every_stage() -> None:
    """With the first 8 of 32 layers dense, PP 4's first stage holds no experts: a
    middle stage can be the peak, which the first-and-last shortcut would miss."""
    base = base_scenario(MOE)
    base = base.model_copy(update={"model": base.model.model_copy(
        update={"first_dense_layers": 8})})
    middle = 0
    for cand in candidates(MOE, base):
        s = candidate_scenario(base, cand)
        if cand[2] == 4 and not consistency_problems(s):
            peak = peak_memory(s)
            assert peak_memory_bytes(s) == pytest.approx(peak.total, rel=1e-12)
            middle += peak.stage not in (0, 3)
    assert middle > 0


def test_degrees_label() -> None:
    assert degrees_label({"tp": 2, "cp": 2, "pp": 4, "dp": 8, "ep": 4}) == \
        "TP 2 · CP 2 · PP 4 · DP 8 · EP 4"
    # CP and EP of 1, or a table written before they were planned: not shown
    assert degrees_label({"tp": 8, "cp": 1, "pp": 16, "dp": 8, "ep": 1}) == \
        degrees_label({"tp": 8, "pp": 16, "dp": 8}) == "TP 8 · PP 16 · DP 8"


def test_plan_help_names_the_cp_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert "--context-parallel" in help_ and "--expert-parallel" in help_
    assert f">= {CP_MIN_TOKENS} tokens" in help_
