"""The MoE token dispatchers and the shared-expert overlap: each dispatcher's collectives
and sizes by hand (Megatron-core's token_dispatcher.py), DeepEP's plan and buffers
against their closed forms, the engine against the analytic terms and folded against
full simulation for each, the overlap's bounds as a property, Megatron's refusals, and
the importer's mapping."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_accounting import assert_partition

from simulator.analysis.analytic.estimate import cost_model
from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload, layout_of
from simulator.cli.main import main
from simulator.engine.lockstep import lockstep_size
from simulator.errors import UserError
from simulator.model.device_memory import communicators, nccl_buffers, nccl_connection_bytes
from simulator.spec.load import apply_overrides, load_scenario, scenario_from_dict
from simulator.strategies.expert import deepep
from simulator.strategies.expert.strategy import (
    dispatcher_buffers,
    expert_times,
    held_sms_factor,
)
from simulator.system.collectives.plan import GroupShape

# 2 nodes of 2 GPUs, ep 4 over dp 4, one shared expert
MOE: dict[str, Any] = {
    "name": "moe-dispatch",
    "model": {"layers": 2, "hidden": 256, "heads": 8, "vocab": 512, "seq_len": 128,
              "activation": "swiglu", "experts": 4, "experts_per_token": 2,
              "expert_ffn_hidden": 512, "shared_experts": 1, "bias": False},
    "cluster": {"system": "dgx-a100-80gb", "nodes": 2, "gpus_per_node": 2},
    "parallel": {"dp": 4, "ep": 4, "overlap": {"dp": False}},
    "training": {"global_batch": 8, "micro_batch": 1},
}
H, S, E, K, DT = 256, 128, 4, 2, 2  # hidden, tokens per rank, experts, top-k, bf16 bytes
DISPATCHERS = ("alltoall", "allgather", "flex")


def moe(*sets: str) -> Any:
    return scenario_from_dict(apply_overrides(MOE, list(sets)))


def ep_tasks(s: Any) -> list[Any]:
    """Rank 0's ep collectives of layer 0, micro-batch 0, in program order."""
    return [t for t in build_workload(s, fidelity="full").tasks
            if t.rank == 0 and t.kind == "ep" and t.layer == 0 and t.microbatch == 0]


# ---------------------------------------------------------------- sizes by hand


def test_alltoall_is_todays_dispatcher() -> None:
    tasks = ep_tasks(moe())
    assert [t.op for t in tasks] == ["ep.all_to_all"] * 4
    assert {t.nbytes for t in tasks} == {K * S * H * DT}
    assert [t.name.split()[1] for t in tasks] == ["dispatch", "combine", "combine", "dispatch"]


def test_allgather_gathers_tokens_probs_and_map_over_tp_ep() -> None:
    """[T, h] tokens, [T, E] probabilities and [T, E] routing map (1 byte) all-gathered
    over the expert-TP x EP group (n = 2 · 2 with tp 2), the outputs reduce-scattered; no
    separate expert-TP collectives."""
    s = moe("parallel.moe_token_dispatcher=allgather", "parallel.tp=2", "parallel.dp=2",
            "parallel.ep=2", "parallel.sequence_parallel=true")
    tasks = ep_tasks(s)
    local = S / 2  # each TP rank routes its sequence shard
    gathered, back = 4 * local * (H * DT + E * (DT + 1)), 4 * local * H * DT
    assert [(t.op, t.nbytes) for t in tasks] == [
        ("ep.all_gather", gathered), ("ep.reduce_scatter", back),  # forward
        ("ep.all_gather", gathered), ("ep.reduce_scatter", back)]  # backward, mirrored
    assert all(t.group == (0, 1, 2, 3) for t in tasks)
    workload = build_workload(s, fidelity="full")
    assert not [t for t in workload.tasks if t.name.startswith("tp.all_gather experts")]
    assert dispatcher_buffers(s) == gathered - 4 * local * E * (DT + 1)


def test_allgather_bytes_ignore_the_router_skew() -> None:
    skewed = ep_tasks(moe("parallel.moe_token_dispatcher=allgather",
                          "model.router_skew={concentration: 0.3, seed: 1}"))
    assert {t.nbytes for t in skewed} == {t.nbytes for t in ep_tasks(
        moe("parallel.moe_token_dispatcher=allgather"))}


@pytest.mark.parametrize(("groups", "experts", "k"),
                         [(4, 4, 2), (2, 8, 3), (4, 16, 4), (3, 6, 1), (8, 8, 8)])
def test_distinct_groups_is_the_enumerated_mean(groups: int, experts: int, k: int) -> None:
    picks = list(itertools.combinations(range(experts), k))
    per = experts // groups
    mean = sum(len({e // per for e in p}) for p in picks) / len(picks)
    assert deepep.distinct(groups, experts, k) == pytest.approx(mean, rel=1e-12)


def test_deepep_plan_is_the_closed_form() -> None:
    """4 ranks on 2 nodes, top-2 of 4 experts: a token reaches 2 ranks (one per expert)
    and 4/3 nodes on average; NVLink carries every copy but the 1/2 that lands on the
    forwarding GPU, RDMA one copy per other node hit; rates DeepEP's over its maxima."""
    s = moe("parallel.moe_token_dispatcher=flex")
    tasks = ep_tasks(s)
    assert [t.name.split()[0:2] for t in tasks][:2] == [["ep.deepep", "dispatch"],
                                                        ["ep.deepep", "combine"]]
    token = S * H * DT
    nodes_hit = 2 * (1 - (2 / 4) * (1 / 3))
    for t, direction in zip(tasks, ("dispatch", "combine"), strict=False):
        assert t.plan.algorithm == "deepep"
        legs = {leg.link_class: leg for leg in t.plan.phases[0].legs}
        assert legs["intra_node"].bytes_per_rank == pytest.approx(token * 2 / 2, rel=1e-12)
        assert legs["inter_node"].bytes_per_rank == pytest.approx(token * nodes_hit / 2,
                                                                  rel=1e-12)
        nvl = (153 if direction == "dispatch" else 158) / 160
        assert legs["intra_node"].rate_factor == nvl
        assert legs["inter_node"].rate_factor == 43 / 50  # EP 16's entry, the smallest


def test_deepep_rates_follow_the_measured_table() -> None:
    assert deepep.rate_factor("inter_node", 64, "dispatch") == 50 / 50  # 51 GB/s, capped
    assert deepep.rate_factor("inter_node", 64, "combine") == 1.0
    assert deepep.rate_factor("inter_node", 256, "dispatch") == 1.0  # EP 64's entry
    assert deepep.rate_factor("inter_node", 24, "combine") == 43 / 50
    one_node = deepep.deepep_plan("dispatch", 100.0, 8, 2, 8, GroupShape(8, 8))
    assert [leg.link_class for leg in one_node.phases[0].legs] == ["intra_node"]


def test_deepep_buffers_are_the_config_hints() -> None:
    """csrc/legacy/config.hpp with 20 SMs (10 channels): within a node only the NVLink
    buffer; across 2 nodes (16 ranks) the RDMA buffer too (config 16: 288 and 128 recv
    tokens)."""
    hb = 7168 * 2
    per_token = hb + 8 + 128 * 12 + 128 * 4
    nvl8 = 10 * 8 * (5 * 4 + 256 * per_token)
    assert deepep.buffer_bytes(hb, 8) == math.ceil(nvl8 / 128) * 128
    nvl16 = 10 * 8 * (7 * 4 + 288 * per_token)
    rdma16 = 10 * 2 * 2 * (18 * 4 + 128 * (per_token + 16))
    assert deepep.buffer_bytes(hb, 16) == math.ceil(nvl16 / 128) * 128 \
        + math.ceil(rdma16 / 128) * 128


# ---------------------------------------------------------------- engine, analytic, folding


@pytest.mark.parametrize("sets", [
    [f"parallel.moe_token_dispatcher={d}"] for d in DISPATCHERS] + [
    ["parallel.moe_shared_expert_overlap=true"],
    ["parallel.moe_token_dispatcher=flex", "parallel.moe_shared_expert_overlap=true"],
    ["parallel.moe_shared_expert_overlap=true", "parallel.recompute=full"],
    *([f"parallel.moe_token_dispatcher={d}", "parallel.moe_shared_expert_overlap=true",
       "parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.sequence_parallel=true"]
      for d in ("alltoall", "flex")),
    ["parallel.moe_token_dispatcher=allgather", "parallel.tp=2", "parallel.dp=2",
     "parallel.ep=2", "parallel.sequence_parallel=true", "parallel.schedule=zb-h1"],
])
def test_engine_equals_analytic_and_folded_equals_full(sets: list[str]) -> None:
    s = moe(*sets)
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, _ = simulate_scenario(s, "engine", "full")
    analytic, _ = simulate_scenario(s, "analytic")
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-12)
    for k in ("ep_transfer", "forward", "backward_input", "recompute"):
        e = folded["step_breakdown_s"].get(k, 0.0)
        assert e == pytest.approx(full["step_breakdown_s"].get(k, 0.0), rel=1e-12, abs=1e-15)
        assert e == pytest.approx(analytic["step_breakdown_s"].get(k, 0.0), rel=1e-9,
                                  abs=1e-15), k
    assert folded["step_breakdown_s"]["ep_transfer"] > 0
    assert_partition(folded)
    assert_partition(analytic)


def test_the_shared_experts_run_beside_the_exchange() -> None:
    s = moe("parallel.moe_shared_expert_overlap=true")
    w = build_workload(s, fidelity="full")
    prog = w.programs[0]
    assert [t.op for t in prog.streams["ep"]][:2] == ["ep.all_to_all"] * 2
    names = [t.name for t in prog.streams["compute"] if t.layer == 0 and t.microbatch == 0]
    first = names.index("forward.shared_experts dispatch L0 mb0")
    assert names[first + 1:first + 3] == ["ep.wait dispatch L0 mb0", "forward.experts L0 mb0"]


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(("alltoall", "flex")), st.integers(1, 4),
       st.sampled_from((1.0, 25.0, 400.0)))
def test_overlap_never_slows_and_hides_at_most_the_shorter(dispatcher: str, shared: int,
                                                           gbps: float) -> None:
    """Per exchange the overlap saves min(its shared part, exchange / f), f the compute's
    slowdown beside DeepEP's SMs (1 for NCCL's all-to-all): never a loss, at most the
    shorter of the two, over every MoE layer and pass of the step."""
    sets = [f"parallel.moe_token_dispatcher={dispatcher}", f"model.shared_experts={shared}",
            f"cluster.inter_node_bandwidth_GBps={gbps}"]
    plain = moe(*sets)
    over = moe(*sets, "parallel.moe_shared_expert_overlap=true")
    t0 = simulate_scenario(plain, "engine")[0]["step_time_s"]
    t1 = simulate_scenario(over, "engine")[0]["step_time_s"]
    x = expert_times(over, layout_of(over), cost_model(over), over.hardware)
    per_layer = x.hidden_fwd + x.hidden_bwd - x.stretch_fwd - x.stretch_bwd
    assert (x.stretch_fwd > 0) == (dispatcher == "flex")  # the preset states its SMs
    bound = min(x.shared_fwd + x.shared_bwd, 4 * x.a2a)
    assert per_layer <= bound + 1e-15
    assert t1 <= t0 * (1 + 1e-12)
    assert t0 - t1 <= over.model.layers * over.microbatches * per_layer * (1 + 1e-9) + 1e-12


def test_lockstep_still_falls_back_for_moe() -> None:
    for d in DISPATCHERS:
        w = build_workload(moe(f"parallel.moe_token_dispatcher={d}"), fidelity="full")
        assert lockstep_size(w, alone=True) == 1


# ---------------------------------------------------------------- Megatron's refusals


@pytest.mark.parametrize(("sets", "field"), [
    (["parallel.moe_token_dispatcher=allgather", "parallel.moe_shared_expert_overlap=true"],
     "parallel.moe_shared_expert_overlap"),
    (["parallel.moe_token_dispatcher=flex", "model.capacity_factor=1.5"],
     "parallel.moe_token_dispatcher"),
    (["parallel.moe_token_dispatcher=flex", "parallel.ep=1"], "parallel.moe_token_dispatcher"),
    (["model.experts=0", "parallel.ep=1", "parallel.moe_token_dispatcher=flex"],
     "parallel.moe_token_dispatcher"),
])
def test_megatron_refusals_are_problems(sets: list[str], field: str) -> None:
    with pytest.raises(UserError) as err:
        moe(*sets)
    assert field in str(err.value)


# ---------------------------------------------------------------- import


MEGATRON = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "2048", "--micro-batch-size", "1", "--vocab-size", "50257",
            "--num-experts", "8", "--expert-model-parallel-size", "8", "--bf16",
            "--moe-shared-expert-intermediate-size", "4096"]


@pytest.mark.parametrize(("extra", "dispatcher", "overlap"), [
    ([], "allgather", False),  # TransformerConfig's default
    (["--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-overlap"],
     "alltoall", True),
    (["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
     "flex", False),
    (["--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"], "flex", False),
])
def test_import_maps_the_dispatcher(tmp_path: Path, extra: list[str], dispatcher: str,
                                    overlap: bool) -> None:
    out = tmp_path / "imported.yaml"
    assert main(["import", "megatron", "--gpus", "8", "--out", str(out), "--",
                 *MEGATRON, *extra]) == 0
    par = load_scenario(out).parallel
    assert (par.moe_token_dispatcher, par.moe_shared_expert_overlap) == (dispatcher, overlap)


def test_import_notes_a_backend_it_does_not_model(tmp_path: Path) -> None:
    out = tmp_path / "imported.yaml"
    assert main(["import", "megatron", "--gpus", "8", "--out", str(out), "--", *MEGATRON,
                 "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend",
                 "hybridep"]) == 0
    assert "simulated as deepep" in out.read_text()
    assert load_scenario(out).parallel.moe_token_dispatcher == "flex"


def test_nccl_buffers_follow_the_dispatcher() -> None:
    """NCCL holds buffers only for the groups a collective runs on: the EP all-to-all's
    peers (alltoall), one expert-TP x EP ring (allgather), none for DeepEP's exchange."""
    def names(*sets: str) -> list[str]:
        return [c.name for c in communicators(moe(*sets), 0)]
    assert names() == ["dp", "ep"]  # edp = 1 and expert TP = 1: no ring of one
    assert names("parallel.moe_token_dispatcher=allgather") == ["dp", "tp_ep"]
    assert names("parallel.moe_token_dispatcher=flex") == ["dp"]
    channels = moe().hardware.gpu.runtime_memory().nccl_channels
    assert nccl_buffers(moe("parallel.moe_token_dispatcher=flex"), 0) \
        < nccl_buffers(moe("parallel.moe_token_dispatcher=allgather"), 0) \
        == 2 * channels * nccl_connection_bytes()


def test_deepep_holds_its_sms_from_the_compute_beside_it() -> None:
    """DeepEP's kernels hold Buffer.num_sms = 20 SMs for their whole run (DeepSeek-V3
    §3.2.2): the compute beside a flex exchange runs at (sms − 20) / sms of its speed; NCCL's
    all-to-all and a profile that states no SM count leave it alone."""
    flex = moe("parallel.moe_token_dispatcher=flex")
    hw = flex.hardware
    assert hw.gpu.sms is not None
    assert held_sms_factor(flex, hw) == hw.gpu.sms / (hw.gpu.sms - deepep.NUM_SMS)
    assert held_sms_factor(moe("parallel.moe_token_dispatcher=alltoall"), hw) == 1.0
    unstated = hw.model_copy(update={"gpu": hw.gpu.model_copy(update={"sms": None})})
    assert held_sms_factor(flex, unstated) == 1.0
    plan = deepep.deepep_plan("dispatch", 100.0, 8, 2, 8, GroupShape(8, 8))
    assert plan.sms == deepep.NUM_SMS == 20
