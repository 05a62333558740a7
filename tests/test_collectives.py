"""Collective plans and their timing: closed forms (docs/model.md "Communication
volumes"), nccl-tests' busbw conventions, and the step-by-step expansion agreeing
with the aggregated plan (directly and through the engine)."""

from __future__ import annotations

import math

import pytest

from simulator.analysis.report import spans_frame
from simulator.builder.tasks import Program, Task, Workload
from simulator.engine.engine import simulate
from simulator.schedules.registry import build_schedule
from simulator.spec.load import scenario_from_dict
from simulator.system.collectives.choice import candidates, make_plan
from simulator.system.collectives.cost import estimate, expand
from simulator.system.collectives.plan import GroupShape, Plan, busbw, busbw_factor
from simulator.system.collectives.tuner import nccl_plans
from simulator.system.layout import Layout
from simulator.system.profiles import load_system

HW = load_system("dgx-a100-80gb")
B_INTRA = HW.intra_node.bandwidth_GBps * 1e9 * HW.intra_node.efficiency
B_INTER = HW.inter_node.bandwidth_GBps * 1e9 * HW.inter_node.efficiency
A_INTRA = HW.intra_node.latency_us * 1e-6
A_INTER = HW.inter_node.latency_us * 1e-6
SIZES = [1e3, 1e6, 64e6, 1e9]


def ring_all_reduce_time(n: int, size: float, bw: float, alpha: float) -> float:
    return 2 * (n - 1) / n * size / bw + 2 * (n - 1) * alpha


# ------------------------------------------------------------------ nccl-tests


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64, 1024])
def test_busbw_factor_matches_nccl_tests(n):
    """nccl-tests doc/PERFORMANCE.md: all-reduce 2(n-1)/n; all-gather and
    reduce-scatter (n-1)/n; broadcast and sendrecv 1."""
    assert busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n, rel=1e-15)
    assert busbw_factor("all_gather", n) == pytest.approx((n - 1) / n, rel=1e-15)
    assert busbw_factor("reduce_scatter", n) == pytest.approx((n - 1) / n, rel=1e-15)
    assert busbw_factor("broadcast", n) == 1.0
    assert busbw_factor("send_recv", n) == 1.0


def test_busbw_factor_single_rank_reduction_ops_are_zero():
    # nccl-tests: 2(n-1)/n and (n-1)/n are 0 at n = 1
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert busbw_factor(op, 1) == 0.0


def test_busbw_factor_single_rank_broadcast_is_one():
    assert busbw_factor("broadcast", 1) == 1.0
    assert busbw_factor("send_recv", 1) == 1.0


@pytest.mark.parametrize("n", [2, 8])
def test_busbw_of_ring_all_reduce_is_link_rate_without_latency(n):
    """busbw of a bandwidth-bound ring all-reduce equals the link's achievable rate
    (that is what nccl-tests' busbw is designed to show)."""
    hw = HW.model_copy(update={"intra_node": HW.intra_node.model_copy(update={"latency_us": 0.0})})
    size = 1e9
    t = estimate(make_plan("all_reduce", size, GroupShape(n, n), "ring", hw), hw)
    assert busbw("all_reduce", n, size, t) == pytest.approx(B_INTRA, rel=1e-12)


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("size", SIZES)
def test_ring_all_reduce_one_node_closed_form(n, size):
    plan = make_plan("all_reduce", size, GroupShape(n, n), "ring", HW)
    assert plan.algorithm == "ring"
    assert estimate(plan, HW) == pytest.approx(ring_all_reduce_time(n, size, B_INTRA, A_INTRA),
                                               rel=1e-12)
    # per-rank volume and steps
    (phase,) = plan.phases
    (leg,) = phase.legs
    assert leg.link_class == "intra_node"
    assert leg.bytes_per_rank == pytest.approx(2 * (n - 1) / n * size, rel=1e-15)
    assert phase.steps == 2 * (n - 1)


@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.parametrize("size", SIZES)
def test_ring_all_reduce_one_gpu_per_node_closed_form(n, size):
    """One rank per node: only the inter-node link class."""
    plan = make_plan("all_reduce", size, GroupShape(n, 1), "ring", HW)
    assert [leg.link_class for leg in plan.phases[0].legs] == ["inter_node"]
    assert estimate(plan, HW) == pytest.approx(ring_all_reduce_time(n, size, B_INTER, A_INTER),
                                               rel=1e-12)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_gather_scatter_one_node_closed_form(op, n):
    size = 64e6
    plan = make_plan(op, size, GroupShape(n, n), "ring", HW)
    expected = (n - 1) / n * size / B_INTRA + (n - 1) * A_INTRA
    assert estimate(plan, HW) == pytest.approx(expected, rel=1e-12)


def test_ring_all_reduce_across_nodes_rails():
    """n = k·N, k per node: the flat ring's every link carries 2(n-1)/n·S, so each of
    a node's k NICs carries 2(n-1)/n·S/k and NVLink 2(n-1)/n·S; the slower leg sets
    the time, plus 2(n-1) steps at the inter-node α."""
    k, nodes, size = 8, 4, 256e6
    n = k * nodes
    plan = make_plan("all_reduce", size, GroupShape(n, k), "ring", HW)
    legs = {leg.link_class: leg.bytes_per_rank for leg in plan.phases[0].legs}
    assert legs["inter_node"] == pytest.approx(2 * (n - 1) / n * size / k, rel=1e-15)
    assert legs["intra_node"] == pytest.approx(2 * (n - 1) / n * size, rel=1e-15)
    expected = max(legs["inter_node"] / B_INTER, legs["intra_node"] / B_INTRA) \
        + 2 * (n - 1) * A_INTER
    assert estimate(plan, HW) == pytest.approx(expected, rel=1e-12)


def test_hierarchical_all_reduce_closed_form():
    k, nodes, size = 8, 4, 256e6
    plan = make_plan("all_reduce", size, GroupShape(k * nodes, k), "hierarchical", HW)
    intra = (k - 1) / k * size / B_INTRA + (k - 1) * A_INTRA
    inter = 2 * (nodes - 1) / nodes * size / k / B_INTER + 2 * (nodes - 1) * A_INTER
    assert estimate(plan, HW) == pytest.approx(2 * intra + inter, rel=1e-12)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
@pytest.mark.parametrize("shape", [GroupShape(8, 8), GroupShape(16, 8), GroupShape(32, 4),
                                   GroupShape(4, 1)])
@pytest.mark.parametrize("size", [1e4, 1e8])
def test_auto_picks_cheapest_candidate(op, shape, size):
    """auto is NCCL's tuner: the cheapest of NCCL's (algorithm, protocol) plans."""
    auto = make_plan(op, size, shape, "auto", HW)
    plans = nccl_plans(op, size, shape, HW)
    assert {p.algorithm for p in plans} == set(candidates(op, shape))
    best = min(estimate(p, HW) for p in plans)
    assert estimate(auto, HW) == pytest.approx(best, rel=1e-15)


def test_single_rank_collective_is_free():
    plan = make_plan("all_reduce", 1e9, GroupShape(1, 1), "auto", HW)
    assert estimate(plan, HW) == 0.0


def test_send_recv_across_nodes_uses_inter_node_link():
    size = 64e6
    plan = make_plan("send_recv", size, GroupShape(2, 1), "auto", HW)
    assert estimate(plan, HW) == pytest.approx(size / B_INTER + A_INTER, rel=1e-12)


def test_send_recv_within_node():
    size = 64e6
    plan = make_plan("send_recv", size, GroupShape(2, 2), "auto", HW)
    assert estimate(plan, HW) == pytest.approx(size / B_INTRA + A_INTRA, rel=1e-12)


# ------------------------------------------------------------------ expansion


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "hierarchical", "auto"])
@pytest.mark.parametrize("shape", [GroupShape(2, 2), GroupShape(8, 8), GroupShape(16, 8),
                                   GroupShape(8, 2), GroupShape(4, 1)])
@pytest.mark.parametrize("size", [1e4, 1e6, 1e9])
def test_expand_agrees_with_aggregated(op, algorithm, shape, size):
    plan = make_plan(op, size, shape, algorithm, HW)
    steps = sum(ph.steps for ph in plan.phases)
    exp = expand(plan)
    assert len(exp.phases) == steps
    assert all(ph.steps == 1 for ph in exp.phases)
    # same bytes per link class in total
    for cls in ("intra_node", "inter_node"):
        agg = sum(leg.bytes_per_rank for ph in plan.phases for leg in ph.legs
                  if leg.link_class == cls)
        stp = sum(leg.bytes_per_rank for ph in exp.phases for leg in ph.legs
                  if leg.link_class == cls)
        assert stp == pytest.approx(agg, rel=1e-9)
    assert estimate(exp, HW) == pytest.approx(estimate(plan, HW), rel=0.01)


# ------------------------------------------------------------------ through the engine


def _collective_workload(plans: list[Plan], n: int, gpus_per_node: int,
                         fidelity: str = "full") -> Workload:
    """A workload of nothing but collectives over ranks 0..n-1 (one TP group): the
    i-th plan runs on stream compute (i even) or dp (i odd), all concurrently."""
    layout = Layout(tp=n, pp=1, dp=1, gpus_per_node=gpus_per_node)
    ranks = tuple(range(n)) if fidelity == "full" else (0,)
    tasks: list[Task] = []
    programs = {r: Program(r, {"compute": [], "pp": [], "dp": []}) for r in ranks}
    group = tuple(range(n))
    for r in ranks:
        for i, plan in enumerate(plans):
            stream = "compute" if i % 2 == 0 else "dp"
            t = Task(id=len(tasks), rank=r, stream=stream, op=f"tp.{plan.op}", kind="tp",
                     name=f"c{i}", plan=plan, group=group, group_key=("c", i), nbytes=plan.size)
            tasks.append(t)
            programs[r].streams[stream].append(t)
    weight = 1.0 if fidelity == "full" else float(n)
    return Workload(programs, tasks, layout, build_schedule("1f1b", 1, 1), weight, fidelity)


def all_to_all_time(n: int, size: float, bw: float, alpha: float) -> float:
    """Pairwise exchange: (n-1)/n·S over the group's one link class, n-1 steps of α."""
    return (n - 1) / n * size / bw + (n - 1) * alpha


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("fidelity", ["full", "folded"])
@pytest.mark.parametrize(("op", "closed_form"), [("all_reduce", ring_all_reduce_time),
                                                 ("all_to_all", all_to_all_time)])
def test_engine_one_node_closed_form(n, fidelity, op, closed_form):
    size = 32e6
    plan = make_plan(op, size, GroupShape(n, n), "ring", HW)  # all-to-all: pairwise
    res = simulate(_collective_workload([plan], n, n, fidelity), HW)
    assert len(res.spans) == len(res.workload.tasks)
    assert res.end_time == pytest.approx(closed_form(n, size, B_INTRA, A_INTRA),
                                         rel=1e-9)


@pytest.mark.parametrize("n", [2, 4])
def test_engine_ring_all_reduce_one_gpu_per_node(n):
    size = 32e6
    plan = make_plan("all_reduce", size, GroupShape(n, 1), "ring", HW)
    res = simulate(_collective_workload([plan], n, 1), HW)
    assert res.end_time == pytest.approx(ring_all_reduce_time(n, size, B_INTER, A_INTER),
                                         rel=1e-9)
    assert res.link_busy.get("inter_node", 0.0) > 0
    assert res.link_busy.get("intra_node", 0.0) == 0.0


@pytest.mark.parametrize("algorithm", ["ring", "tree", "hierarchical", "auto"])
@pytest.mark.parametrize("shape", [GroupShape(4, 4), GroupShape(8, 8), GroupShape(8, 4),
                                   GroupShape(4, 2)])
@pytest.mark.parametrize("size", [1e5, 32e6])
def test_engine_expand_agrees_with_aggregated(algorithm, shape, size):
    plan = make_plan("all_reduce", size, shape, algorithm, HW)
    agg = simulate(_collective_workload([plan], shape.n, shape.per_node), HW).end_time
    stp = simulate(_collective_workload([expand(plan)], shape.n, shape.per_node), HW).end_time
    assert agg == pytest.approx(estimate(plan, HW), rel=1e-9)
    assert stp == pytest.approx(agg, rel=0.01)


@pytest.mark.parametrize(("shape", "algorithm"), [(GroupShape(8, 8), "nvls"),
                                                  (GroupShape(16, 8), "nvls_tree")])
def test_engine_runs_nvls_plans_at_their_estimate(shape, algorithm):
    """NVLS plans (H100: NVSwitch gen 3) through the engine: the legs at the protocol's
    rate factor, NCCL's latency after them; the step-by-step form agrees."""
    hw = load_system("dgx-h100")
    plan = make_plan("all_reduce", 1e9, shape, "auto", hw)
    assert plan.algorithm == algorithm
    agg = simulate(_collective_workload([plan], shape.n, shape.per_node), hw).end_time
    stp = simulate(_collective_workload([expand(plan)], shape.n, shape.per_node), hw).end_time
    assert agg == pytest.approx(estimate(plan, hw), rel=1e-9)
    assert stp == pytest.approx(agg, rel=0.01)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_engine_two_concurrent_all_reduces_share_links(n):
    """Two identical all-reduces on the same ranks at once (compute and dp streams):
    the bandwidth term doubles, the latency term does not; expansion agrees."""
    size = 32e6
    plan = make_plan("all_reduce", size, GroupShape(n, n), "ring", HW)
    expected = 2 * (2 * (n - 1) / n * size / B_INTRA) + 2 * (n - 1) * A_INTRA
    agg = simulate(_collective_workload([plan, plan], n, n), HW)
    assert agg.end_time == pytest.approx(expected, rel=1e-9)
    stp = simulate(_collective_workload([expand(plan), expand(plan)], n, n), HW)
    assert stp.end_time == pytest.approx(agg.end_time, rel=0.01)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_scenario_tp_all_reduce_spans_match_closed_form(n):
    """One node, tp = n, pp = dp = 1: every TP all-reduce span of b·s·h·2 bytes takes
    2(n-1)/n·S/B + 2(n-1)α (nothing else shares the NVLink ports)."""
    s = scenario_from_dict({
        "name": "tp-ring",
        "model": {"layers": 2, "hidden": 256, "heads": 8, "vocab": 512, "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": n},
        "parallel": {"tp": n, "pp": 1, "dp": 1},
        "training": {"global_batch": 2, "micro_batch": 1},
        "simulation": {"collective_algorithm": "ring"},
    })
    from simulator.builder.workload import build_workload

    res = simulate(build_workload(s), s.hardware)
    df = spans_frame(res)
    all_tp = df[df["op"] == "tp.all_reduce"]
    # the vocab-parallel ends per micro-batch: embedding, output-layer input gradient,
    # three fp32-per-token cross-entropy reductions
    ends = all_tp[all_tp["layer"] < 0]
    assert len(ends) == 2 * 5
    assert sorted(set(ends["bytes"])) == [4 * 128, 1 * 128 * 256 * 2]
    tp = all_tp[all_tp["layer"] >= 0]
    assert len(tp) == 2 * 2 * 2 * 2  # 2 per pass × (fwd, bwd) × layers × micro-batches
    size = 1 * 128 * 256 * 2
    assert (tp["bytes"] == size).all()
    expected = ring_all_reduce_time(n, size, B_INTRA, A_INTRA)
    for dur in tp["end"] - tp["start"]:
        assert dur == pytest.approx(expected, rel=1e-9)
    assert math.isfinite(res.end_time)


# ------------------------------------------------------------------ all-to-all


def test_busbw_factor_all_to_all_matches_nccl_tests():
    """nccl-tests alltoall_perf: busbw = algbw × (n-1)/n."""
    for n in (1, 2, 8, 64):
        assert busbw_factor("all_to_all", n) == pytest.approx((n - 1) / n, rel=1e-15)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("size", SIZES)
def test_all_to_all_one_node_closed_form(n, size):
    plan = make_plan("all_to_all", size, GroupShape(n, n), "auto", HW)
    (phase,) = plan.phases
    assert (plan.algorithm, phase.steps, [g.link_class for g in phase.legs]) == (
        "pairwise", n - 1, ["intra_node"])
    assert phase.legs[0].bytes_per_rank == pytest.approx((n - 1) / n * size, rel=1e-15)
    assert estimate(plan, HW) == pytest.approx(all_to_all_time(n, size, B_INTRA, A_INTRA),
                                               rel=1e-12)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_all_to_all_one_gpu_per_node_closed_form(n):
    size = 64e6
    plan = make_plan("all_to_all", size, GroupShape(n, 1), "auto", HW)
    assert [leg.link_class for leg in plan.phases[0].legs] == ["inter_node"]
    assert estimate(plan, HW) == pytest.approx(all_to_all_time(n, size, B_INTER, A_INTER),
                                               rel=1e-12)


def test_all_to_all_across_nodes_bottleneck_leg():
    """k per node on N nodes: NVLink carries (k-1)/n·S, the NIC (n-k)/n·S, at once."""
    k, nodes, size = 8, 4, 256e6
    n = k * nodes
    plan = make_plan("all_to_all", size, GroupShape(n, k), "ring", HW)  # ring: not for a2a
    assert plan.algorithm == "pairwise"
    legs = {leg.link_class: leg.bytes_per_rank for leg in plan.phases[0].legs}
    assert legs == {"intra_node": pytest.approx((k - 1) / n * size),
                    "inter_node": pytest.approx((n - k) / n * size)}
    assert sum(legs.values()) == pytest.approx((n - 1) / n * size, rel=1e-15)
    expected = max(legs["inter_node"] / B_INTER, legs["intra_node"] / B_INTRA) \
        + (n - 1) * A_INTER
    assert estimate(plan, HW) == pytest.approx(expected, rel=1e-12)


def test_hierarchical_all_to_all_is_explicit_and_closed_form():
    k, nodes, size = 8, 4, 256e6
    shape = GroupShape(k * nodes, k)
    assert make_plan("all_to_all", size, shape, "auto", HW).algorithm == "pairwise"
    plan = make_plan("all_to_all", size, shape, "hierarchical", HW)
    intra = (k - 1) / k * size / B_INTRA + (k - 1) * A_INTRA
    inter = (nodes - 1) / nodes * size / B_INTER + (nodes - 1) * A_INTER
    assert estimate(plan, HW) == pytest.approx(intra + inter, rel=1e-12)
    # small messages: fewer latency steps win; large: the pairwise legs overlap
    small = [estimate(make_plan("all_to_all", 1e3, shape, a, HW), HW)
             for a in ("pairwise", "hierarchical")]
    assert small[1] < small[0]
    # one node or one GPU per node: nothing to arrange hierarchically
    assert make_plan("all_to_all", size, GroupShape(8, 8), "hierarchical",
                     HW).algorithm == "pairwise"


@pytest.mark.parametrize("n", [2, 4])
def test_engine_all_to_all_one_gpu_per_node(n):
    size = 32e6
    plan = make_plan("all_to_all", size, GroupShape(n, 1), "auto", HW)
    res = simulate(_collective_workload([plan], n, 1), HW)
    assert res.end_time == pytest.approx(all_to_all_time(n, size, B_INTER, A_INTER), rel=1e-9)
    assert res.link_busy.get("intra_node", 0.0) == 0.0


@pytest.mark.parametrize("algorithm", ["pairwise", "hierarchical"])
@pytest.mark.parametrize("shape", [GroupShape(8, 4), GroupShape(4, 2)])
def test_engine_all_to_all_across_nodes_equals_estimate(algorithm, shape):
    size = 32e6
    plan = make_plan("all_to_all", size, shape, algorithm, HW)
    assert plan.algorithm == algorithm
    agg = simulate(_collective_workload([plan], shape.n, shape.per_node), HW).end_time
    assert agg == pytest.approx(estimate(plan, HW), rel=1e-9)
    stp = simulate(_collective_workload([expand(plan)], shape.n, shape.per_node), HW).end_time
    assert stp == pytest.approx(agg, rel=0.01)


@pytest.mark.parametrize(("nodes", "gpn"), [(1, 8), (2, 1)])
def test_analytic_all_to_all_time_closed_form(nodes, gpn):
    """The analytic estimate's collective helper on an expert-parallel-sized group."""
    from simulator.strategies.timing import collective_time as _collective_time

    n = nodes * gpn
    s = scenario_from_dict({
        "name": "a2a", "model": {"layers": 2, "hidden": 256, "heads": 8, "vocab": 512,
                                 "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": nodes, "gpus_per_node": gpn},
        "parallel": {"dp": n}, "training": {"global_batch": n}})
    layout = Layout(1, 1, n, gpn)
    size = 8e6
    bw, alpha = (B_INTRA, A_INTRA) if nodes == 1 else (B_INTER, A_INTER)
    assert _collective_time(s, layout, "all_to_all", size, layout.dp_group(0),
                            s.hardware) == pytest.approx(
        all_to_all_time(n, size, bw, alpha), rel=1e-12)
