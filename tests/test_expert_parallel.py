"""Expert parallelism in the workload, the engine and the analytic method: Megatron-LM's
expert groups, the all-to-all's closed form, the EP traffic of a layer by hand, the
router-skew load, folding and composition with tp, pp and dp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_accounting import assert_partition

from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload
from simulator.model import transformer as mdl
from simulator.search.sweep import run_sweep
from simulator.spec.load import apply_overrides, scenario_from_dict
from simulator.strategies.expert import layer as epar
from simulator.system.layout import Layout

TINY_MOE: dict[str, Any] = {
    "name": "tiny-moe",
    "model": {"layers": 2, "hidden": 256, "heads": 8, "vocab": 512, "seq_len": 128,
              "activation": "swiglu", "experts": 4, "experts_per_token": 2,
              "expert_ffn_hidden": 512, "bias": False},
    "cluster": {"system": "dgx-a100-80gb", "nodes": 4, "gpus_per_node": 1},
    "parallel": {"dp": 4, "ep": 4, "overlap": {"dp": False}},
    "training": {"global_batch": 8, "micro_batch": 1},
}


def tiny(*sets: str) -> Any:
    return scenario_from_dict(apply_overrides(TINY_MOE, list(sets)))


def a2a_closed_form(n: int, size: float, bytes_per_s: float, alpha_s: float) -> float:
    """(n − 1)/n · S over the bottleneck link, plus (n − 1) latency steps."""
    return (n - 1) / n * size / bytes_per_s + (n - 1) * alpha_s


# ---------------------------------------------------------------- groups


def test_expert_groups_follow_megatron_rank_generator() -> None:
    """tp 2, dp 4 in a stage of 8 ranks (rank = dp·2 + tp). Expert generator
    (order tp-ep-dp): etp 1, ep 4 -> EP {0,1,2,3}, {4,5,6,7}; edp {0,4}, ...;
    etp 2, ep 2 -> EP {0,2}, {1,3}, {4,6}, ...; edp {0,4}, ..."""
    layout = Layout(2, 2, 4, 8)
    assert epar.ep_group(layout, 0, 1, 4) == (0, 1, 2, 3)
    assert epar.ep_group(layout, 13, 1, 4) == (12, 13, 14, 15)  # second stage
    assert epar.edp_group(layout, 1, 1, 4) == (1, 5)
    assert epar.ep_group(layout, 1, 2, 2) == (1, 3)
    assert epar.ep_group(layout, 6, 2, 2) == (4, 6)
    assert epar.edp_group(layout, 3, 2, 2) == (3, 7)
    assert epar.etp_group(layout, 5, 2) == (4, 5)
    for etp, ep in ((1, 4), (2, 2), (1, 8), (2, 4)):  # each kind of group partitions a stage
        for group in (epar.ep_group, epar.edp_group):
            seen = sorted(r for r in range(8) for g in [group(layout, r, etp, ep)] if g[0] == r)
            members = sorted(m for r in seen for m in group(layout, r, etp, ep))
            assert members == list(range(8))


# ---------------------------------------------------------------- traffic by hand


@pytest.mark.parametrize(("sets", "tp", "ep"), [
    ([], 1, 4),
    (["parallel.ep=2"], 1, 2),
    (["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
      "cluster.gpus_per_node=2", "cluster.nodes=2"], 2, 2),
])
def test_ep_traffic_per_layer_is_the_hand_calculation(sets: list[str], tp: int, ep: int) -> None:
    """Per MoE layer and micro-batch: 2 all-to-alls forward, 2 backward, each moving
    (b·s/tp)·h·bytes·k·(ep − 1)/ep off every rank."""
    s = tiny(*sets)
    w = build_workload(s)
    ep_tasks = [t for t in w.tasks if t.rank == 0 and t.kind == "ep" and t.layer == 0
                and t.microbatch == 0]
    assert len(ep_tasks) == 4
    hand = 1 * 128 / tp * 256 * 2 * 2 * (ep - 1) / ep
    for t in ep_tasks:
        assert t.plan is not None and t.plan.n == ep
        moved = sum(leg.bytes_per_rank for ph in t.plan.phases for leg in ph.legs)
        assert moved == pytest.approx(hand, rel=1e-12)


def test_a_dense_layer_of_a_moe_model_has_no_all_to_all() -> None:
    s = tiny("model.first_dense_layers=1")
    layers = {t.layer for t in build_workload(s).tasks if t.kind == "ep"}
    assert layers == {1}


# ---------------------------------------------------------------- closed form


@pytest.mark.parametrize(("nodes", "gpn"), [(4, 1), (1, 4)])
def test_all_to_all_time_is_the_closed_form_in_engine_and_analytic(nodes: int, gpn: int) -> None:
    s = tiny(f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpn}")
    link = s.hardware.inter_node if nodes > 1 else s.hardware.intra_node
    size = 128 * 256 * 2 * 2
    one = a2a_closed_form(4, size, link.bytes_per_s, link.alpha_s)
    per_rank = s.model.layers * s.microbatches * 4
    engine, _ = simulate_scenario(s, "engine")
    stats = engine["collectives"]["ep.all_to_all"]
    assert stats["count"] == per_rank  # folded: one rank stands for the stage
    assert stats["seconds"] / stats["count"] == pytest.approx(one, rel=1e-9)
    assert engine["step_breakdown_s"]["ep_transfer"] == pytest.approx(per_rank * one, rel=1e-9)
    analytic, _ = simulate_scenario(s, "analytic")
    assert analytic["step_breakdown_s"]["ep_transfer"] == pytest.approx(per_rank * one,
                                                                        rel=1e-12)
    assert_partition(engine)
    assert_partition(analytic)


def test_hierarchical_variant_on_an_ep_group_across_nodes() -> None:
    s = tiny("cluster.nodes=2", "cluster.gpus_per_node=2",
             "simulation.collective_algorithm=hierarchical")
    plans = {t.plan.algorithm for t in build_workload(s).tasks if t.kind == "ep" and t.plan}
    assert plans == {"hierarchical"}
    hw, size = s.hardware, 128 * 256 * 2 * 2
    intra, inter = hw.intra_node, hw.inter_node  # 2 per node: NVLink, then the rails
    one = (1 / 2 * size / intra.bytes_per_s + intra.alpha_s
           + 1 / 2 * size / inter.bytes_per_s + inter.alpha_s)
    per_rank = s.model.layers * s.microbatches * 4
    engine, _ = simulate_scenario(s, "engine")
    assert engine["step_breakdown_s"]["ep_transfer"] == pytest.approx(per_rank * one, rel=1e-9)
    analytic, _ = simulate_scenario(s, "analytic")
    assert analytic["step_breakdown_s"]["ep_transfer"] == pytest.approx(per_rank * one,
                                                                        rel=1e-12)
    assert_partition(engine)


# ---------------------------------------------------------------- load


def test_router_skew_is_seeded_and_the_busiest_rank_sets_the_pace() -> None:
    balanced = tiny()
    skewed = tiny("model.router_skew={concentration: 0.3, seed: 7}")
    loads = epar.rank_loads(skewed.model, 4)
    assert sum(loads) / 4 == pytest.approx(1.0, rel=1e-12)
    assert max(loads) > 1.0
    again = tiny("model.router_skew={concentration: 0.3, seed: 7}")
    other = tiny("model.router_skew={concentration: 0.3, seed: 8}")
    assert loads == epar.rank_loads(again.model, 4)
    assert loads != epar.rank_loads(other.model, 4)
    assert epar.load_factor(skewed.model, 1) == 1.0  # every expert on one rank
    lay_b, lay_s = epar.expert_layer(balanced), epar.expert_layer(skewed)
    assert lay_s.a2a_bytes == pytest.approx(max(loads) * lay_b.a2a_bytes, rel=1e-12)
    assert mdl.ops_flops(lay_s.fwd) == pytest.approx(max(loads) * mdl.ops_flops(lay_b.fwd),
                                                     rel=1e-12)
    t_b = simulate_scenario(balanced, "engine")[0]["step_time_s"]
    t_s = simulate_scenario(skewed, "engine")[0]["step_time_s"]
    assert t_s > t_b


def test_capacity_factor_pads_every_rank() -> None:
    s = tiny("model.capacity_factor=1.25", "model.router_skew={concentration: 0.3}")
    assert epar.rank_loads(s.model, 4) == (1.25,) * 4


def test_balanced_expert_flops_equal_the_model_arithmetic() -> None:
    """Under EP a rank computes E/ep experts on ep times their tokens: the same FLOPs as
    every expert on its own tokens (moe.py's count, tp 1)."""
    s = tiny()
    lay = epar.expert_layer(s)
    whole = mdl.layer_ops(s.model, 1, 1, False, "bf16", "fwd", 0)
    routed = [op for op in whole if op.name.startswith("expert_")]
    assert mdl.ops_flops(lay.fwd) == pytest.approx(mdl.ops_flops(routed), rel=1e-12)
    assert lay.fwd[0].gemm_flops == pytest.approx(routed[0].gemm_flops * 4, rel=1e-12)


# ---------------------------------------------------------------- composition


COMPOSED: dict[str, Any] = {
    **TINY_MOE,
    "model": {**TINY_MOE["model"], "layers": 4, "experts": 8},
    "cluster": {"system": "dgx-a100-80gb", "nodes": 2, "gpus_per_node": 8},
    "parallel": {"tp": 2, "pp": 2, "dp": 4, "ep": 4, "expert_tp": 1,
                 "sequence_parallel": True, "zero": 1},
    "training": {"global_batch": 16, "micro_batch": 1},
}


@pytest.mark.parametrize("sets", [
    [], ["parallel.expert_tp=2", "parallel.ep=2"], ["parallel.schedule=zb-h1"],
    ["parallel.recompute=full"], ["model.router_skew={concentration: 0.5, seed: 1}"],
    ["parallel.zero=2", "model.first_dense_layers=1"],
])
def test_folded_equals_full_and_the_step_partitions(sets: list[str]) -> None:
    s = scenario_from_dict(apply_overrides(COMPOSED, sets))
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, _ = simulate_scenario(s, "engine", "full")
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)
    for k, v in folded["step_breakdown_s"].items():
        assert v == pytest.approx(full["step_breakdown_s"][k], rel=1e-9, abs=1e-12), k
    assert folded["step_breakdown_s"]["ep_transfer"] > 0
    assert_partition(folded)
    assert_partition(full)
    analytic, _ = simulate_scenario(s, "analytic")
    assert_partition(analytic)
    assert analytic["step_time_s"] == pytest.approx(folded["step_time_s"], rel=0.25)


def test_an_ep_group_wider_than_dp_folds() -> None:
    """expert_tp 1 carves EP 8 out of tp 2 · dp 4: the folded run simulates one rank per
    stage (it simulated none, and divided by a zero step, when folding split ep out of dp)."""
    s = scenario_from_dict(apply_overrides(COMPOSED, ["parallel.pp=1", "parallel.dp=4",
                                                      "parallel.ep=8", "parallel.zero=0",
                                                      "cluster.nodes=1"]))
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, _ = simulate_scenario(s, "engine", "full")
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)
    assert folded["step_time_s"] > 0


def test_expert_gradients_reduce_over_the_expert_data_parallel_group() -> None:
    s = scenario_from_dict(COMPOSED)  # etp 1, ep 4: edp = 2·4/4 = 2
    w = build_workload(s, fidelity="full")
    expert = [t for t in w.tasks if t.rank == 0 and t.name.startswith("dp.")
              and "experts" in t.name]
    dense = [t for t in w.tasks if t.rank == 0 and t.name.startswith("dp.")
             and "experts" not in t.name]
    assert {t.group for t in expert} == {(0, 4)}
    assert {t.group for t in dense} == {(0, 2, 4, 6)}
    layer = 8 * (3 * 256 * 512) / (1 * 4) * 2  # 8 SwiGLU experts over etp·ep, bf16
    scatters = [t for t in expert if t.op == "dp.reduce_scatter"]  # ZeRO-1: one per layer
    # the default stack (megatron-core) reduces fp32 main grads: twice the bf16 bytes
    assert len(scatters) == 2 and all(t.nbytes == 2 * layer for t in scatters)
    (gather,) = [t for t in expert if t.op == "dp.all_gather"]
    assert gather.nbytes == 2 * layer  # the updated bf16 parameters


def test_sweep_over_ep(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(COMPOSED))
    table = run_sweep(path, {"parallel.ep": ["1", "2", "4", "8"]}, method="analytic")
    assert list(table["error"] == "") == [True, True, True, True]
    assert table["step_time_s"].notna().all()
    bad = run_sweep(path, {"parallel.ep": ["3"]}, method="analytic")
    assert "parallel.ep = 3" in bad["error"].iloc[0]
