"""Collectives as NCCL runs them (simulator/system/nccl.py): the algorithm set of a version,
the tuner's choice of algorithm and protocol, and its latency and bandwidth terms
against closed forms worked out by hand from the constants of NCCL's tuning.cc."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.system import nccl
from simulator.system.collectives.choice import candidates, make_plan
from simulator.system.collectives.cost import estimate, expand
from simulator.system.collectives.plan import GroupShape
from simulator.system.collectives.tuner import nccl_gpu, nccl_plan, nccl_plans, nccl_time
from simulator.system.link_specs import AlphaBeta
from simulator.system.profiles import load_system

A100 = load_system("dgx-a100-80gb")  # no NVLS
H100 = load_system("dgx-h100")  # NVLS
B_INTRA = A100.intra_node.bytes_per_s
A_INTRA = A100.intra_node.alpha_s
B_INTER = A100.inter_node.bytes_per_s
A_INTER = A100.inter_node.alpha_s
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
S_NV = A_INTRA / 3.4e-6  # the profile's α over NCCL's NVLink ring/Simple hop (3.4 µs)
S_NET = A_INTER / 14e-6  # ... and over its network ring/Simple hop (14 µs)


# ------------------------------------------------------------------ what NCCL offers


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("size", [1e3, 1e6, 1e9])
def test_ring_all_gather_has_n_minus_1_steps(n: int, size: float) -> None:
    for op in ("all_gather", "reduce_scatter"):
        plan = make_plan(op, size, GroupShape(n, n), "auto", A100)
        assert plan.algorithm == "ring"
        assert [ph.steps for ph in plan.phases] == [n - 1]
        assert len(expand(plan).phases) == n - 1


@settings(max_examples=150, deadline=None)
@given(op=st.sampled_from(OPS), nodes=st.integers(1, 64), per_node=st.sampled_from([1, 2, 4, 8]),
       exponent=st.floats(0, 10.5), version=st.sampled_from(["2.12", "2.18", "2.23", "2.27"]),
       hw=st.sampled_from([A100, H100]))
def test_auto_never_hierarchical(op, nodes, per_node, exponent, version, hw) -> None:  # type: ignore[no-untyped-def]
    shape = GroupShape(nodes * per_node, per_node)
    plan = make_plan(op, 10**exponent, shape, "auto", hw, nccl_version=version)
    assert plan.algorithm != "hierarchical"
    assert "hierarchical" not in candidates(op, shape, version, hw.intra_node.nvls)
    if shape.n > 1:
        assert plan.algorithm in candidates(op, shape, version, hw.intra_node.nvls)
        if op != "all_reduce":
            assert plan.algorithm in ("ring", "pat")


def test_hierarchical_only_when_asked_for() -> None:
    shape = GroupShape(16, 8)
    assert make_plan("all_gather", 1e3, shape, "hierarchical", A100).algorithm == "hierarchical"
    assert make_plan("all_gather", 1e3, shape, "auto", A100).algorithm == "ring"


@pytest.mark.parametrize("shape", [GroupShape(8, 8), GroupShape(16, 8), GroupShape(64, 1)])
def test_tree_only_for_all_reduce(shape: GroupShape) -> None:
    for op in OPS:
        assert ("tree" in candidates(op, shape)) == (op == "all_reduce")
    # an explicit tree for an op NCCL has no tree for runs as a ring
    assert make_plan("broadcast", 1e6, shape, "tree", A100).algorithm == "ring"


def test_pat_only_from_2_23_with_one_rank_per_node() -> None:
    one_per_node, two_per_node = GroupShape(16, 1), GroupShape(32, 2)
    for op in ("all_gather", "reduce_scatter"):
        assert "pat" in candidates(op, one_per_node, "2.23")
        assert "pat" in candidates(op, one_per_node, "2.27.3")
        assert "pat" not in candidates(op, one_per_node, "2.22")
        assert "pat" not in candidates(op, two_per_node, "2.23")
    assert "pat" not in candidates("all_reduce", one_per_node, "2.23")
    # with one rank per node 2.23 charges a ring's network hop as a tree's (LL 5 µs);
    # PAT's 8 + log2(N)·14/3.5 + 2.8·n µs then beats a ring's 6.6 + 5·(n − 1)
    plan = make_plan("all_gather", 1e3, GroupShape(16, 1), "auto", A100, nccl_version="2.23")
    assert (plan.algorithm, plan.protocol) == ("pat", "Simple")
    pat = (8 + 4 * 14 / 3.5 + 16 * 2.8) * S_NET * 1e-6 + 15 / 16 * 1e3 / (B_INTER * 0.75)
    assert estimate(plan, A100) == pytest.approx(pat, rel=1e-12)
    assert make_plan("all_gather", 1e3, GroupShape(16, 1), "auto", A100).algorithm == "ring"


@pytest.mark.parametrize(("version", "ratio"), [("2.18", 0.75), ("2.18.6", 0.75),
                                              ("2.19", 5 / 6), ("2.20.3", 5 / 6)])
def test_nvls_on_one_nvswitch_gen3_node_from_2_17(version: str, ratio: float) -> None:
    assert "nvls" in candidates("all_reduce", GroupShape(8, 8), "2.18", nvls=True)
    assert "nvls" not in candidates("all_reduce", GroupShape(8, 8), "2.16", nvls=True)
    assert "nvls" not in candidates("all_reduce", GroupShape(16, 8), "2.18", nvls=True)
    assert "nvls" not in candidates("all_gather", GroupShape(8, 8), "2.18", nvls=True)
    assert H100.intra_node.nvls and not A100.intra_node.nvls
    big = make_plan("all_reduce", 1e9, GroupShape(8, 8), "auto", H100, version)
    assert (big.algorithm, big.protocol) == ("nvls", "Simple")
    # NVLS: the whole buffer through the port at algbw ratio .75 of its rate (2.18.1
    # tuning.cc ``else if (a == NCCL_ALGO_NVLS) ratio = .75;``), 5/6 from 2.19; NVLink
    # NVLS latency 23 µs either way (2.18's baseLat, 2.19's hwLat[NVLINK])
    expected = 1e9 / (H100.intra_node.bytes_per_s * ratio) \
        + 23.0 / 3.4 * H100.intra_node.alpha_s
    assert estimate(big, H100) == pytest.approx(expected, rel=1e-12)
    assert make_plan("all_reduce", 1e9, GroupShape(8, 8), "auto", A100).algorithm == "ring"


def _nvls_tree(shape: GroupShape, size: float, version: str):  # type: ignore[no-untyped-def]
    return next(p for p in nccl_plans("all_reduce", size, shape, H100, version)
                if p.algorithm == "nvls_tree")


@pytest.mark.parametrize("nodes", [2, 8])
def test_nvls_tree_across_nodes_from_2_18(nodes: int) -> None:
    """NVLS inside each node, a tree over the NICs (tuning.cc 2.19+: one NVLS hop + 2
    log2(N) network hops; bandwidth 5/6 of min(NVLink, network, halved beyond two
    nodes))."""
    shape = GroupShape(8 * nodes, 8)
    assert "nvls_tree" in candidates("all_reduce", shape, "2.18", nvls=True)
    assert "nvls_tree" not in candidates("all_reduce", shape, "2.17", nvls=True)
    assert "nvls_tree" not in candidates("all_reduce", shape, "2.18", nvls=False)
    assert "nvls_tree" not in candidates("all_reduce", GroupShape(8, 8), "2.18", nvls=True)
    assert "nvls_tree" not in candidates("all_reduce", GroupShape(nodes, 1), "2.18", nvls=True)
    assert "nvls_tree" not in candidates("all_gather", shape, "2.18", nvls=True)
    size = 1e9
    plan = _nvls_tree(shape, size, "2.20")
    s_nv, s_net = H100.intra_node.alpha_s / 3.4e-6, H100.inter_node.alpha_s / 14e-6
    log_n = nodes.bit_length() - 1
    latency = (23.0 * s_nv + 2 * log_n * 14.0 * s_net) * 1e-6
    inter = size / 8 / (H100.inter_node.bytes_per_s * 5 / 6 * (0.5 if nodes > 2 else 1.0))
    intra = size / (H100.intra_node.bytes_per_s * 5 / 6)
    assert estimate(plan, H100) == pytest.approx(latency + max(inter, intra), rel=1e-12)
    # on two nodes NVLS-tree halves a large ring all-reduce's network share: it wins
    if nodes == 2:
        assert make_plan("all_reduce", size, shape, "auto", H100, "2.20").algorithm \
            == "nvls_tree"


@pytest.mark.parametrize("nodes", [2, 3, 8, 64])
def test_nvls_tree_of_2_18_is_a_chain_over_the_nodes(nodes: int) -> None:
    """NCCL 2.18.1's tuning.cc: NVLS-tree's latency ``baseLat`` 23 µs +
    ``2*(nNodes-1)*hwLat[NET][NVLS_TREE]`` (19 µs), its algbw ``.70 * nNodes /
    (2*(nNodes-1))`` of nChannels × bwIntra on up to two nodes, × bwInter beyond; the
    leg NCCL does not price runs at its link's rate."""
    shape, size = GroupShape(8 * nodes, 8), 1e9
    plan = _nvls_tree(shape, size, "2.18")
    s_net = H100.inter_node.alpha_s / 14e-6
    latency = (23.0 + 2 * (nodes - 1) * 19.0) * s_net * 1e-6
    ratio = 0.70 * nodes / (2 * (nodes - 1))
    intra = size / (H100.intra_node.bytes_per_s * (ratio if nodes <= 2 else 1.0))
    inter = size / 8 / (H100.inter_node.bytes_per_s * (1.0 if nodes <= 2 else ratio))
    assert estimate(plan, H100) == pytest.approx(latency + max(inter, intra), rel=1e-12)
    assert [p.steps for p in plan.phases] == [1 + 2 * (nodes - 1)]


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(2, 256), exponent=st.floats(3, 10.5))
def test_nvls_tree_latency_grows_linearly_in_2_18_logarithmically_after(
        nodes: int, exponent: float) -> None:
    """Each node more adds two network hops (2 × 19 µs, scaled) to 2.18's NVLS-tree, and
    2 × 14 µs or nothing from 2.19 (where floor(log2 N) steps), so from two nodes on
    2.18's latency is the longer; and 2.18's algbw ratio .70·N / (2(N − 1)) falls as
    nodes are added while each NIC's S / k stays, so its time never falls."""
    alphas = {"nvlink": H100.intra_node.alpha_s, "net": H100.inter_node.alpha_s}

    def latency(n: int, version: str) -> float:
        return nccl.latency_s("nvls_tree", "Simple", "all_reduce", nccl.Shape(8 * n, n),
                              alphas, version)

    step = 2 * 19.0 / 14.0 * H100.inter_node.alpha_s
    assert latency(nodes + 1, "2.18") - latency(nodes, "2.18") == pytest.approx(step)
    grew = latency(nodes + 1, "2.20") - latency(nodes, "2.20")
    assert grew == pytest.approx(0.0) or grew == pytest.approx(2 * H100.inter_node.alpha_s)
    assert latency(nodes, "2.18") > latency(nodes, "2.20")
    size = 10**exponent
    t = [nccl_time(_nvls_tree(GroupShape(8 * n, 8), size, "2.18"), H100)
         for n in (nodes, nodes + 1)]
    assert t[1] > t[0]


def test_version_must_parse() -> None:
    with pytest.raises(ValueError, match=r"MAJOR\.MINOR"):
        candidates("all_reduce", GroupShape(8, 8), "latest")


# ------------------------------------------------------------------ protocols


def _ring_all_reduce_times(n: int, size: float) -> dict[str, float]:
    """NCCL's ring all-reduce on one node of n by hand (tuning.cc 2.20.3): baseLat +
    2(n−1) × hwLat[NVLink][Ring], scaled by α / 3.4 µs, plus 2(n−1)/n·S over the
    link's rate × (LL 1/4, LL128 0.92, Simple 1)."""
    hops = 2 * (n - 1)
    volume = 2 * (n - 1) / n * size
    return {
        "LL": (6.6 + hops * 0.6) * S_NV * 1e-6 + volume / (B_INTRA / 4),
        "LL128": (14.0 + hops * 1.9) * S_NV * 1e-6 + volume / (B_INTRA * 0.92),
        "Simple": (8.4 + hops * 3.4) * S_NV * 1e-6 + volume / B_INTRA,
    }


def _crossover(n: int, a: str, b: str) -> float:
    """The size where protocol b's time meets protocol a's (linear in S)."""
    t0, t1 = _ring_all_reduce_times(n, 0.0), _ring_all_reduce_times(n, 1.0)
    return (t0[b] - t0[a]) / ((t1[a] - t0[a]) - (t1[b] - t0[b]))


@pytest.mark.parametrize(("n", "path"), [(2, ("LL", "Simple")), (4, ("LL", "LL128", "Simple")),
                                         (8, ("LL", "LL128", "Simple"))])
def test_protocol_follows_size_with_crossovers_from_the_constants(n: int, path) -> None:  # type: ignore[no-untyped-def]
    """LL for small messages, Simple for large ones, switching where NCCL's model says
    (on two GPUs LL128's 14 µs base never pays: LL straight to Simple)."""
    shape = GroupShape(n, n)
    cuts = [_crossover(n, a, b) for a, b in itertools.pairwise(path)]
    assert all(c > 0 for c in cuts) and cuts == sorted(cuts)
    checks = [(1e2, path[0]), (1e10, path[-1])]
    for cut, (before, after) in zip(cuts, itertools.pairwise(path), strict=True):
        checks += [(cut * 0.95, before), (cut * 1.05, after)]
    for size, want in checks:
        plan = make_plan("all_reduce", size, shape, "auto", A100)
        assert (plan.algorithm, plan.protocol) == ("ring", want), size
        assert estimate(plan, A100) == pytest.approx(_ring_all_reduce_times(n, size)[want],
                                                     rel=1e-12)


def test_crossovers_in_nccls_absolute_units() -> None:
    """With the profile's α equal to NCCL's own hops (3.4 µs), the 8-GPU crossovers are
    NCCL's: LL → LL128 at (14 − 6.6 + 14·1.3) µs / (1.75 (4 − 1/0.92) / B)."""
    hw = A100.model_copy(update={"intra_node": A100.intra_node.model_copy(
        update={"latency_us": 3.4})})
    volume = 2 * 7 / 8
    size = (14.0 - 6.6 + 14 * (1.9 - 0.6)) * 1e-6 / (volume * (4 - 1 / 0.92) / B_INTRA)
    assert make_plan("all_reduce", size * 0.97, GroupShape(8, 8), "auto", hw).protocol == "LL"
    assert make_plan("all_reduce", size * 1.03, GroupShape(8, 8), "auto", hw).protocol == "LL128"


def test_multi_node_ring_latency_splits_nvlink_and_network_hops() -> None:
    """All-gather on N nodes of k: N − 1 network hops, the other n − N NVLink hops
    floored at the network post overhead (3 µs for Simple)."""
    k, nodes = 8, 4
    n = k * nodes
    plan = make_plan("all_gather", 1e10, GroupShape(n, k), "auto", A100)
    assert (plan.algorithm, plan.protocol) == ("ring", "Simple")
    intra_hop = max(3.4 * S_NV, 3.0 * S_NET) * 1e-6
    latency = 8.4 * S_NET * 1e-6 + (n - nodes) * intra_hop + (nodes - 1) * 14.0 * S_NET * 1e-6
    bandwidth = max((n - 1) / n * 1e10 / k / B_INTER, (n - 1) / n * 1e10 / B_INTRA)
    assert estimate(plan, A100) == pytest.approx(latency + bandwidth, rel=1e-12)


def test_multi_node_ll_nvlink_hops_cost_1_8_times() -> None:
    """LL across nodes: an NVLink hop is hwLat × 1.8 (0.6 → 1.08 µs), which here beats
    the network post overhead's floor (1 µs for LL, scaled by the NIC's α)."""
    k, nodes = 8, 2
    n = k * nodes
    plan = next(p for p in nccl_plans("all_reduce", 1e3, GroupShape(n, k), A100)
                if (p.algorithm, p.protocol) == ("ring", "LL"))
    intra_hop = max(0.6 * 1.8 * S_NV, 1.0 * S_NET)
    assert intra_hop == 0.6 * 1.8 * S_NV
    hops, inter_hops = 2 * (n - 1), 2 * (nodes - 1)
    latency = (6.6 * S_NET + (hops - inter_hops) * intra_hop + inter_hops * 2.7 * S_NET) * 1e-6
    bandwidth = max(2 * (n - 1) / n * 1e3 / (B_INTRA / 4),
                    2 * (n - 1) / n * 1e3 / k / (B_INTER / 4))
    assert estimate(plan, A100) == pytest.approx(latency + bandwidth, rel=1e-12)


def test_tree_bandwidth_and_latency_as_nccl_models_them() -> None:
    """Tree all-reduce (Simple): busBw × 0.92 × treeCorrectionFactor, latency
    2((k − 1)·hwLat[NVLink][Tree] + log2(N)·hwLat[NET][Tree])."""
    shape, size = GroupShape(64, 8), 2**27  # 128 MiB: log2(size / 64) = 21, factor .9
    plan = next(p for p in nccl_plans("all_reduce", size, shape, A100)
                if (p.algorithm, p.protocol) == ("tree", "Simple"))
    factor = 0.92 * 0.9
    latency = (0.0 + 2 * (7 * 28.0 * S_NV + 3 * 28.0 * S_NET)) * 1e-6
    inter = 2 * 7 / 8 * size / 8 / (B_INTER * factor)
    intra = 2 * 63 / 64 * size / (B_INTRA * factor)
    assert estimate(plan, A100) == pytest.approx(latency + max(inter, intra), rel=1e-12)
    assert nccl.tree_correction("Simple", 64) == 0.9
    assert nccl.tree_correction("LL", 64 * 2**12) == 0.4
    assert nccl.tree_correction("Simple", 1e12) == 1.0


def test_small_multi_node_all_reduce_is_a_tree() -> None:
    """Latency-bound all-reduce across many nodes: the tree's log2(N) network hops beat
    the ring's 2(N − 1), as NCCL picks."""
    plan = make_plan("all_reduce", 1e4, GroupShape(128, 8), "auto", A100)
    assert plan.algorithm == "tree"
    assert make_plan("all_reduce", 1e10, GroupShape(128, 8), "auto", A100).algorithm == "ring"


# ------------------------------------------------------------------ time and what moves it


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [GroupShape(8, 8), GroupShape(32, 8), GroupShape(16, 1)])
def test_auto_is_the_cheapest_of_nccls_plans(op: str, shape: GroupShape) -> None:
    for size in (1e3, 1e6, 1e9):
        plans = nccl_plans(op, size, shape, H100)  # type: ignore[arg-type]
        auto = make_plan(op, size, shape, "auto", H100)  # type: ignore[arg-type]
        assert nccl_time(auto, H100) == min(nccl_time(p, H100) for p in plans)
        assert estimate(auto, H100) == pytest.approx(nccl_time(auto, H100), rel=1e-12)


def test_faster_link_scales_nccls_latency_too() -> None:
    """NCCL's latency is in units of the link's α: a link 2× faster halves it."""
    for shape in (GroupShape(8, 8), GroupShape(4, 1)):
        plan = make_plan("all_reduce", 1e3, shape, "auto", A100)
        link = "intra_node" if shape.nodes == 1 else "inter_node"
        fast = A100.with_faster_link(link, 2.0)
        assert estimate(plan, fast) == pytest.approx(estimate(plan, A100) / 2, rel=1e-12)


def test_zero_latency_links_make_latency_free() -> None:
    free = A100.model_copy(update={
        "intra_node": A100.intra_node.model_copy(update={"latency_us": 0.0}),
        "inter_node": A100.inter_node.model_copy(update={"latency_us": 0.0})})
    plan = make_plan("all_reduce", 1e6, GroupShape(16, 8), "auto", free)
    assert plan.protocol == "Simple"  # nothing to save on latency: the fastest protocol
    assert estimate(plan, free) == pytest.approx(
        max(2 * 15 / 16 * 1e6 / B_INTRA, 2 * 15 / 16 * 1e6 / 8 / B_INTER), rel=1e-12)


def test_calibrated_collective_replaces_protocol_terms() -> None:
    """A measured α and busbw already hold the library's protocol: the time of an auto
    plan is the α-β form on them, whatever protocol NCCL's model picked."""
    cal = AlphaBeta(alpha_us=5.0, busbw_GBps=100.0)
    hw = A100.model_copy(update={"collectives": {"all_gather": {"intra_node": cal}}})
    for size in (1e3, 1e9):
        plan = make_plan("all_gather", size, GroupShape(8, 8), "auto", hw)
        assert plan == make_plan("all_gather", size, GroupShape(8, 8), "auto", A100)
        assert estimate(plan, hw) == pytest.approx(7 / 8 * size / 100e9 + 7 * 5e-6, rel=1e-12)
    assert make_plan("all_gather", 1e3, GroupShape(8, 8), "auto", hw).protocol == "LL"


def test_profile_may_leave_nvls_out() -> None:
    """``intra_node.nvls`` is optional (profiles written before it load as false) and
    strict (a string is refused with the field named)."""
    import yaml

    from simulator.errors import UserError
    from simulator.system.profiles import SYSTEMS_DIR, validate_profile

    data = yaml.safe_load((SYSTEMS_DIR / "dgx-h100.yaml").read_text())
    assert validate_profile(data, "h100").intra_node.nvls
    del data["intra_node"]["nvls"]
    assert not validate_profile(data, "h100").intra_node.nvls
    data["intra_node"]["nvls"] = "yes"
    with pytest.raises(UserError, match=r"intra_node\.nvls"):
        validate_profile(data, "h100")


# ------------------------------------------------------------------ the ring plateau


@pytest.mark.parametrize(("version", "capability", "size", "factor"), [
    # 2.18+: nBytes / (nChannels · nRanks) >= 64 (16 channels, 16 ranks: 16,384 bytes)
    ("2.18", 80, 16384, 1.4), ("2.18", 80, 16383, 1.0), ("2.20.3", 90, 1e9, 1.4),
    ("2.18", 70, 1e9, 1.9),
    # 2.17: × 1.5 from compute capability 9.0, nBytes >= nRanks / 16 · 65536 (65,536)
    ("2.17", 90, 65536, 1.5), ("2.17", 80, 65536, 1.9), ("2.17", 90, 65535, 1.0),
    # before: × 1.9
    ("2.12", 90, 65536, 1.9), ("2.8", 80, 1e9, 1.9),
])
def test_ring_plateau_closed_form(version: str, capability: int, size: float,
                                  factor: float) -> None:
    """``ncclTopoGetAlgoTime`` ("Plateau effect of ring"): a ring/Simple all-reduce across
    nodes has its latency × 1.9 (v2.16.2-1 and before), × (minCompCap < 90 ? 1.9 : 1.5)
    (v2.17.1-1), × (minCompCap < 80 ? 1.9 : 1.4) once nBytes/(nChannels·nRanks) >= 64
    (v2.18.1-1 on)."""
    shape = nccl.Shape(16, 2)
    assert nccl.ring_plateau("ring", "Simple", "all_reduce", shape, size, version, 16,
                             capability) == factor
    alphas = (A100.intra_node.alpha_s, A100.inter_node.alpha_s)
    with_gpu, without = (nccl_plan("all_reduce", size, GroupShape(16, 8), "ring", "Simple",
                                   alphas, version, gpu) for gpu in ((16, capability), (0, 0)))
    lat = [sum(u * {"intra_node": alphas[0], "inter_node": alphas[1]}[c]
               for c, u in p.phases[0].alpha_units or ()) for p in (with_gpu, without)]
    assert lat[0] == pytest.approx(factor * lat[1], rel=1e-12)
    assert with_gpu.phases[0].legs == without.phases[0].legs  # bandwidth untouched


@pytest.mark.parametrize(("algo", "proto", "op", "shape"), [
    ("ring", "LL128", "all_reduce", nccl.Shape(16, 2)),
    ("tree", "Simple", "all_reduce", nccl.Shape(16, 2)),
    ("ring", "Simple", "all_gather", nccl.Shape(16, 2)),
    ("ring", "Simple", "all_reduce", nccl.Shape(8, 1)),  # one node
])
def test_ring_plateau_only_multi_node_ring_simple_all_reduce(algo, proto, op, shape) -> None:  # type: ignore[no-untyped-def]
    assert nccl.ring_plateau(algo, proto, op, shape, 1e9, "2.18", 16, 90) == 1.0
    # a profile that states no compute capability or no channels: no plateau
    assert nccl.ring_plateau("ring", "Simple", "all_reduce", nccl.Shape(16, 2), 1e9,
                             "2.18", 16, 0) == 1.0
    assert nccl.ring_plateau("ring", "Simple", "all_reduce", nccl.Shape(16, 2), 1e9,
                             "2.18", 0, 90) == 1.0


def test_presets_give_the_tuner_channels_and_capability() -> None:
    assert nccl_gpu(A100) == (16, 80)
    assert nccl_gpu(H100) == (16, 90)


@settings(max_examples=80, deadline=None)
@given(nodes=st.integers(2, 128), per_node=st.sampled_from([1, 2, 8]),
       exponent=st.floats(2, 10.5), version=st.sampled_from(["2.12", "2.17", "2.18", "2.21"]),
       hw=st.sampled_from([A100, H100]))
def test_ring_plateau_never_makes_an_all_reduce_faster(nodes, per_node, exponent, version,
                                                        hw) -> None:  # type: ignore[no-untyped-def]
    """Every candidate's latency is the same or longer with the plateau, so NCCL's pick
    (the fastest candidate by its model) is never faster than without it, and a ring/
    Simple pick beyond the threshold is slower by exactly (factor − 1) × its latency."""
    shape, size = GroupShape(nodes * per_node, per_node), 10**exponent
    alphas = (hw.intra_node.alpha_s, hw.inter_node.alpha_s)
    best = {}
    for gpu in (nccl_gpu(hw), (0, 0)):
        times = [nccl_time(nccl_plan("all_reduce", size, shape, p.algorithm, p.protocol,
                                     alphas, version, gpu), hw)
                 for p in nccl_plans("all_reduce", size, shape, hw, version)]
        best[gpu] = min(times)
    assert best[nccl_gpu(hw)] >= best[(0, 0)] - 1e-15
    ring = [nccl_plan("all_reduce", size, shape, "ring", "Simple", alphas, version, gpu)
            for gpu in (nccl_gpu(hw), (0, 0))]
    factor = nccl.ring_plateau("ring", "Simple", "all_reduce", nccl.Shape(shape.n, nodes),
                               size, version, *nccl_gpu(hw))
    latency = sum(u * {"intra_node": alphas[0], "inter_node": alphas[1]}[c]
                  for c, u in ring[1].phases[0].alpha_units or ())
    assert nccl_time(ring[0], hw) - nccl_time(ring[1], hw) == pytest.approx(
        (factor - 1) * latency, rel=1e-9, abs=1e-15)
