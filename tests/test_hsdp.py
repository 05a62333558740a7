"""Hybrid sharding (HSDP): ZeRO-3 within shard groups of ``dp_shard`` data-parallel ranks,
replication across the dp / dp_shard groups.

As FSDP runs it (FSDP1 ``HYBRID_SHARD``: torch/distributed/fsdp/_runtime_utils.py
``_reduce_grad``; FSDP2 on a 2-D mesh: _fully_shard/_fsdp_collectives.py
``foreach_reduce``): parameters are all-gathered and gradients reduce-scattered within
the shard group, and each reduce-scatter's 1/shard output is then all-reduced across the
replicate group. Model states are those of ZeRO-3 with dp = dp_shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from simulator.analysis.memory import stage_breakdown
from simulator.api import simulate_scenario
from simulator.builder.budget import tasks_per_layer
from simulator.builder.workload import build_workload, layout_of
from simulator.errors import ScenarioError
from simulator.model.device_memory import communicators
from simulator.spec.load import scenario_from_dict
from simulator.spec.rules import not_yet_simulated
from simulator.spec.scenario import Scenario
from simulator.strategies.zero3.counts import zero3_collective_counts
from simulator.strategies.zero3.strategy import two_streams
from simulator.system.layout import Layout
from simulator.system.profiles import SYSTEMS_DIR


def hsdp(dp_shard: int | None, nodes: int = 2, dp: int = 16, m: int = 2,
         gpus_per_node: int = 8, stack: str = "pytorch-eager", **parallel: Any) -> Scenario:
    """A small GPT on FSDP2 (pytorch-eager) over ``nodes`` nodes of 8 GPUs."""
    par: dict[str, Any] = {"dp": dp, "zero": 3, **parallel}
    if dp_shard is not None:
        par["dp_shard"] = dp_shard
    return scenario_from_dict({
        "name": "hsdp",
        "model": {"layers": 4, "hidden": 2048, "heads": 16, "vocab": 32000, "seq_len": 1024},
        "cluster": {"system": "dgx-a100-80gb", "nodes": nodes,
                    "gpus_per_node": gpus_per_node},
        "parallel": par,
        "training": {"global_batch": m * dp, "micro_batch": 1},
        "stack": stack,
    })


def test_groups_are_consecutive_dp_ranks_and_their_replicas() -> None:
    """dp 16 in blocks of 8 on two nodes of 8: a node shards, the nodes replicate; with
    cp 2 a shard spans dp_shard · cp ranks and the replicas keep the cp index."""
    lay = Layout(tp=1, pp=1, dp=16, gpus_per_node=8, dp_shard=8)
    assert lay.shard_group(3) == tuple(range(8))
    assert lay.shard_group(12) == tuple(range(8, 16))
    assert lay.replicate_group(3) == (3, 11)
    assert lay.replicate_group(11) == (3, 11)
    cp = Layout(tp=2, pp=1, dp=4, gpus_per_node=8, cp=2, dp_shard=2)  # rank = (d·2 + c)·2 + t
    assert cp.shard_group(cp.rank(0, 3, 1, 1)) == (9, 11, 13, 15)
    assert cp.replicate_group(cp.rank(0, 3, 1, 1)) == (7, 15)
    full = Layout(tp=2, pp=2, dp=4, gpus_per_node=8, cp=2)
    assert all(full.shard_group(r) == full.dp_group(r) and full.replicate_group(r) == (r,)
               for r in range(full.world))


def test_engine_gathers_within_a_node_and_all_reduces_an_eighth_across() -> None:
    """16 GPUs on 2 nodes, dp 16, dp_shard 8, every rank built: each all-gather and
    reduce-scatter stays in its rank's node; after each reduce-scatter an all-reduce of
    1/8 of its bytes crosses to the other node, on a stream of its own, so a step
    all-reduces 1/8 of the gradient bytes it reduce-scatters (m times the stage's
    gradients)."""
    s = hsdp(8)
    w = build_workload(s, fidelity="full")
    for rank, prog in w.programs.items():
        tasks = [t for ts in prog.streams.values() for t in ts]
        gathers = [t for t in tasks if t.op == "zero.all_gather"]
        scatters = [t for t in tasks if t.op == "dp.reduce_scatter"]
        reduces = [t for t in tasks if t.op == "dp.all_reduce"]
        assert gathers and scatters
        node = {r // 8 for r in range(rank - rank % 8, rank - rank % 8 + 8)}
        assert all({r // 8 for r in t.group} == node for t in gathers + scatters)
        assert all(t.group == (rank % 8, rank % 8 + 8) for t in reduces)
        assert len(reduces) == len(scatters)
        assert sum(t.nbytes for t in reduces) == pytest.approx(
            sum(t.nbytes for t in scatters) / 8, rel=1e-12)
        by_id = {t.id: t for t in tasks}
        for r in reduces:  # after its reduce-scatter
            assert [by_id[d].op for d in r.deps] == ["dp.reduce_scatter"]
            assert r.stream == "replicate"  # its own stream, as FSDP's all-reduce stream
    counts = zero3_collective_counts(s, 0)
    rank0 = [t.op for ts in w.programs[0].streams.values() for t in ts]
    assert counts == {"all_gather": rank0.count("zero.all_gather"),
                      "reduce_scatter": rank0.count("dp.reduce_scatter"),
                      "all_reduce": rank0.count("dp.all_reduce")}


def test_with_context_parallelism_a_shard_spans_the_cp_peers() -> None:
    """tp 2, cp 2, dp 4 in shards of 2 on two nodes: ZeRO-3 over dp_shard · cp = 4 ranks
    of a node (torchtitan's dp_shard_cp mesh), the all-reduce of a quarter across the
    two nodes."""
    s = hsdp(2, dp=4, cp=2, tp=2)
    w = build_workload(s, fidelity="full")
    ops = [t for ts in w.programs[0].streams.values() for t in ts]
    scatters = [t for t in ops if t.op == "dp.reduce_scatter"]
    reduces = [t for t in ops if t.op == "dp.all_reduce"]
    assert {t.group for t in scatters} == {(0, 2, 4, 6)}
    assert {t.group for t in reduces} == {(0, 8)}
    assert sum(t.nbytes for t in reduces) == pytest.approx(
        sum(t.nbytes for t in scatters) / 4, rel=1e-12)


@pytest.mark.parametrize("parallel", [{"pp": 2}, {"stack": "deepspeed"}],
                         ids=["pp2", "module-units"])
def test_counts_per_stage_are_the_closed_forms(parallel: dict[str, Any]) -> None:
    """With pipeline stages or DeepSpeed's per-module units, each simulated rank issues
    the all-gathers, reduce-scatters and all-reduces the closed form counts for its
    stage."""
    s = hsdp(4, dp=16 // parallel.get("pp", 1), **parallel)
    assert s.stack.zero3_unit == ("module" if "stack" in parallel else "layer")
    _, spans = simulate_scenario(s)
    assert spans is not None
    layout = layout_of(s)
    for rank, g in spans.groupby("rank"):
        got = {"all_gather": int((g["op"] == "zero.all_gather").sum()),
               "reduce_scatter": int((g["op"] == "dp.reduce_scatter").sum()),
               "all_reduce": int((g["op"] == "dp.all_reduce").sum())}
        assert got == zero3_collective_counts(s, layout.coord(int(rank)).pp), rank


def test_torchtitan_all_reduces_on_the_last_micro_batch_only() -> None:
    """torchtitan's gradient accumulation calls ``set_requires_all_reduce(is_last)``
    (``stack.hsdp_all_reduce: last``): reduce-scatters after every micro-batch, the
    all-reduces once a step, the earlier shards accumulated; the closed form counts the
    same."""
    every = hsdp(8, m=4)
    once = every.model_copy(update={"stack": every.stack.model_copy(
        update={"hsdp_all_reduce": "last"})})
    counts = {}
    for name, s in (("every", every), ("once", once)):
        _, spans = simulate_scenario(s)
        assert spans is not None
        counts[name] = {op: int((spans["op"] == f"{kind}.{op}").sum()) for kind, op in (
            ("zero", "all_gather"), ("dp", "reduce_scatter"), ("dp", "all_reduce"))}
        assert counts[name] == zero3_collective_counts(s, 0)
    assert counts["once"]["reduce_scatter"] == counts["every"]["reduce_scatter"]
    assert counts["once"]["all_reduce"] * 4 == counts["every"]["all_reduce"]
    titan = scenario_from_dict({**once.to_dict(), "stack": "torchtitan"})
    assert titan.stack.hsdp_all_reduce == "last"


@pytest.mark.parametrize(("dp", "shard", "cp"), [(16, 8, 1), (16, 2, 1), (8, 4, 2),
                                                 (4, 1, 2)])
def test_model_states_are_zero3_over_the_shard_group(dp: int, shard: int, cp: int) -> None:
    """Per GPU, weights, gradients and optimizer states with dp_shard = s are ZeRO-3's
    with dp = s (ZeRO paper: (2 + 2 + K)Ψ / N_d at N_d = s · cp)."""
    got = stage_breakdown(hsdp(shard, nodes=dp * cp // 8, dp=dp, cp=cp), 0)
    want = stage_breakdown(hsdp(None, nodes=1, dp=shard, cp=cp, gpus_per_node=shard * cp), 0)
    assert (got.weights, got.gradients, got.optimizer) \
        == (want.weights, want.gradients, want.optimizer)
    full = stage_breakdown(hsdp(None, nodes=dp * cp // 8, dp=dp, cp=cp), 0)
    assert got.weights == pytest.approx(full.weights * dp / shard, rel=1e-12)


def test_dp_shard_equal_to_dp_is_full_sharding_bit_for_bit() -> None:
    a, _ = simulate_scenario(hsdp(16))
    b, _ = simulate_scenario(hsdp(None))
    keep = ("step_time_s", "memory", "breakdown_s")
    assert {k: a.get(k) for k in keep} == {k: b.get(k) for k in keep}


def test_replicas_all_reduce_on_top_of_one_node_of_sharding() -> None:
    """Against one node of ZeRO-3 (dp 8: the same shards, gathers and reduce-scatters),
    the cross-node all-reduce after each reduce-scatter lengthens the engine's step."""
    hybrid, _ = simulate_scenario(hsdp(8, m=4))
    node, _ = simulate_scenario(hsdp(None, nodes=1, dp=8, m=4))
    assert hybrid["step_time_s"] > node["step_time_s"]


@pytest.mark.parametrize(("dp_shard", "all_reduce"), [(2, "microbatch"), (2, "last"),
                                                     (None, "microbatch")])
def test_analytic_prices_the_collectives_the_engine_issues_in_line(
        dp_shard: int | None, all_reduce: str, tmp_path: Path) -> None:
    """With communication in line with compute (a CPU profile, as
    tests/test_analytic.py's in-line case), the closed form prices the reduce-scatters
    over the shard group and the all-reduces across the replicas the engine runs, to
    rounding: 2 nodes of 2, dp 4, dp_shard 2, all-reducing after every micro-batch or
    the last one's reduce-scatters only (and full sharding beside it)."""
    system = yaml.safe_load((SYSTEMS_DIR / "cpu-1thread.yaml").read_text())
    system["gpu"].update({"collective_sync_us": {"intra_node": 800.0, "inter_node": 900.0},
                          "host_overhead_us": 5.0})
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(system))
    par: dict[str, Any] = {"dp": 4, "zero": 3}
    if dp_shard:
        par["dp_shard"] = dp_shard
    s = scenario_from_dict({
        "name": "t", "model": {"preset": "tiny-gpt"},
        "stack": {"preset": "pytorch-eager", "hsdp_all_reduce": all_reduce},
        "cluster": {"system": str(path), "nodes": 2, "gpus_per_node": 2},
        "parallel": par,
        "training": {"global_batch": 16, "micro_batch": 2, "dtype": "fp32"}})
    engine, spans = simulate_scenario(s, "engine")
    analytic, _ = simulate_scenario(s, "analytic")
    assert spans is not None
    assert (spans["op"] == "dp.all_reduce").any() == bool(dp_shard)
    assert analytic["step_time_s"] == pytest.approx(engine["step_time_s"], rel=1e-6)


def test_engine_and_analytic_agree_on_the_documented_example() -> None:
    """Llama-3 8B on 8 nodes, dp 64, dp_shard 8 (docs/parallelism.md): the closed form
    within the 5 % tests/test_analytic.py allows of the engine."""
    s = scenario_from_dict({
        "name": "llama3-8b-hsdp", "stack": "torchtitan", "model": {"preset": "llama3-8b"},
        "cluster": {"system": "dgx-h100", "nodes": 8},
        "parallel": {"dp": 64, "dp_shard": 8, "zero": 3, "recompute": "selective"},
        "training": {"global_batch": 128, "micro_batch": 1, "dtype": "bf16"}})
    engine, _ = simulate_scenario(s, "engine")
    analytic, _ = simulate_scenario(s, "analytic")
    assert analytic["step_time_s"] == pytest.approx(engine["step_time_s"], rel=0.05)


def test_two_streams_pipelines_the_all_reduces_behind_the_reduce_scatters() -> None:
    """Three units of (reduce-scatter, all-reduce): the slower stream sets the pace, the
    other adds its first (or last) step."""
    assert two_streams([(1.0, 2.0)] * 3) == 1.0 + 3 * 2.0
    assert two_streams([(2.0, 1.0)] * 3) == 3 * 2.0 + 1.0
    assert two_streams([(1.0, 1.0), (3.0, 0.5)]) == 4.5
    assert two_streams([]) == 0.0


def test_folded_equals_full_fidelity() -> None:
    """One rank simulated for the stage (its collectives charged for their groups)
    gives the step of every rank simulated."""
    folded, _ = simulate_scenario(hsdp(8), fidelity="folded")
    full, _ = simulate_scenario(hsdp(8), fidelity="full")
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)


def errors(**parallel: Any) -> list[str]:
    with pytest.raises(ScenarioError) as e:
        hsdp(**parallel)
    return e.value.lines()


@pytest.mark.parametrize(("parallel", "words"), [
    ({"dp_shard": 8, "zero": 2}, "parallel.dp_shard = 8: hybrid sharding shards ZeRO-3's"),
    ({"dp_shard": 6}, "parallel.dp_shard = 6: must divide parallel.dp (16): dp / dp_shard "
                      "replicas of one shard group; choose one of [2, 4, 8, 16]"),
    ({"dp_shard": 1}, "parallel.dp_shard = 1: shards nothing"),
])
def test_rules_name_field_value_and_fix(parallel: dict[str, Any], words: str) -> None:
    lines = errors(**parallel)
    assert any(words in line for line in lines), lines


def test_not_yet_simulated_with_offload() -> None:
    """ZeRO-Offload steps the whole dp group's shard: refused with dp_shard < dp, not
    with dp_shard = dp (full sharding)."""
    problems = not_yet_simulated(hsdp(8, zero_offload=True))
    assert [(p.field, p.value) for p in problems] == [("parallel.dp_shard", 8)]
    assert "parallel.zero_offload" in problems[0].fix
    assert not_yet_simulated(hsdp(16, zero_offload=True)) == []


def test_layout_of_carries_the_shard_degree() -> None:
    assert layout_of(hsdp(4)).shard_group(5) == (4, 5, 6, 7)


def test_the_engine_budget_counts_the_all_reduces() -> None:
    """One more task per layer and micro-batch: the replicas' all-reduce."""
    assert tasks_per_layer(hsdp(8)) == tasks_per_layer(hsdp(16)) + 1


def test_nccl_buffers_of_the_shard_and_the_replicate_communicators() -> None:
    """Hybrid sharding uses two communicators where full sharding uses one: a ring's
    buffers more per GPU."""
    hybrid, full = hsdp(8), hsdp(None)
    assert [(c.name, c.ranks, c.stride) for c in communicators(hybrid, 0)] == \
        [("dp", 8, 1), ("replicate", 2, 8)]
    assert [(c.name, c.ranks) for c in communicators(full, 0)] == [("dp", 16)]
    nccl = [dict(stage_breakdown(x, 0).device)["NCCL buffers"] for x in (hybrid, full)]
    assert nccl[0] == 2 * nccl[1] > 0


def test_the_timeline_title_names_the_shard_degree() -> None:
    from simulator.outputs.plots.timeline import _timeline_title

    for shard, words in ((8, "dp=16, dp_shard=8 ·"), (None, "dp=16 ·")):
        results, spans = simulate_scenario(hsdp(shard))
        assert spans is not None
        assert words in _timeline_title(spans, results)
