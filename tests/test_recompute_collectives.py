"""Collectives a recomputed block issues again (:mod:`simulator.model.inventory.recompute_comm`):
exactly those inside the function its framework checkpoints, with the forward's bytes.

Oracles per recomputed layer and micro-batch (b = 2, s = 128, h = 256, bf16: one TP
collective carries b·s·h·2 bytes):

* Megatron's ``mlp`` (``tensor_parallel.checkpoint(self.mlp)``): the MLP's all-gather and
  reduce-scatter under sequence parallelism, its all-reduce without; ``moe``
  (``MoELayer``'s ``custom_forward``): those and the dispatch's and combine's
  all-to-alls; ``core_attn``: the context-parallel exchange inside TE's attention (4
  all-to-alls of Q, K, V, O under Ulysses, 1 all-gather ring under p2p); ``layernorm``,
  ``moe_act``, ``shared_experts``: none;
* torchtitan's op policy (reduce-scatters saved, all-gathers and all-reduces not): the
  two all-gathers under SP, the two all-reduces without;
* full recomputation: every forward collective of the layer.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.analytic.estimate import analytic_estimate, cost_model, layer_terms
from simulator.analysis.analytic.stage import stage_times
from simulator.analysis.report import engine_metrics
from simulator.builder.workload import build_workload, local_scenario
from simulator.engine.engine import simulate
from simulator.model.inventory import recompute_comm
from simulator.model.inventory.recompute_comm import NOTHING, reissued
from simulator.spec.load import scenario_from_dict
from simulator.spec.recompute import module_names
from simulator.spec.scenario import Scenario

DENSE = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "ffn_hidden": 512,
         "activation": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False,
         "vocab": 1024, "seq_len": 128}
MOE = {**DENSE, "experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 128,
       "shared_experts": 1}
B, S, H, DT = 2, 128, 256, 2
ACT = B * S * H * DT  # one TP collective's bytes

#: the small cases: (model, GPUs, parallel fields)
CASES: dict[str, tuple[dict[str, Any], int, dict[str, Any]]] = {
    "tp+sp": (DENSE, 2, {"tp": 2, "sequence_parallel": True}),
    "tp": (DENSE, 2, {"tp": 2}),
    "ep": (MOE, 2, {"ep": 2, "dp": 2}),
    "tp+sp+ep": (MOE, 4, {"tp": 2, "sequence_parallel": True, "ep": 2, "dp": 2}),
    "cp a2a": (DENSE, 2, {"cp": 2, "cp_comm_type": "a2a"}),
    "cp p2p": (DENSE, 2, {"cp": 2, "cp_comm_type": "p2p"}),
    "cp allgather": (DENSE, 2, {"cp": 2, "cp_comm_type": "allgather"}),
}

#: the recompute variants: parallel fields (the op policy on torchtitan's stack)
VARIANTS: dict[str, dict[str, Any]] = {
    "none": {"recompute": "none"},
    "full": {"recompute": "full"},
    "op": {"recompute": "op"},
    **{m: {"recompute": "selective", "recompute_modules": [m]} for m in module_names()
       if m != "mla_up_proj"},
    "layernorm+moe+moe_act": {"recompute": "selective",
                              "recompute_modules": ["layernorm", "moe", "moe_act"]},
}


def scenario(case: str, variant: str, pp: int = 1, stack: dict[str, Any] | None = None,
             like: str | None = None, **parallel: Any) -> Scenario:
    """``case`` under ``variant`` on Megatron-Core's stack, or torchtitan's for its op
    policy (``like``: the variant whose stack to take, for a baseline)."""
    model, gpus, par = CASES[case]
    preset = "torchtitan" if (like or variant) == "op" and stack is None \
        else "megatron-core"
    return scenario_from_dict({
        "name": "reissue", "stack": {"preset": preset, **(stack or {})},
        "model": model, "cluster": {"system": "dgx-a100-80gb", "nodes": 1,
                                    "gpus_per_node": gpus * pp},
        "parallel": {"pp": pp, **par, **VARIANTS[variant], **parallel},
        "training": {"global_batch": 8, "micro_batch": B}})


def comm(s: Scenario, rank: int = 0) -> Counter[tuple[str, str, float]]:
    """Rank ``rank``'s collectives of the layers, by (kind, op, bytes)."""
    w = build_workload(s, fidelity="full")
    return Counter((t.kind, t.op.split(".", 1)[1], t.nbytes) for t in w.tasks
                   if t.rank == rank and t.plan is not None and t.layer >= 0
                   and t.kind in ("tp", "ep", "cp"))


def again(case: str, variant: str) -> Counter[tuple[str, str, float]]:
    """Per layer and micro-batch, the collectives ``variant`` adds to no recomputation."""
    s, base = scenario(case, variant), scenario(case, "none", like=variant)
    n = s.model.layers * s.microbatches
    diff = comm(s) - comm(base)
    assert not comm(base) - comm(s)  # recomputation never drops a collective
    assert all(v % n == 0 for v in diff.values()), diff
    return Counter({k: v // n for k, v in diff.items()})


TP_SP = {"mlp": {("tp", "all_gather", ACT): 1, ("tp", "reduce_scatter", ACT): 1},
         "op": {("tp", "all_gather", ACT): 2},
         "full": {("tp", "all_gather", ACT): 2, ("tp", "reduce_scatter", ACT): 2}}
TP = {"mlp": {("tp", "all_reduce", ACT): 1}, "op": {("tp", "all_reduce", ACT): 2},
      "full": {("tp", "all_reduce", ACT): 2}}


@pytest.mark.parametrize(("case", "want"), [("tp+sp", TP_SP), ("tp", TP)])
@pytest.mark.parametrize("variant", ["none", "full", "op", "core_attn", "layernorm", "mlp"])
def test_tensor_parallel_collectives_again(case: str, want: dict[str, Any],
                                           variant: str) -> None:
    assert again(case, variant) == Counter(want.get(variant, {}))


def _forward_experts(case: str) -> Counter[tuple[str, str, float]]:
    """One MoE layer's forward exchanges, the dispatcher's all-to-alls and its expert-TP
    all-gather and reduce-scatter (no recomputation: forward and backward alike)."""
    s = scenario(case, "none")
    n = s.model.layers * s.microbatches
    got = Counter({k: v // (2 * n) for k, v in comm(s).items()
                   if k[0] == "ep" or k[2] != ACT})
    assert got[("ep", "all_to_all", max(k[2] for k in got if k[0] == "ep"))] == 2
    return got


@pytest.mark.parametrize("variant", ["moe", "layernorm+moe+moe_act", "full"])
def test_a_recomputed_moe_block_dispatches_and_combines_again(variant: str) -> None:
    assert again("ep", variant) == _forward_experts("ep")
    tp = {("tp", "all_gather", ACT): 1, ("tp", "reduce_scatter", ACT): 1}
    if variant == "full":
        tp = {k: 2 * v for k, v in tp.items()}
    assert again("tp+sp+ep", variant) == _forward_experts("tp+sp+ep") + Counter(tp)


@pytest.mark.parametrize("variant", ["moe_act", "shared_experts", "layernorm", "mlp",
                                     "core_attn"])
def test_modules_without_collectives_issue_none_on_a_moe_layer(variant: str) -> None:
    assert again("tp+sp+ep", variant) == Counter()


@pytest.mark.parametrize(("case", "want"), [
    ("cp a2a", {("cp", "all_to_all", B * S / 2 * H * DT): 2,  # Q and O
                ("cp", "all_to_all", B * S / 2 * 2 * 32 * DT): 2}),  # K and V
    ("cp p2p", {("cp", "all_gather", 2 * B * S / 2 * 2 * 2 * 32 * DT): 1}),  # K and V ring
    ("cp allgather", {("cp", "all_gather", 2 * B * S / 2 * 2 * 2 * 32 * DT): 1})])
@pytest.mark.parametrize("variant", ["core_attn", "full", "op", "mlp"])
def test_a_recomputed_attention_core_exchanges_again(case: str, want: dict[Any, int],
                                                     variant: str) -> None:
    assert again(case, variant) == Counter(want if variant in ("core_attn", "full") else {})


def test_every_module_names_its_collectives() -> None:
    assert set(recompute_comm.MODULE_REISSUE) == set(module_names())
    assert reissued("selective", False, True) == reissued("selective:core_attn", False, True)
    assert reissued("selective:layernorm,moe_act,shared_experts", True, True) == NOTHING


# ------------------------------------------------------------------ engine and closed form


@pytest.mark.parametrize(("case", "variant"), [
    ("tp+sp", "mlp"), ("tp+sp", "op"), ("tp", "mlp"), ("tp", "op"), ("ep", "moe"),
    ("tp+sp+ep", "moe"), ("tp+sp+ep", "layernorm+moe+moe_act"), ("cp a2a", "core_attn"),
    ("cp p2p", "core_attn"), ("cp allgather", "core_attn"), ("tp+sp", "full"),
    ("tp+sp", "full")])
@pytest.mark.parametrize("extra", [{}, {"stack": {"tp_overlap": "none"}},
                                   {"stack": {"tp_overlap": "pipelined"}},
                                   {"stack": {"tp_overlap": "bulk"}}])
def test_engine_and_closed_form_agree_on_what_reissuing_adds(
        case: str, variant: str, extra: dict[str, Any], one_compute_speed: None) -> None:
    """One rank's whole step (no pipeline): the engine's and the analytic estimate's step
    grow alike from no recomputation (both exact here for TP at one compute speed; for
    EP and CP they differ by a constant, the same with or without recomputation), TP
    overlap's split GEMMs around a block re-run whole included (the default stack's
    Megatron async backward, and TP in line, for every case)."""
    if extra.get("stack", {}).get("tp_overlap") in ("pipelined", "bulk") \
            and ("sp" not in case or "ep" in case):
        pytest.skip("TP overlap needs sequence parallelism and dense layers (refused with experts)")
    _agree(case, variant, extra)


@pytest.mark.parametrize(("case", "extra"), [
    ("tp+sp+ep", {"moe_shared_expert_overlap": True}),
    ("tp+sp+ep", {"moe_token_dispatcher": "allgather"}),
    ("ep", {"moe_token_dispatcher": "flex"}),
    ("tp+sp+ep", {"expert_tp": 2, "ep": 2, "dp": 2})])
def test_a_recomputed_moe_block_agrees_under_every_dispatcher(
        case: str, extra: dict[str, Any], one_compute_speed: None) -> None:
    _agree(case, "moe", extra)
    _agree(case, "full", extra)


def _agree(case: str, variant: str, extra: dict[str, Any]) -> None:
    steps = {}
    for v in ("none", variant):
        s = scenario(case, v, like=variant, **extra)
        steps[v] = (engine_metrics(s, simulate(build_workload(s), s.hardware))["step_time_s"],
                    analytic_estimate(s)["step_time_s"])
    engine, closed = (steps[variant][i] - steps["none"][i] for i in (0, 1))
    assert engine > 0
    assert closed == pytest.approx(engine, rel=1e-9)


@contextmanager
def no_reissue() -> Iterator[None]:
    """Every module that asks :func:`reissued` told that nothing runs again (the model
    before it issued any collective in a recomputed block)."""
    with mock.patch.multiple(recompute_comm, reissued=lambda *a: NOTHING):
        patches = [mock.patch.object(m, "reissued", lambda *a: NOTHING)
                   for m in list(sys.modules.values())
                   if getattr(m, "reissued", None) is reissued and m is not recompute_comm]
        for p in patches:
            p.start()
        try:
            yield
        finally:
            for p in patches:
                p.stop()


@settings(max_examples=12, deadline=None)
@given(case=st.sampled_from(sorted(CASES)), variant=st.sampled_from(sorted(VARIANTS)),
       pp=st.sampled_from([1, 2]))
def test_reissuing_never_shortens_a_step(case: str, variant: str, pp: int) -> None:
    if variant == "op" and CASES[case][0] is MOE:
        variant = "full"
    s = scenario(case, variant, pp)
    with_ = (analytic_estimate(s)["step_time_s"],
             engine_metrics(s, simulate(build_workload(s), s.hardware))["step_time_s"])
    with no_reissue():
        without = (analytic_estimate(s)["step_time_s"],
                   engine_metrics(s, simulate(build_workload(s), s.hardware))["step_time_s"])
    assert with_[0] >= without[0] * (1 - 1e-12)
    assert with_[1] >= without[1] * (1 - 1e-12)


def _streams(s: Scenario) -> Counter[tuple[str, str]]:
    w = build_workload(s, fidelity="full")
    return Counter((t.stream, t.kind) for t in w.tasks if t.rank == 0 and t.plan is not None
                   and t.layer >= 0 and t.kind in ("tp", "ep", "cp"))


@pytest.mark.parametrize(("case", "variant", "extra", "want"), [
    ("tp+sp", "mlp", {}, {("compute", "tp")}),
    ("tp+sp", "mlp", {"stack": {"tp_overlap": "pipelined"}}, {("tp", "tp"), ("compute", "tp")}),
    ("tp+sp", "op", {"stack": {"tp_overlap": "pipelined"}}, {("compute", "tp")}),
    ("cp p2p", "core_attn", {}, {("cp", "cp")}),
    ("cp a2a", "core_attn", {}, {("compute", "cp")}),
    ("tp+sp+ep", "moe", {"moe_shared_expert_overlap": True}, {("ep", "ep"), ("compute", "tp")}),
])
def test_reissued_collectives_run_on_the_forwards_streams(
        case: str, variant: str, extra: dict[str, Any], want: set[tuple[str, str]]) -> None:
    """A block re-run whole overlaps as its forward does (TP overlap's ``tp`` stream and
    its pipeline's last chunk's reduce-scatter in line, the ring's ``cp`` stream,
    shared-expert overlap's ``ep`` stream); a lone gather runs in line on the compute
    stream."""
    added = _streams(scenario(case, variant, **extra)) \
        - _streams(scenario(case, "none", like=variant, **extra))
    assert set(added) == want


@pytest.mark.parametrize(("case", "variant"), [
    ("tp+sp", "mlp"), ("tp", "op"), ("tp+sp+ep", "moe"), ("cp a2a", "core_attn"),
    ("cp p2p", "core_attn"), ("cp allgather", "core_attn")])
def test_the_closed_form_puts_what_is_issued_again_in_the_backward(case: str,
                                                                   variant: str) -> None:
    """t_F of a stage is the forward's whatever the recomputation re-issues; t_B holds the
    re-issued collectives (besides the recomputed compute)."""
    times = {}
    for v in ("none", variant):
        s = scenario(case, v, pp=2, like=variant)
        cost = cost_model(s)
        terms = layer_terms(s, cost, s.hardware)
        times[v] = stage_times(local_scenario(s), terms.c, terms.t_tp, 0, terms.experts,
                               terms.t_cp, terms.ends, terms.t_cp_again)
    assert times[variant][0] == pytest.approx(times["none"][0], rel=1e-12)
    assert times[variant][1] > times["none"][1]
