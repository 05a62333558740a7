"""ZeRO-3 under ``torch.distributed.pipelining``: FSDP2's reductions deferred to each
stage's last backward (simulator/strategies/zero3/deferred.py).

torch/distributed/pipelining/stage.py ``backward_maybe_with_nosync`` runs every backward
of an FSDP2 stage with ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)``; ``perform_reduce_grad`` (the schedule's
REDUCE_GRAD after the stage's last backward) calls each parameter group's
``post_backward`` and the root's final callback. So a unit is gathered when first used,
its gradients accumulate unsharded in the reduce dtype, and its reduce-scatter runs once
a step, after the stage's last backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.memory import memory_report, states
from simulator.analysis.memory_timeline import memory_timeline, stage_peaks
from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload, layout_of
from simulator.engine.engine import simulate
from simulator.spec.load import load_scenario, scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.strategies.zero3.buffers import (
    accumulated_grads,
    moment_words,
    zero3_layer_bytes,
)
from simulator.strategies.zero3.counts import zero3_collective_counts
from simulator.strategies.zero3.deferred import accumulate_ops, deferred, gathers

MODEL = {"layers": 8, "hidden": 512, "heads": 8, "vocab": 4096, "seq_len": 512}
# 2K tokens a micro-batch of a 1K-wide model: compute-bound enough for the closed form
# (at the toy shapes above it runs 9-15% ahead of the engine, 19-21% without deferral)
WIDER = {"layers": 8, "hidden": 1024, "heads": 8, "vocab": 32000, "seq_len": 2048}


def titan(pp: int = 2, dp: int = 2, m: int = 4, stack: Any = "torchtitan",
          method: str = "engine", model: dict[str, Any] | None = None,
          **parallel: Any) -> Scenario:
    """A small GPT under torchtitan's stack (FSDP2, torch.distributed.pipelining)."""
    return scenario_from_dict({
        "name": "deferred", "model": model or MODEL,
        "cluster": {"system": "dgx-h100", "nodes": 1, "gpus_per_node": pp * dp},
        "parallel": {"pp": pp, "dp": dp, "zero": 3, **parallel},
        "training": {"global_batch": m * dp, "micro_batch": 1},
        "stack": stack, "simulation": {"method": method}})


def spans_of(s: Scenario) -> pd.DataFrame:
    _, spans = simulate_scenario(s)
    assert spans is not None
    return spans


# ---------------------------------------------------------------- which runs defer


def test_only_fsdp2_under_torch_pipelining_defers() -> None:
    assert deferred(titan())
    assert deferred(titan(stack="pytorch-eager"))  # our measured runs' PP + FSDP2
    assert not deferred(titan(pp=1))  # no pipeline: a reduction every micro-batch
    assert not deferred(titan(stack={"preset": "torchtitan", "pipeline_runtime": "megatron"}))
    # FSDP1's module is not an FSDPModule: the stage runs its backward as it is
    assert not deferred(titan(stack={"preset": "composer-fsdp1"}))


# ---------------------------------------------------------------- gathers


def test_gathers_worked_examples() -> None:
    """Stage 0 of 1F1B with p = 2, m = 4 runs F F B F B F B B: without resharding after
    forward one forward gather; with it F0 and F1 gather (each resharded after), B0
    gathers and keeps the unit, F2 finds it held (then reshards), B1 and B2 gather,
    B3 finds it held: (2, 3). The last stage, F B F B F B F B: (1, 4)."""
    first = ["F", "F", "B", "F", "B", "F", "B", "B"]
    last = ["F", "B", "F", "B", "F", "B", "F", "B"]
    assert gathers(first, False) == (1, 0)
    assert gathers(first, True) == (2, 3)
    assert gathers(last, True) == (1, 4)
    assert gathers(["F", "I", "W", "F", "I", "W"], True) == (1, 2)  # W needs no parameters


@pytest.mark.parametrize("case", [
    pytest.param({}, id="1f1b"),
    pytest.param({"reshard_after_forward": True}, id="1f1b-reshard"),
    pytest.param({"schedule": "gpipe", "reshard_after_forward": True}, id="gpipe-reshard"),
    pytest.param({"schedule": "zb-h1"}, id="zb-h1"),
    pytest.param({"schedule": "interleaved", "virtual_stages": 2}, id="interleaved"),
    pytest.param({"schedule": "interleaved", "virtual_stages": 2,
                  "reshard_after_forward": True}, id="interleaved-reshard"),
    pytest.param({"schedule": "zbv", "virtual_stages": 2}, id="zbv"),  # two roots on rank 0
])
def test_counts_are_the_engines(case: dict[str, Any]) -> None:
    """zero3_collective_counts gives what the engine issues on every simulated rank:
    each unit's gathers by the state of its parameters, one reduce-scatter a unit a
    step, one clipping-norm all-reduce."""
    s = titan(**{"reshard_after_forward": False, **case})
    spans = spans_of(s)
    for rank, g in spans.groupby("rank"):
        stage = layout_of(s).coord(int(rank)).pp
        got = {"all_gather": int(g["op"].str.endswith(".all_gather").sum()),
               "reduce_scatter": int(g["op"].str.endswith(".reduce_scatter").sum()),
               "all_reduce": int((g["op"] == "dp.all_reduce").sum())}
        assert got == zero3_collective_counts(s, stage), (rank, case)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipe"])
@pytest.mark.parametrize("reshard", [True, False])
def test_counts_without_deferral_on_two_stage_ranks(schedule: str, reshard: bool) -> None:
    """Reducing every micro-batch (a Megatron pipeline runtime), the counts still follow
    the engine where a rank holds two stages: under ZBV's V placement rank 0 holds the
    embedding's stage and the head's, two FSDP2 roots; a DualPipe rank runs each
    micro-batch through one of its two stages (DeepSeek's two directions, which torch's
    pipelining does not run: no deferral)."""
    s = titan(pp=4, m=8, schedule=schedule, virtual_stages=2, reshard_after_forward=reshard,
              stack={"preset": "torchtitan", "pipeline_runtime": "megatron"})
    assert not deferred(s)
    if schedule == "dualpipe":
        assert not deferred(titan(pp=4, m=8, schedule=schedule, virtual_stages=2))
    for rank, g in spans_of(s).groupby("rank"):
        want = zero3_collective_counts(s, layout_of(s).coord(int(rank)).pp)
        assert int(g["op"].str.endswith(".all_gather").sum()) == want["all_gather"]
        assert int(g["op"].str.endswith(".reduce_scatter").sum()) == want["reduce_scatter"]


@settings(max_examples=25, deadline=None)
@given(m=st.integers(2, 12), pp=st.sampled_from([2, 4]), reshard=st.booleans(),
       schedule=st.sampled_from(["1f1b", "gpipe", "zb-h1"]))
def test_deferral_issues_fewer_collectives_and_reductions_independent_of_m(
        m: int, pp: int, reshard: bool, schedule: str) -> None:
    """Against the same run reducing every micro-batch: never more gathers, and
    reduce-scatters once a step whatever the micro-batch count."""
    s = titan(pp=pp, m=m, reshard_after_forward=reshard, schedule=schedule)
    eager = titan(pp=pp, m=m, reshard_after_forward=reshard, schedule=schedule,
                  stack={"preset": "torchtitan", "pipeline_runtime": "megatron"})
    one = titan(pp=pp, m=1, reshard_after_forward=reshard, schedule=schedule) \
        if schedule != "zb-h1" else None
    for stage in range(pp):
        got, before = zero3_collective_counts(s, stage), zero3_collective_counts(eager, stage)
        assert got["all_gather"] <= before["all_gather"]
        assert got["reduce_scatter"] * m == before["reduce_scatter"]
        if one is not None:
            assert got["reduce_scatter"] == zero3_collective_counts(one, stage)["reduce_scatter"]


# ---------------------------------------------------------------- the timeline


def test_reductions_run_after_the_stages_last_backward_and_the_compute_waits() -> None:
    """Every reduce-scatter starts after the rank's last backward compute; the compute
    stream's reduce wait ends with the last of them; the optimizer step after it."""
    spans = spans_of(titan(m=6))
    for _, g in spans.groupby("rank"):
        backward = g[g["op"].isin(["B", "I", "W"])]
        rs = g[g["op"] == "dp.reduce_scatter"]
        assert len(rs) and rs["start"].min() >= backward["end"].max() - 1e-12
        wait = g[g["name"].str.startswith("zero3.reduce_wait")]
        assert len(wait) == 1
        assert wait["end"].iloc[0] == pytest.approx(rs["end"].max(), rel=1e-12)
        step = g[g["name"] == "optimizer step"]
        assert step["start"].iloc[0] >= rs["end"].max() - 1e-12


def test_each_backward_accumulates_every_unit_in_the_reduce_dtype() -> None:
    """torchtitan reduces in fp32 from bf16 gradients: the first backward casts each
    unit's (2 + 4 bytes an element), the later ones add (2 + 4 + 4); a bf16 reduction
    adds on the later ones only (autograd's accumulation: 2 + 2 + 2)."""
    s = titan()
    cast, add = accumulate_ops(s, 1e6, True), accumulate_ops(s, 1e6, False)
    assert [op.bytes for op in cast] == [6e6] and [op.bytes for op in add] == [10e6]
    bf16 = titan(stack={"preset": "torchtitan", "grad_reduce_dtype": "param"})
    assert accumulate_ops(bf16, 1e6, True) == ()
    assert [op.bytes for op in accumulate_ops(bf16, 1e6, False)] == [6e6]
    spans = spans_of(s)
    for _, g in spans.groupby("rank"):
        acc = g[g["name"].str.contains("grad_to_reduce_dtype|grad_accumulate")]
        units = int(g["op"].str.endswith(".reduce_scatter").sum())
        assert len(acc) == units * s.microbatches


# ---------------------------------------------------------------- time


@pytest.mark.parametrize("case", [
    pytest.param({}, id="1f1b"),
    pytest.param({"reshard_after_forward": True}, id="1f1b-reshard"),
    pytest.param({"schedule": "gpipe"}, id="gpipe"),
    pytest.param({"schedule": "zb-h1"}, id="zb-h1"),
    pytest.param({"m": 8, "dp": 4}, id="dp4-m8"),
])
def test_closed_form_follows_the_engine(case: dict[str, Any]) -> None:
    """The closed form charges each unit's gathers by their count and the stage's whole
    reduction after its last backward; it follows the engine within 3%."""
    steps = {method: simulate_scenario(titan(method=method, model=WIDER, **case))[0]
             ["step_time_s"] for method in ("engine", "analytic")}
    assert steps["analytic"] == pytest.approx(steps["engine"], rel=0.03)


@pytest.mark.parametrize("m", [4, 8])
def test_closed_form_interleaved(m: int) -> None:
    """Interleaved 1F1B: the rank's last chunk's reductions alone after its last
    backward, the other chunk's beside one chunk's backward. Within 8% of the engine
    (5-6% short; the same runs reducing every micro-batch read 13-15% short)."""
    steps = {method: simulate_scenario(titan(method=method, model=WIDER, m=m,
                                             schedule="interleaved", virtual_stages=2))[0]
             ["step_time_s"] for method in ("engine", "analytic")}
    assert steps["analytic"] == pytest.approx(steps["engine"], rel=0.08)


def test_deferral_exposes_the_whole_reduction_once() -> None:
    """Against the same run reducing every micro-batch (its reductions hidden behind
    each backward but m of them): the deferred run's exposed reduction is one whole
    reduction, so it grows with the reduction, not with m."""
    res = {m: simulate_scenario(titan(m=m))[0] for m in (4, 8)}
    exposed = {m: r["exposed_comm_s"]["dp"] for m, r in res.items()}
    assert exposed[4] > 0
    assert exposed[8] == pytest.approx(exposed[4], rel=0.05)


# ---------------------------------------------------------------- memory


def test_memory_holds_the_accumulated_gradients_and_every_gathered_unit() -> None:
    """Under deferral every layer of the stage stays gathered and, from the second
    backward on, every unit's gradients are held unsharded in fp32: the stage's layers
    and root at 4 bytes a parameter beside the gathered bf16 copies."""
    s, eager = titan(), titan(stack={"preset": "torchtitan", "pipeline_runtime": "megatron"})
    for stage, (m, e) in enumerate(zip(memory_report(s), memory_report(eager), strict=True)):
        held = accumulated_grads(s, stage)
        assert held > 4 * zero3_layer_bytes(s)  # 4 layers at fp32 / bf16 = 2x each, and root
        assert m.comm_buffers >= e.comm_buffers + held - 1e-6
        # the sharded gradients are made after the last backward, the activations gone:
        # only what exceeds them counts at the peak (all of them reducing every backward)
        assert e.gradients == pytest.approx(states(s, stage)[1], rel=1e-12)
        assert m.gradients <= max(e.gradients - m.activations, 0.0) + 1e-6
    assert accumulated_grads(titan(m=1), 0) == 0.0  # one backward: nothing accumulates
    assert accumulated_grads(eager, 0) == 0.0
    # `clustersim memory` says so in the buffers' item
    assert "accumulated" in moment_words(s, 0) and "every unit" in moment_words(s, 0)
    assert "accumulated" not in moment_words(titan(m=1), 0)
    assert "pipelining" not in moment_words(eager, 0)


@pytest.mark.parametrize("m", [4, 8])
def test_timeline_peak_is_the_tables(m: int) -> None:
    """The memory timeline holds the gathered units until their reductions and the
    accumulated gradients from each unit's first backward: at 1F1B's first stage its
    peak is memory.py's total; at the last within 0.01% (the head's inputs)."""
    s = titan(m=m)
    result = simulate(build_workload(s), s.hardware)
    got = stage_peaks(memory_timeline(s, result))
    total = {st: b.total for st, b in enumerate(memory_report(s))}
    assert got[0] == pytest.approx(total[0], rel=1e-12)
    assert got[1] == pytest.approx(total[1], rel=1e-4)
    assert got[1] <= total[1]


def test_experts_defer_too() -> None:
    """A mixture of experts under torchtitan's PP + FSDP2: the expert units'
    reduce-scatters (over edp) run once a step after the last backward, each
    backward accumulates every MoE layer's experts, and the closed form follows."""
    moe = {**WIDER, "activation": "swiglu", "experts": 8, "experts_per_token": 2,
           "expert_ffn_hidden": 1024, "bias": False}
    runs = {method: simulate_scenario(titan(dp=4, model=moe, method=method, ep=2))
            for method in ("engine", "analytic")}
    spans = runs["engine"][1]
    assert spans is not None
    for _, g in spans.groupby("rank"):
        experts = g[g["name"].str.contains("experts L") & g["op"].str.endswith("reduce_scatter")]
        assert len(experts) == 4  # the stage's 4 MoE layers, once a step
        backward = g[g["op"].isin(["B", "I", "W"])]
        assert experts["start"].min() >= backward["end"].max() - 1e-12
        assert g["name"].str.startswith("fsdp.experts_grad").sum() == 4 * 4  # 4 micro-batches
    steps = {m: r[0]["step_time_s"] for m, r in runs.items()}
    assert steps["analytic"] == pytest.approx(steps["engine"], rel=0.03)


def test_mixtral_under_torchtitan_gathers_beside_no_reductions() -> None:
    """The bundled Mixtral 8x7B (pp 4, 64 micro-batches) at ZeRO-3 under torchtitan: with
    the reductions deferred, a micro-batch's expert gathers share the rails with no
    reduce-scatter, so the backward's gathers hide behind its compute in the engine; the
    closed form, which had charged them the links the reductions no longer take
    (9.65 s against the engine's 6.11 s), follows within 5%."""
    path = Path(__file__).parents[1] / "scenarios" / "mixtral-8x7b-64xh100-ep8.yaml"
    steps = {}
    for method in ("engine", "analytic"):
        s = load_scenario(path, ["parallel.zero=3", "stack=torchtitan",
                                 f"simulation.method={method}"])
        assert deferred(s) and s.parallel.reshard_after_forward
        result, _ = simulate_scenario(s)
        steps[method] = result["step_time_s"]
        if method == "engine":
            assert result["exposed_comm_s"]["zero"] < 0.01 * result["step_time_s"]
    assert steps["analytic"] == pytest.approx(steps["engine"], rel=0.05)
