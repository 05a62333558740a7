"""The planner's own dimensions (simulator/search/space.py) and the dominance rounds
(simulator/search/dominance.py): each dimension is searched and found where it wins, no
value the schema refuses is enumerated, the rounds leave out only what a sibling shows
cannot win, and the headroom holds with them all."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.memory import peak_memory
from simulator.cli.main import main
from simulator.errors import UserError
from simulator.search.candidates import (
    PlanRequest,
    base_scenario,
    candidate_scenario,
    candidates,
    knobs,
)
from simulator.search.dominance import RULES
from simulator.search.headroom import Headroom
from simulator.search.plan import Plan, layout_label, plan_lines, run_plan
from simulator.search.space import parse_module_sets, parse_names
from simulator.spec.rules import consistency_problems, not_yet_simulated
from simulator.spec.scenario import Scenario

ONE = {"micro_batches": (1,), "schedules": ("1f1b",), "top_k": 0}
# Llama-2 13B on one node of A100-40GB, 4,096 tokens: without recomputation a stage of
# TP 2 · PP 4 needs 45 GB, with full recomputation 32 GB
TIGHT = PlanRequest("llama2-13b", 8, "dgx-a100-40gb", 32, seq_len=4096, zero_stages=(1,),
                    headroom=Headroom(), **ONE)
# Mixtral 8x7B on 16 H100 with its 8 experts over 8 ranks
MOE = PlanRequest("mixtral-8x7b", 16, "dgx-h100", 32, seq_len=4096, zero_stages=(1,),
                  recompute=("full",), recompute_modules=(), expert_parallel=(8,), **ONE)
NEW_FIELDS = ("parallel.dp_shard", "parallel.cp_comm_type", "parallel.cp_a2a",
              "parallel.moe_token_dispatcher", "parallel.recompute_modules",
              "parallel.recompute")


def _plan(req: PlanRequest) -> Plan:
    return run_plan(req, ThreadPoolExecutor(1))


def _best(plan: Plan) -> dict[str, object]:
    """The fitting row the estimate ranks first: the first the engine re-simulates."""
    t = plan.table[plan.table["fits"]]
    return dict(t.loc[t["analytic_step_time_s"].idxmin()])


# ---------------------------------------------------------------- each dimension wins somewhere


def test_a_recompute_module_set_where_only_recomputation_fits() -> None:
    plan = _plan(replace(TIGHT, sets=("parallel.tp=2", "parallel.pp=4",
                                      "parallel.sequence_parallel=true")))
    t = plan.table
    none = t[(t["recompute"] == "none")]
    assert not none["fits"].any() and t[t["recompute"] == "full"]["fits"].all()
    best = _best(plan)  # recomputing the MLP alone beats recomputing every layer
    assert (best["recompute"], best["recompute_modules"]) == ("selective", "mlp")
    assert "recompute selective (mlp)" in layout_label(best)


def test_torchtitans_per_op_policy_where_it_is_fastest_that_fits() -> None:
    plan = _plan(replace(TIGHT, sets=("parallel.tp=4", "parallel.pp=2",
                                      "parallel.sequence_parallel=false")))
    assert _best(plan)["recompute"] == "op"


def test_hybrid_sharding_where_it_is_fastest() -> None:
    # Llama-3 8B on 1,024 H100 under ZeRO-3: a shard group of whole nodes beats one of
    # 1,024 ranks (its all-gathers and reduce-scatters cross fewer nodes), and the planner
    # returns the fastest of them
    req = PlanRequest("llama3-8b", 1024, "dgx-h100", 1024, seq_len=2048, zero_stages=(3,),
                      recompute=("none",), context_parallel=(1,),
                      sets=("parallel.tp=1", "parallel.pp=1"), **ONE)
    plan = _plan(req)
    t = plan.table
    hybrid = t[t["dp_shard"].notna() & t["fits"]]
    assert _best(plan)["dp_shard"] == hybrid.loc[hybrid["analytic_step_time_s"].idxmin(),
                                                 "dp_shard"]
    full = t[t["dp_shard"].isna() & t["fits"]]["analytic_step_time_s"].min()
    assert _best(plan)["analytic_step_time_s"] < full
    # the default sizes: shard groups of whole nodes (8 GPUs), below dp
    assert set(t["dp_shard"].dropna()) == {8, 16, 32, 64, 128, 256, 512}


def test_an_all_to_all_cp_exchange_where_it_is_fastest() -> None:
    req = PlanRequest("llama3-8b", 16, "dgx-a100-80gb", 16, seq_len=65536,
                      context_parallel=(8,), zero_stages=(1,), recompute=("none",),
                      sets=("parallel.tp=1",), **ONE)
    plan = _plan(req)
    assert _best(plan)["cp_comm"] == "a2a"
    assert set(plan.table["cp_comm"]) == {"p2p", "allgather", "a2a"}  # the default list
    wide = _plan(replace(req, cp_comm=("p2p", "a2a+p2p")))
    assert (_best(wide)["cp_comm"], _best(wide)["cp_a2a"]) == ("a2a+p2p", 2)
    assert set(wide.table["cp_a2a"].dropna()) == {2, 4}  # strictly between 1 and cp


def test_a_dispatcher_where_it_is_fastest() -> None:
    plan = _plan(MOE)
    assert _best(plan)["dispatcher"] == "flex"
    assert set(plan.table["dispatcher"]) == {"alltoall", "allgather", "flex"}


@pytest.mark.slow
def test_the_engine_confirms_a_new_value() -> None:
    plan = _plan(replace(TIGHT, top_k=1, sets=("parallel.tp=4", "parallel.pp=2",
                                                "parallel.sequence_parallel=false")))
    assert plan.chosen is not None and plan.table.loc[plan.chosen, "recompute"] == "op"


# ---------------------------------------------------------------- validity


WIDE = [replace(TIGHT, recompute_modules=parse_module_sets("core_attn+layernorm,mlp,moe,"
                                                           "mla_up_proj,moe_act+layernorm")),
        replace(MOE, recompute=("none", "selective", "full", "op"),
                recompute_modules=parse_module_sets("moe_act,mlp,moe,layernorm+moe_act"),
                expert_parallel=None, zero_stages=(1, 3)),
        PlanRequest("llama3-8b", 32, "dgx-h100", 32, seq_len=32768, zero_stages=(3,),
                    cp_comm=("p2p", "allgather", "a2a", "a2a+p2p"), dp_shard=(2, 4, 8, 3),
                    context_parallel=(1, 2, 4, 8), recompute=("none", "op"), **ONE)]
ENUMERATED = [(req, cand) for req in WIDE for cand in candidates(req, base_scenario(req))]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ENUMERATED))
def test_no_enumerated_value_of_a_new_dimension_is_refused(pair: tuple) -> None:  # type: ignore[type-arg]
    """The dimensions ask the schema's own rules: no problem a whole scenario's validation
    finds names a field they set, and none is "not yet simulated"."""
    req, cand = pair
    s = candidate_scenario(base_scenario(req), cand)
    fields = {p.field for p in consistency_problems(s) + not_yet_simulated(s)}
    assert not fields & set(NEW_FIELDS), fields


def test_refused_values_are_not_enumerated() -> None:
    dense = {c for r, c in ENUMERATED if r is WIDE[0]}
    named = [dict(zip(knobs(), c, strict=True)) for c in dense]
    # no MoE or latent-attention module on a dense model, no dispatcher, no dp_shard
    # without ZeRO-3
    assert {n["recompute_modules"] for n in named} == {None, "core_attn+layernorm", "mlp"}
    assert {n["dispatcher"] for n in named} == {None} == {n["dp_shard"] for n in named}
    moe = [dict(zip(knobs(), c, strict=True)) for r, c in ENUMERATED if r is WIDE[1]]
    # op is modelled on dense layers only; flex needs expert_tp * ep > 1; hybrid
    # sharding is not simulated with experts
    assert "op" not in {n["recompute"] for n in moe}
    assert all(n["tp"] * n["ep"] > 1 for n in moe if n["dispatcher"] == "flex")
    assert {n["dp_shard"] for n in moe} == {None}
    cp = [dict(zip(knobs(), c, strict=True)) for r, c in ENUMERATED if r is WIDE[2]]
    # 3 divides no dp here; the all-to-all needs 8 kv heads / tp divisible by its degree
    assert 3 not in {n["dp_shard"] for n in cp}
    assert all(8 // n["tp"] % n["cp"] == 0 for n in cp if n["cp_comm"] == "a2a")
    assert {n["cp_comm"] for n in cp if n["cp"] == 1} == {None}


# ---------------------------------------------------------------- dominance


def test_rounds_leave_out_exactly_the_rest_of_the_space() -> None:
    """Assessed and left out together are the whole enumeration, once each."""
    for req in WIDE:
        plan = _plan(req)
        whole = candidates(req, base_scenario(req))
        assert len(plan.table) + plan.counts["dominated"] == len(whole)
        rows = plan.table[list(knobs())].astype(object).where(plan.table.notna(), None)
        assert set(map(tuple, rows.itertuples(index=False))) <= set(whole)
        n = plan.counts["dominated"]
        assert (f"{n:,} more left out, a sibling showing they cannot win" in
                plan_lines(plan)[0]) == (n > 0)
    assert plan.counts["dominated"] > 0


def _refused(s: Scenario) -> bool:
    return bool(consistency_problems(s) + not_yet_simulated(s))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ENUMERATED))
def test_the_premises_of_the_dominance_rules(pair: tuple) -> None:  # type: ignore[type-arg]
    """Each rule's premise, for a variant and its siblings (module note): a dispatcher
    is refused wherever alltoall is; hybrid sharding and CP exchanges need no less
    memory than their "fits" siblings; a recomputing policy no more than full
    recomputation and no shorter a step than none."""
    req, cand = pair
    base, names = base_scenario(req), knobs()
    for rule in RULES:
        slots = [names.index(k) for k in rule.knobs]
        if not rule.variant(tuple(cand[i] for i in slots)):
            continue
        s = candidate_scenario(base, cand)
        for values, need in rule.siblings:
            sib = list(cand)
            for i, v in zip(slots, values, strict=True):
                sib[i] = v
            t = candidate_scenario(base, tuple(sib))
            if need == "runs":
                assert _refused(s) or not _refused(t)
            elif _refused(s) or _refused(t):
                continue
            elif need == "fits":  # the sibling keeps no more
                assert peak_memory(t).total <= peak_memory(s).total * (1 + 1e-12)
            else:  # no recomputation: no longer a step
                assert analytic_estimate(t)["step_time_s"] <= analytic_estimate(s)[
                    "step_time_s"] * (1 + 1e-12)


# ---------------------------------------------------------------- headroom


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(0.0, 0.5), st.floats(0.0, 8.0))
def test_no_fitting_row_passes_the_headroom(fraction: float, gb: float) -> None:
    headroom = Headroom(fraction=fraction, GB=gb)
    plan = _plan(replace(TIGHT, headroom=headroom))
    t, usable = plan.table, 40 - headroom.bytes(40e9) / 1e9
    assert plan.usable_GB == pytest.approx(usable)
    assert (t.loc[t["fits"], "peak_memory_GB"] <= usable + 1e-9).all()
    assert (t.loc[t["verdict"] == "out of memory", "peak_memory_GB"] > usable - 1e-9).all()


# ---------------------------------------------------------------- the command


def test_parse_lists() -> None:
    assert parse_module_sets("mlp+core_attn, moe_act") == ("core_attn+mlp", "moe_act")
    assert parse_module_sets("none") == ()
    assert parse_names("--cp-comm", "a2a,p2p,a2a") == ("a2a", "p2p")
    with pytest.raises(UserError, match="--recompute-modules"):
        parse_module_sets("core_attn+attention")
    with pytest.raises(UserError, match="--moe-dispatchers"):
        parse_names("--moe-dispatchers", "deepep")


@pytest.mark.parametrize(("flag", "value"), [("--recompute", "partial"),
                                             ("--recompute-modules", "mlp+x"),
                                             ("--dp-shard", "0"), ("--cp-comm", "ring"),
                                             ("--moe-dispatchers", "alltoall,x")])
def test_cli_bad_list_is_one_line(flag: str, value: str, tmp_path: object,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama2-7b", "--gpus", "8", "--system", "dgx-a100-80gb",
            "--global-batch", "32", "--out", f"{tmp_path}/o", flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert flag in err and len(err.splitlines()) == 1, err


def test_cli_shows_the_chosen_values(tmp_path: object, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    argv = ["plan", "--model", "llama2-13b", "--gpus", "8", "--system", "dgx-a100-40gb",
            "--global-batch", "32", "--seq-len", "4096", "--micro-batches", "1",
            "--set", "parallel.schedule=1f1b", "--set", "parallel.zero=1",
            "--set", "parallel.tp=2", "--set", "parallel.pp=4",
            "--set", "parallel.sequence_parallel=true", "--headroom", "0", "--top", "1",
            "--recompute-modules", "mlp", "--no-plots", "--no-cache",
            "--out", f"{tmp_path}/o", "--workers", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert " modules " in out.splitlines()[1] and "recompute selective (mlp)" in out


def test_plan_help_names_the_new_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for flag in ("--recompute ", "--recompute-modules", "--dp-shard", "--cp-comm",
                 "--moe-dispatchers"):
        assert flag in out
