"""ZeRO-3 / FSDP with a mixture of experts (simulator/strategies/zero3/experts.py).

torchtitan's ``apply_fsdp`` (torchtitan/models/llama4/infra/parallelize.py) wraps each
MoE block's routed experts with ``fully_shard`` on the expert data-parallel mesh
(``efsdp`` = dp_shard · cp · tp / (etp · ep) ranks) and the rest of the block on the
dense data-parallel mesh. So per MoE layer and micro-batch a rank all-gathers
experts · mlp_params(expert_ffn) / (etp · ep) elements over edp before the forward
and again before the backward, and reduce-scatters as many gradients over edp; the
dense unit (attention, norms, router, shared experts) goes over dp as a dense
layer's does. ZeRO-3 then divides the dense states by tp · dp and the experts' by
etp · ep · edp = tp · dp alike, whatever ep is; what ep changes is the size of the
gathered experts (1/ep).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cpu_profile import in_line_scenario
from hypothesis import given, settings
from hypothesis import strategies as st
from test_accounting import assert_partition
from test_expert_parallel import COMPOSED, TINY_MOE

from simulator.analysis.memory import memory_report, states
from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload, layout_of
from simulator.engine.lockstep import lockstep_size
from simulator.model import moe
from simulator.model.memory import stage_params
from simulator.spec.load import apply_overrides, scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.strategies.expert.layer import edp_group
from simulator.strategies.zero3.counts import zero3_collective_counts

H, FFN_E, EXPERTS = 256, 512, 4  # TINY_MOE: SwiGLU experts, no biases


def tiny(*sets: str) -> Scenario:
    """TINY_MOE (2 MoE layers, 4 experts, dp 4) under ZeRO-3 with ``sets``."""
    return scenario_from_dict(apply_overrides(TINY_MOE, ["parallel.zero=3", *sets]))


def expert_layer_elements(ep: int, etp: int = 1) -> float:
    """One MoE layer's routed experts on one rank, by hand: E/ep experts of three
    h × ffn_e matrices (gate, up, down), each split over etp."""
    return EXPERTS * 3 * H * FFN_E / (etp * ep)


# ---------------------------------------------------------------- the workload


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_gathers_and_reduce_scatters_are_the_closed_form(ep: int) -> None:
    """Per MoE layer and micro-batch: two all-gathers of the rank's experts (bf16) over
    edp (forward and, resharded, backward) and one reduce-scatter of their gradients in
    the stack's reduction dtype; the dense unit's gathers over dp carry the rest of the
    layer."""
    s = tiny(f"parallel.ep={ep}")
    w = build_workload(s, fidelity="full")
    m, layers = s.microbatches, s.model.layers
    for rank in range(s.parallel.world):
        tasks = [t for t in w.tasks if t.rank == rank]
        edp = edp_group(w.layout, rank, 1, ep)
        gathers = [t for t in tasks if t.op == "zero.all_gather" and "experts" in t.name]
        scatters = [t for t in tasks if t.op == "dp.reduce_scatter" and "experts" in t.name]
        if ep == EXPERTS:  # edp 1: the experts are not sharded, nothing to gather
            assert not gathers and not scatters
            continue
        assert len(gathers) == 2 * layers * m and len(scatters) == layers * m
        assert {t.group for t in gathers + scatters} == {edp}
        assert {t.nbytes for t in gathers} == {2 * expert_layer_elements(ep)}
        rdt = s.stack.reduce_bytes(2)
        assert {t.nbytes for t in scatters} == {rdt * expert_layer_elements(ep)}
        dense = [t for t in tasks if t.op == "zero.all_gather" and t.layer >= 0
                 and "experts" not in t.name]
        elements = moe.layer_params(s.model, 0) - moe.expert_params(s.model, 0)
        assert {t.nbytes for t in dense} == {2 * elements}
        assert {t.group for t in dense} == {w.layout.shard_group(rank)}


def test_the_expert_gather_follows_its_layers_gather_on_the_same_stream() -> None:
    """torchtitan prefetches [next block, next block's experts] together: the expert
    unit's gather is issued right after its layer's, on the zero stream, and the layer's
    compute waits for it."""
    s = tiny("parallel.ep=2")
    w = build_workload(s, fidelity="full")
    zero = [t for t in w.tasks if t.rank == 0 and t.stream == "zero"]
    compute = [t for t in w.tasks if t.rank == 0 and t.stream == "compute"]
    experts = [i for i, t in enumerate(zero) if "experts" in t.name]
    assert len(experts) == 2 * s.model.layers * s.microbatches
    for i in experts:
        t, before = zero[i], zero[i - 1]
        assert before.op == "zero.all_gather" and "experts" not in before.name
        assert (before.layer, before.microbatch) == (t.layer, t.microbatch)
        assert any(t.id in c.deps for c in compute
                   if (c.layer, c.microbatch) == (t.layer, t.microbatch))


@pytest.mark.parametrize("case", [
    pytest.param([], id="composed"),
    pytest.param(["model.first_dense_layers=1"], id="first-dense"),
    pytest.param(["parallel.reshard_after_forward=false", "stack=torchtitan"], id="no-reshard"),
    pytest.param(["parallel.ep=2", "parallel.expert_tp=2"], id="expert-tp"),
])
def test_counts_agree_and_folded_equals_full(case: list[str]) -> None:
    """The analytic method's collective counts are the engine's on every stage; the
    folded run equals the full one; the step partitions; lock-step falls back (MoE)."""
    s = scenario_from_dict(apply_overrides(COMPOSED, ["parallel.zero=3", *case]))
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, spans = simulate_scenario(s, "engine", "full")
    assert spans is not None
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)
    for k, v in folded["step_breakdown_s"].items():
        assert v == pytest.approx(full["step_breakdown_s"][k], rel=1e-9, abs=1e-12), k
    assert_partition(full)
    assert lockstep_size(build_workload(s, fidelity="full"), alone=True) == 1
    layout = layout_of(s)
    for rank, g in spans.groupby("rank"):
        expected = zero3_collective_counts(s, layout.coord(int(rank)).pp)
        assert (g["op"] == "zero.all_gather").sum() == expected["all_gather"], rank
        assert (g["op"] == "dp.reduce_scatter").sum() == expected["reduce_scatter"], rank
    analytic, _ = simulate_scenario(s, "analytic")
    assert_partition(analytic)
    assert analytic["step_time_s"] == pytest.approx(folded["step_time_s"], rel=0.25)


def test_analytic_prices_the_expert_units_the_engine_issues_in_line(tmp_path: Path) -> None:
    """On the in-line CPU profile (communication in line with compute) ZeRO-3 over
    ZeRO-2 costs the same in the estimate as in the engine: each layer's dense gathers
    over dp, its experts' gathers over edp, FSDP2's copies around both, and the
    per-unit reduce-scatters. (A MoE step's two optimizer kernels, dense and experts,
    differ by a fixed few microseconds between the two methods under any ZeRO stage.)"""
    in_line_scenario(tmp_path, "pytorch-eager", {"dp": 2})  # writes the profile
    steps: dict[tuple[int, str], float] = {}
    for ep in (1, 2):
        for zero in (2, 3):
            s = scenario_from_dict({
                "name": "t", "stack": "pytorch-eager",
                "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32,
                          "activation": "swiglu", "experts": 4, "experts_per_token": 2,
                          "expert_ffn_hidden": 64, "bias": False},
                "cluster": {"system": str(tmp_path / "cpu.yaml"), "nodes": 1,
                            "gpus_per_node": 2},
                "parallel": {"dp": 2, "ep": ep, "zero": zero},
                "training": {"global_batch": 8, "micro_batch": 2, "dtype": "fp32"}})
            for method in ("engine", "analytic"):
                steps[(zero, method)] = simulate_scenario(s, method)[0]["step_time_s"]
        zero3 = {m: steps[(3, m)] - steps[(2, m)] for m in ("engine", "analytic")}
        assert zero3["engine"] > 0
        assert zero3["analytic"] == pytest.approx(zero3["engine"], rel=1e-9), ep


# ---------------------------------------------------------------- memory


def test_memory_divides_every_state_by_the_stage_ranks() -> None:
    """ZeRO-3: dense states over dp (÷ tp), expert states over edp (÷ etp · ep), so
    every parameter's states over tp · dp; the buffers hold (1 + prefetch) gathered
    layers with their experts, one unsharded layer gradient and the root."""
    s = scenario_from_dict(apply_overrides(COMPOSED, ["parallel.zero=3",
                                                      "stack=torchtitan"]))
    par = s.parallel
    ranks = par.tp * par.dp
    for stage, m in enumerate(memory_report(s)):
        params = stage_params(s.model, par.pp, stage)
        w, g, o = (4.0, 4.0, 8.0)  # torchtitan: fp32 parameters are the master (FSDP2 MP)
        assert m.weights == pytest.approx(w * params / ranks, rel=1e-12)
        assert states(s, stage)[1] == pytest.approx(g * params / ranks, rel=1e-12)
        # under torchtitan's pipelining the sharded gradients are made after the last
        # backward (strategies.zero3.deferred): at the peak only what exceeds the
        # activations then (fsdp_grads_at_peak)
        assert m.gradients <= max(g * params / ranks - m.activations, 0.0) + 1e-6
        assert m.optimizer == pytest.approx(o * params / ranks, rel=1e-12)
    layer = (moe.layer_params(s.model, 0) - moe.expert_params(s.model, 0)) / par.tp \
        + moe.expert_params(s.model, 0) / (par.etp * par.ep)
    middle = scenario_from_dict(apply_overrides(COMPOSED, [
        "parallel.zero=3", "stack=torchtitan", "parallel.pp=4", "model.layers=8",
        "cluster.nodes=4", "model.tied_embeddings=false"]))
    stage1 = memory_report(middle)[1]  # no root: embedding on 0, head on 3
    # torchtitan pipelines with torch.distributed.pipelining, which defers FSDP2's
    # reductions to the stage's last backward (strategies.zero3.deferred): both layers
    # stay gathered, one fresh unsharded gradient, both layers' accumulated in fp32
    assert middle.microbatches > 1
    assert stage1.comm_buffers == pytest.approx(2 * layer * (2 + 1 + 2 * 2), rel=1e-12)


@settings(max_examples=8, deadline=None)
@given(ep=st.sampled_from([1, 2, 4]), dp=st.sampled_from([4, 8]))
def test_raising_ep_shrinks_the_gathered_experts_not_the_states(ep: int, dp: int) -> None:
    """At fixed everything else, the expert states per rank stay E / (tp · dp) (ZeRO-3
    shards them over etp · ep · edp = tp · dp ranks whatever the split), while each
    gathered expert unit, the all-gather's output, and so the buffers, fall as 1/ep."""
    s = tiny(f"parallel.dp={dp}", f"cluster.nodes={dp}", f"parallel.ep={ep}")
    one = tiny(f"parallel.dp={dp}", f"cluster.nodes={dp}", "parallel.ep=1")
    a, b = memory_report(s)[0], memory_report(one)[0]
    assert a.weights + a.gradients + a.optimizer == pytest.approx(
        b.weights + b.gradients + b.optimizer, rel=1e-12)
    assert b.comm_buffers - a.comm_buffers == pytest.approx(
        2 * 3 * (expert_layer_elements(1) - expert_layer_elements(ep)), rel=1e-12)
    w = build_workload(s, fidelity="folded")
    sizes = {t.nbytes for t in w.tasks if t.op == "zero.all_gather" and "experts" in t.name}
    assert sizes == ({2 * expert_layer_elements(ep)} if dp * 1 > ep else set())


# ---------------------------------------------------------------- what stays refused


@pytest.mark.parametrize(("sets", "field"), [
    (["parallel.zero_offload=true"], "parallel.zero_offload"),
    (["stack=deepspeed"], "parallel.zero"),
    (["parallel.dp_shard=2"], "parallel.dp_shard"),
])
def test_what_stays_refused(sets: list[str], field: str) -> None:
    """ZeRO-Offload and hybrid sharding with experts are not built; DeepSpeed's engine
    asserts "MoE not supported with Stage 3"."""
    from simulator.strategies import registry

    s = tiny("parallel.ep=2", *sets)
    problems = [p for strategy in registry.strategies() for p in strategy.unsupported(s)]
    assert [p.field for p in problems] == [field], problems


def test_the_estimate_counts_the_links_the_gathers_share_with_the_reductions() -> None:
    """Four nodes of one GPU each, each rank's half of the experts (EP 2) gathered over
    edp 2 with their fp32 gradients reduce-scattered over the same peers: the links, not the
    compute, set the pace. The estimate holds to 10% of the engine because each
    micro-batch's gathers wait for the part of its compute window the reduce-scatters
    fill (without that, 41% short). The engine's exposed data-parallel time is the gathers'
    and, since the compute stream waits for each backward's reductions, the
    reduce-scatters' (tests/test_zero3_reduce_wait.py)."""
    s = tiny("parallel.overlap.dp=true", "parallel.ep=2", "model.hidden=1024",
             "model.expert_ffn_hidden=4096", "model.seq_len=2048", "training.global_batch=32")
    engine, _ = simulate_scenario(s, "engine")
    analytic, _ = simulate_scenario(s, "analytic")
    exposed = engine["step_breakdown_s"]["zero_transfer"] \
        + engine["step_breakdown_s"]["dp_transfer"]
    assert exposed > 0.2 * engine["step_time_s"]
    assert analytic["step_time_s"] == pytest.approx(engine["step_time_s"], rel=0.10)


def test_without_data_parallelism_nothing_is_gathered() -> None:
    """dp 1, tp 2 with expert_tp 1: edp is 2, but ZeRO-3 is not installed without data
    parallelism, so neither method gathers the experts (the estimate priced two
    gathers per MoE layer and micro-batch that the engine never issued)."""
    s = tiny("parallel.dp=1", "parallel.tp=2", "parallel.expert_tp=1", "parallel.ep=1",
             "parallel.sequence_parallel=true", "cluster.nodes=2",
             "parallel.overlap.zero3_prefetch=false")  # a gather would be exposed in full
    assert s.parallel.edp == 2
    assert zero3_collective_counts(s, 0)["all_gather"] == 0
    _, spans = simulate_scenario(s, "engine")
    assert spans is not None and not (spans["op"] == "zero.all_gather").any()
    analytic, _ = simulate_scenario(s, "analytic")
    assert analytic["step_breakdown_s"]["zero_transfer"] == 0.0
