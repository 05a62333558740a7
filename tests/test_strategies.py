"""Training strategies end to end: what each puts on the timeline, against theory.

Every figure is read back from the span table of ``simulate_scenario`` (one row
per task: ``op``, ``kind``, ``stream``, ``bytes`` = the collective's size S,
i.e. the whole array for an all-gather or reduce-scatter) and compared with
docs/model.md:

- ZeRO traffic per step per rank, nccl conventions: an all-reduce of S moves
  2(n − 1)/n · S per rank, an all-gather or a reduce-scatter (n − 1)/n · S. DDP
  (one all-reduce) and ZeRO-1/2 (reduce-scatter + all-gather) both move
  2Ψ(n − 1)/n elements; ZeRO-3 3Ψ(n − 1)/n for one micro-batch per step. With
  TP and PP, Ψ is the parameters of the rank's stage divided by t.
- interleaved 1F1B sends v times the pipeline traffic on the inner ranks and its
  bubble is (1/v)(p − 1)/m; ZB-H1 idles (p − 1)(T_F + T_B − T_W) per stage against
  1F1B's (p − 1)(T_F + T_B + T_W);
- recomputation re-runs exactly the forward it should (the whole layer, or the
  attention core), hardware FLOPs follow, model FLOPs do not move;
- sequence parallelism swaps each TP all-reduce for an all-gather plus a
  reduce-scatter of the same volume and divides activations as Korthikanti et
  al. Table 2;
- ZeRO-3 gathers before each layer's forward and (resharded) again before its
  backward, and the stage's root unit (embedding, head) once per micro-batch before
  its forward (FSDP2: 36 all-gathers a step for 4 layers and 4 micro-batches, as our
  measured run's profiler shows), and prefetching hides the layers' gathers;
  ZeRO-Offload moves gradients to the host
  during backward, steps on the CPU and brings parameters back.

Models are small GPTs (milliseconds per simulation); "free" communication makes
links infinitely fast with no latency where a closed form needs it. Known engine
bugs are ``xfail(strict=True)`` tests whose reason says what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from simulator.analysis.memory import memory_report
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.model import transformer as mdl
from simulator.model.inventory.ops import CORE_OPS
from simulator.model.memory import in_flight_microbatches, stage_params
from simulator.spec.load import load_scenario, scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.system.costs import CostModel

# The closed forms below are for 16-bit gradient reductions overlapped with the backward,
# asynchronous pipeline sends, one ZeRO-3 collective per layer and Megatron's unfused
# attention with dropout (Korthikanti's Table 2): DeepSpeed's stack with those two choices,
# and no host cost per kernel (these millisecond models would be launch-bound; the
# host-bound regime has its own tests in test_stack.py).
STACK = {"preset": "deepspeed", "pipeline_send": "async", "zero3_unit": "layer",
         "host_overhead_us": 0.0}
FREE = {"intra_node_bandwidth_GBps": 1e12, "inter_node_bandwidth_GBps": 1e12,
        "link_latency_us": 0}
# A GPT block (gelu MLP 4h, biases, LayerNorm, kv = heads): Korthikanti's and
# Narayanan's closed forms hold exactly. Untied, so the output projection is a
# parameter of the last stage only and Ψ per stage is memory.stage_params exactly.
GPT = {"layers": 8, "hidden": 128, "heads": 8, "vocab": 512, "seq_len": 64,
       "tied_embeddings": False}
REL = 1e-9
SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
BUNDLED = ["gpt3-175b-384-zero3", "gpt3-175b-384-3d", "llama2-70b-fsdp",
           "interleaved-vs-1f1b-1f1b", "interleaved-vs-1f1b-interleaved",
           "zb-h1-vs-1f1b-1f1b", "zb-h1-vs-1f1b-zbh1", "llama2-7b-1gpu-offload"]


def make(*, tp: int = 1, pp: int = 1, dp: int = 1, m: int = 1, b: int = 1,
         model: dict[str, Any] | None = None, free: bool = False,
         gpus_per_node: int | None = None, cluster: dict[str, Any] | None = None,
         stack: dict[str, Any] | None = None, **parallel: Any) -> Scenario:
    world = tp * pp * dp
    gpn = gpus_per_node or min(world, 8)
    return scenario_from_dict({
        "name": "strategies",
        "model": model or GPT,
        "cluster": {"system": "dgx-a100-80gb", "nodes": world // gpn, "gpus_per_node": gpn,
                    **(FREE if free else {}), **(cluster or {})},
        "parallel": {"tp": tp, "pp": pp, "dp": dp, **parallel},
        "training": {"global_batch": m * b * dp, "micro_batch": b},
        "stack": stack or STACK,
    })


def run(s: Scenario) -> tuple[dict[str, Any], pd.DataFrame]:
    results, spans = simulate_scenario(s)
    assert spans is not None
    spans = spans.assign(dur=spans["end"] - spans["start"])
    return results, spans


def per_rank_elements(spans: pd.DataFrame, n: int, dtype_bytes: int = 2) -> float:
    """Elements one rank sends (= receives) for the collectives in ``spans``, nccl
    conventions: all-reduce 2(n − 1)/n · S, all-gather / reduce-scatter (n − 1)/n · S."""
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
              "reduce_scatter": (n - 1) / n}
    total = 0.0
    for op, size in zip(spans["op"], spans["bytes"], strict=True):
        total += factor[op.split(".", 1)[1]] * size / dtype_bytes
    return total


def stage_of(spans: pd.DataFrame, stage: int) -> pd.DataFrame:
    return spans[spans["stage"] == stage]


def layer_psi(s: Scenario) -> float:
    """Parameters of the transformer layers of one stage on one TP rank."""
    return s.model.layers // s.parallel.pp * mdl.layer_params(s.model) / s.parallel.tp


def stage_psi(s: Scenario, stage: int) -> float:
    return stage_params(s.model, s.parallel.pp, stage) / s.parallel.tp


# ================================================================== ZeRO traffic


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 2)])
def test_dp_traffic_ddp_and_zero12_is_2psi(zero: int, tp: int, pp: int, dp: int,
                                           m: int) -> None:
    """DDP all-reduces 2Ψ(n−1)/n per rank; ZeRO-1/2 reduce-scatter the gradients and
    all-gather the updated parameters, (n−1)/n · Ψ each: the same total. Ψ is the
    stage's parameters over t. DDP and ZeRO-1 accumulate over the m micro-batches
    and synchronise once; ZeRO-2 keeps only a shard, so it reduce-scatters after
    every micro-batch: (m + 1)Ψ(n−1)/n, 2Ψ(n−1)/n with m = 1."""
    s = make(tp=tp, pp=pp, dp=dp, m=m, zero=zero)
    _, spans = run(s)
    dp_spans = spans[spans["kind"] == "dp"]
    assert set(dp_spans["op"]) == ({"dp.all_reduce"} if zero == 0
                                   else {"dp.reduce_scatter", "dp.all_gather"})
    assert not (spans["kind"] == "zero").any()
    reductions = m if zero == 2 else 1
    for stage in range(pp):
        mine = stage_of(dp_spans, stage)
        psi = stage_psi(s, stage) * (dp - 1) / dp
        expected = (reductions + 1) * psi if zero else 2 * psi
        assert per_rank_elements(mine, dp) == pytest.approx(expected, rel=REL)
        if zero:  # each reduction and the gather move Ψ(n−1)/n
            rs = mine[mine["op"] == "dp.reduce_scatter"]
            assert per_rank_elements(rs, dp) == pytest.approx(reductions * psi, rel=REL)


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 4), (2, 2, 2), (1, 2, 4)])
@pytest.mark.parametrize("m", [1, 3])
def test_zero3_traffic_layers_3psi(tp: int, pp: int, dp: int, m: int) -> None:
    """ZeRO-3 / FSDP, per rank: every layer all-gathered before its forward and again
    before its backward (2Ψ_L(n−1)/n per micro-batch: FSDP re-gathers for every
    micro-batch), every gradient reduce-scattered after every micro-batch
    (mΨ(n−1)/n: only a shard is kept). With m = 1 the
    layers' share is the paper's 3Ψ_L(n−1)/n. The embedding and head (the stage's
    root unit, Ψ_R = Ψ − Ψ_L) are gathered once per micro-batch before the forward
    and kept for the backward (FSDP2 does not reshard its root after forward), so the
    root's share is 2mΨ_R(n−1)/n, and nothing is gathered after the step."""
    s = make(tp=tp, pp=pp, dp=dp, m=m, zero=3)
    _, spans = run(s)
    spans = spans[spans["name"] != "dp.grad_norm"]  # clipping's norm: a scalar, not Ψ
    assert not (spans["op"] == "dp.all_reduce").any()
    assert not (spans["op"] == "dp.all_gather").any()
    for stage in range(pp):
        mine = stage_of(spans, stage)
        ag = mine[(mine["op"] == "zero.all_gather") & (mine["layer"] >= 0)]
        root = mine[(mine["op"] == "zero.all_gather") & (mine["layer"] < 0)]
        rs = mine[mine["op"] == "dp.reduce_scatter"]
        assert set(ag["stream"]) == set(root["stream"]) == {"zero"}
        layers = s.model.layers // pp
        has_root = stage in (0, pp - 1)
        assert len(ag) == 2 * layers * m
        assert len(root) == m * has_root
        assert per_rank_elements(ag, dp) == pytest.approx(2 * m * layer_psi(s) * (dp - 1) / dp,
                                                          rel=REL)
        root_psi = stage_psi(s, stage) - layer_psi(s)
        assert per_rank_elements(root, dp) == pytest.approx(m * root_psi * (dp - 1) / dp,
                                                            rel=REL)
        assert per_rank_elements(rs, dp) == pytest.approx(
            m * stage_psi(s, stage) * (dp - 1) / dp, rel=REL)
        # one reduce-scatter per unit and micro-batch (a layer, and the root)
        assert len(rs) == m * (layers + has_root)
        if m == 1:
            layers_share = per_rank_elements(ag, dp) + layer_psi(s) * (dp - 1) / dp
            assert layers_share == pytest.approx(3 * layer_psi(s) * (dp - 1) / dp, rel=REL)


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 4), (2, 2, 2)])
def test_zero3_traffic_total_with_the_root_unit(tp: int, pp: int, dp: int) -> None:
    """Expected per rank with m = 1: the layers' 3Ψ_L(n−1)/n plus, for the root unit
    Ψ_R (embedding, head), one gather and one reduce-scatter, 2Ψ_R(n−1)/n: FSDP2's
    root is not resharded after forward, so its backward needs no second gather."""
    s = make(tp=tp, pp=pp, dp=dp, m=1, zero=3)
    _, spans = run(s)
    for stage in range(pp):
        mine = stage_of(spans, stage)
        traffic = mine[mine["kind"].isin(["dp", "zero"]) & (mine["name"] != "dp.grad_norm")]
        got = per_rank_elements(traffic, dp)  # clipping's norm (a scalar) left out
        psi_l, psi = layer_psi(s), stage_psi(s, stage)
        assert got == pytest.approx((3 * psi_l + 2 * (psi - psi_l)) * (dp - 1) / dp, rel=REL)


def test_dp_traffic_tied_embedding_copy_on_last_stage() -> None:
    s = make(tp=2, pp=2, dp=2, m=2, zero=0, model={**GPT, "tied_embeddings": True})
    _, spans = run(s)
    last = stage_of(spans[spans["kind"] == "dp"], 1)
    assert per_rank_elements(last, 2) == pytest.approx(2 * stage_psi(s, 1) * 1 / 2, rel=REL)


# ================================================================== ZeRO-3 gathers


def _gather_order(spans: pd.DataFrame) -> dict[tuple[int, int], list[pd.Series]]:
    """Gathers per (layer, micro-batch), in the order they ran."""
    ag = spans[spans["op"] == "zero.all_gather"].sort_values("start")
    out: dict[tuple[int, int], list[pd.Series]] = {}
    for _, row in ag.iterrows():
        out.setdefault((row["layer"], row["microbatch"]), []).append(row)
    return out


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize(("tp", "pp", "dp", "schedule"), [(1, 1, 2, "1f1b"), (2, 2, 2, "1f1b"),
                                                         (1, 2, 2, "zb-h1")])
def test_zero3_gathers_before_forward_and_backward(reshard: bool, tp: int, pp: int, dp: int,
                                                    schedule: str) -> None:
    """Each layer's forward of each micro-batch starts after a gather of that layer;
    with reshard_after_forward its backward (B, or I for ZB-H1) waits for a second
    gather, without it there is no second gather."""
    m = 2
    s = make(tp=tp, pp=pp, dp=dp, m=m, zero=3, schedule=schedule,
             reshard_after_forward=reshard)
    _, spans = run(s)
    for stage in range(pp):
        mine = stage_of(spans, stage)
        gathers = _gather_order(mine[mine["layer"] >= 0])
        _root_gathered_before_forward(mine, m, stage in (0, pp - 1))
        layers = range(stage * s.model.layers // pp, (stage + 1) * s.model.layers // pp)
        assert set(gathers) == {(lay, mb) for lay in layers for mb in range(m)}
        first_bwd = "I" if schedule == "zb-h1" else "B"
        for (lay, mb), rows in gathers.items():
            assert len(rows) == (2 if reshard else 1)
            blocks = mine[(mine["layer"] == lay) & (mine["microbatch"] == mb)
                          & (mine["stream"] == "compute")]
            fwd = blocks[blocks["op"] == "F"]["start"].min()
            bwd = blocks[blocks["op"] == first_bwd]["start"].min()
            assert rows[0]["end"] <= fwd + 1e-15
            if reshard:  # the second gather follows the first, and precedes the backward
                assert rows[0]["end"] <= rows[1]["start"] + 1e-15
                assert rows[1]["end"] <= bwd + 1e-15


def _root_gathered_before_forward(mine: pd.DataFrame, m: int, has_root: bool) -> None:
    """One root gather per micro-batch on a stage with a root unit, ending before the
    micro-batch's first forward compute and starting after the compute before it."""
    root = mine[(mine["op"] == "zero.all_gather") & (mine["layer"] < 0)]
    assert sorted(root["microbatch"]) == (list(range(m)) if has_root else [])
    comp = mine[mine["stream"] == "compute"]
    for _, row in root.iterrows():
        fwd = comp[(comp["op"] == "F") & (comp["microbatch"] == row["microbatch"])]
        assert row["end"] <= fwd["start"].min() + 1e-15
        before = comp[comp["end"] <= fwd["start"].min() + 1e-15]
        if len(before):  # FSDP2's root pre-forward: the gather waits for the current stream
            assert row["start"] >= before["end"].max() - 1e-15


# a model whose per-layer gather (inter-node, slow) is comparable to its compute
ZERO3_MODEL = {"layers": 8, "hidden": 1024, "heads": 8, "vocab": 1024, "seq_len": 512,
               "tied_embeddings": False}
SLOW_NET = {"inter_node_bandwidth_GBps": 100.0}  # gathers ≈ compute


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 4), (2, 2, 2)])
def test_zero3_prefetch_hides_gathers(tp: int, pp: int, dp: int) -> None:
    """On the zero stream, prefetched gathers run while compute runs: exposed
    ZeRO-3 communication with prefetch ≤ without (overlap.zero3_prefetch false puts
    them on the compute stream, wholly exposed), and deeper prefetch never exposes
    more."""
    common: dict[str, Any] = {"tp": tp, "pp": pp, "dp": dp, "m": 2, "b": 2, "zero": 3,
                              "model": ZERO3_MODEL, "gpus_per_node": tp, "cluster": SLOW_NET}
    off, off_spans = run(make(**common, overlap={"zero3_prefetch": False}))
    assert set(off_spans[off_spans["op"] == "zero.all_gather"]["stream"]) == {"compute"}
    exposed_off = off["exposed_comm_s"]["zero"]
    gathers_off = off_spans[off_spans["op"] == "zero.all_gather"]
    # nothing overlaps: every gather is exposed (per-stage mean over stages)
    assert exposed_off == pytest.approx(gathers_off["dur"].sum() / pp, rel=1e-9)
    exposed = []
    for depth in (0, 1, 2):
        res, spans = run(make(**common, fsdp_prefetch=depth))
        exposed.append(res["exposed_comm_s"]["zero"])
        assert res["step_time_s"] <= off["step_time_s"] * (1 + 1e-9)
        if depth:
            # some gather time coincides with compute on the same rank
            comp = spans[(spans["stream"] == "compute") & (spans["op"].isin(["F", "B", "R"]))]
            ag = spans[spans["op"] == "zero.all_gather"]
            overlap = 0.0
            for rank, g in ag.groupby("rank"):
                c = comp[comp["rank"] == rank]
                for a0, a1 in zip(g["start"], g["end"], strict=True):
                    overlap += (c["end"].clip(upper=a1) - c["start"].clip(lower=a0)).clip(
                        lower=0).sum()
            assert overlap > 0.25 * ag["dur"].sum()
    assert exposed[0] <= exposed_off * (1 + 1e-9)
    assert exposed[2] <= exposed[1] * (1 + 1e-9) <= exposed[0] * (1 + 1e-9)
    assert exposed[1] < 0.5 * exposed_off


def test_zero3_prefetch_depth_bounds_gather_start() -> None:
    """Depth k: the gather of unit i (in execution order) never starts before unit
    i − k − 1 finished (a bounded number of gathered units in memory)."""
    for depth in (0, 1, 2):
        _, spans = run(make(dp=2, m=1, zero=3, model=ZERO3_MODEL, gpus_per_node=1,
                            cluster=SLOW_NET, fsdp_prefetch=depth))
        ag = spans[(spans["op"] == "zero.all_gather") & (spans["layer"] >= 0)] \
            .sort_values("start")
        comp = spans[(spans["stream"] == "compute") & (spans["layer"] >= 0)]
        # unit ends: per (pass, layer) the last compute block of that layer
        comp = comp.assign(pass_=comp["op"].map({"F": "F", "B": "B", "R": "B"}))
        ends = comp.groupby(["pass_", "layer"], sort=False)["end"].max().sort_values()
        unit_end = list(ends)
        for i, start in enumerate(ag["start"]):
            if i - depth - 1 >= 0:
                assert start >= unit_end[i - depth - 1] - 1e-15


# ================================================================== ZeRO-Offload


@pytest.mark.parametrize(("tp", "pp", "dp", "zero"), [(1, 1, 1, 2), (1, 1, 2, 2), (2, 2, 2, 1)])
def test_zero_offload_host_stream(tp: int, pp: int, dp: int, zero: int) -> None:
    """Gradient shards go to the host bucket by bucket while backward still runs; the
    CPU Adam step follows the last copy, the 16-bit shard returns over PCIe, and no
    optimizer step runs on the GPU; GPU optimizer-state memory is 0."""
    s = make(tp=tp, pp=pp, dp=dp, m=2, zero=zero, zero_offload=True, dp_bucket_MB=0.2,
             model={**GPT, "layers": 16, "hidden": 256})
    res, spans = run(s)
    hw = s.hardware
    for stage in range(pp):
        mine = stage_of(spans, stage)
        host = mine[mine["stream"] == "host"].sort_values("start")
        ops = list(host["op"])
        assert ops[-2:] == ["optimizer", "offload.h2d"]
        assert set(ops[:-2]) == {"offload.d2h"} and len(ops) > 3
        d2h = host[host["op"] == "offload.d2h"]
        adam = host[host["op"] == "optimizer"].iloc[0]
        h2d = host[host["op"] == "offload.h2d"].iloc[0]
        # the rank's shard of the stage's gradients, out and back (16-bit)
        shard_bytes = 2 * stage_psi(s, stage) / dp
        copies = s.microbatches if zero >= 2 else 1  # ZeRO-2/3 ship every micro-batch's
        assert d2h["bytes"].sum() == pytest.approx(copies * shard_bytes, rel=REL)
        assert h2d["bytes"] == pytest.approx(shard_bytes, rel=REL)
        pcie = hw.host.pcie_bandwidth_GBps * 1e9
        assert h2d["dur"] == pytest.approx(shard_bytes / pcie, rel=REL)
        assert adam["dur"] == pytest.approx(stage_psi(s, stage) / dp * s.hardware.gpus_per_node
                                            / hw.host.cpu_adam_params_per_s, rel=REL)
        # order: adam after every copy, h2d after adam
        assert adam["start"] >= d2h["end"].max() - 1e-15 and h2d["start"] >= adam["end"] - 1e-15
        # overlap: the first copy starts before the last backward block ends
        bwd = mine[(mine["stream"] == "compute") & (mine["op"] == "B")]
        assert d2h["start"].min() < bwd["end"].max()
        # no optimizer work on the GPU: at most a zero-length wait
        gpu_opt = mine[(mine["stream"] == "compute") & (mine["kind"] == "optimizer")]
        assert (gpu_opt["dur"] == 0).all()
        # the step ends after the parameters are back
        assert res["step_time_s"] >= h2d["end"] - 1e-15
    for mem in res["memory"]:
        assert mem["optimizer"] == 0.0
        if zero >= 2:  # each micro-batch's gradient shard goes to the host
            assert mem["gradients"] == 0.0


def test_zero3_offload_adds_no_full_parameter_gather() -> None:
    s = make(dp=2, m=1, zero=3, zero_offload=True)
    _, spans = run(s)
    gathered = spans[spans["op"] == "dp.all_gather"]["bytes"].sum()
    # at most the replicated embedding/head (see the ZeRO-3 traffic bug above), never
    # the layers, which the next step's forward gathers unit by unit
    assert gathered <= 2 * (stage_psi(s, 0) - layer_psi(s)) * (1 + REL)


def test_zero_offload_gradient_accumulation_consistent() -> None:
    m = 4
    s = make(dp=1, m=m, zero=2, zero_offload=True)
    res, spans = run(s)
    d2h = spans[spans["op"] == "offload.d2h"]["bytes"].sum()
    grads_on_gpu = res["memory"][0]["gradients"]
    assert d2h == pytest.approx(m * 2 * stage_psi(s, 0), rel=REL) or grads_on_gpu > 0


# ================================================================== interleaved 1F1B


@pytest.mark.parametrize(("p", "v", "tp", "dp"), [(2, 2, 1, 1), (4, 2, 2, 1), (4, 3, 2, 2),
                                                  (3, 4, 1, 2)])
def test_interleaved_pipeline_traffic_is_v_times(p: int, v: int, tp: int, dp: int) -> None:
    """Each virtual stage sends its activations forward and its gradient back: rank r
    sends m(v − [r = p−1]) activations and m(v − [r = 0]) gradients against 1F1B's
    m[r < p−1] and m[r > 0], each b·s·h. Inner ranks send exactly v×; all ranks
    together 2m(pv − 1) against 2m(p − 1)."""
    m = 2 * p
    model = {**GPT, "layers": p * v * 2}
    one = make(tp=tp, pp=p, dp=dp, m=m, model=model, schedule="1f1b")
    inter = make(tp=tp, pp=p, dp=dp, m=m, model=model, schedule="interleaved", virtual_stages=v)
    _, s1 = run(one)
    _, si = run(inter)
    size = mdl.pp_activation_bytes(one.model, 1)
    for spans in (s1, si):
        sends = spans[spans["op"] == "pp.send"]
        assert (sends["bytes"] == size).all() and set(sends["stream"]) == {"pp"}
    n1 = s1[s1["op"] == "pp.send"].groupby("stage").size().reindex(range(p), fill_value=0)
    ni = si[si["op"] == "pp.send"].groupby("stage").size().reindex(range(p), fill_value=0)
    for r in range(p):
        assert n1[r] == m * ((r < p - 1) + (r > 0))
        assert ni[r] == m * ((v - (r == p - 1)) + (v - (r == 0)))
        if 0 < r < p - 1:
            assert ni[r] == v * n1[r]
    assert ni.sum() == 2 * m * (p * v - 1) and n1.sum() == 2 * m * (p - 1)


# nearly balanced stages: many layers per stage, a small vocabulary (the head and the
# embedding, the only imbalance, are a few % of a stage)
BALANCED = {"layers": 16, "hidden": 512, "heads": 8, "vocab": 256, "seq_len": 256,
            "tied_embeddings": False}


def _stage_times(spans: pd.DataFrame, s: Scenario) -> pd.DataFrame:
    """Per stage, compute seconds per micro-batch by op (F, B, I, W, R)."""
    comp = spans[(spans["stream"] == "compute") & spans["kind"].isin(
        ["forward", "backward", "weight_grad", "recompute"])]
    return comp.groupby(["stage", "op"])["dur"].sum().unstack(fill_value=0) / s.microbatches


def _imbalance(per_mb: pd.Series) -> float:
    """Largest relative deviation of a stage's per-micro-batch time from the median."""
    mid = per_mb.median()
    return float((per_mb - mid).abs().max() / mid)


def _check_pipeline(res: dict[str, Any], per_mb: pd.Series, m: int, slots: float,
                    slot: float) -> None:
    """The bubble of a pipeline whose stages differ only by the embedding and the head.

    Stage s works m·t_s per step. The slowest rank never idles once the pipeline is
    full, so the phase is m·max t_s plus the fill/drain: ``slots`` idle slots of the
    schedule, each ``slot`` long on an inner stage (1F1B: p − 1 slots of T_F + T_B;
    interleaved: (p − 1)/v of them; ZB-H1: p − 1 of T_F + T_B − T_W). Equal stages
    give the closed forms exactly. The imbalance ε (< 5% here: the embedding and the
    head, their small GEMMs each at least a kernel's few microseconds, are a few % of a
    stage) bounds both the fill/drain slots' spread (phase
    within ε·phase of that form) and the gap to the plain closed form: idle time off
    by at most m·p·(max t − min t) + p·ε·phase over all stages.
    """
    p = len(per_mb)
    eps = _imbalance(per_mb)
    assert eps < 0.05
    p0, p1 = res["pipeline_phase_s"]
    phase = p1 - p0
    assert phase == pytest.approx(m * per_mb.max() + slots * slot, rel=eps)
    idle = res["bubble_fraction"] * p * phase
    tol = m * p * (per_mb.max() - per_mb.min()) + p * eps * phase
    assert idle == pytest.approx(p * slots * slot, abs=tol)
    # the bubble is the schedule's: imbalance is reported apart, never inflates it
    assert idle <= p * slots * slot * (1 + eps)


@pytest.mark.parametrize(("p", "v", "k", "tp", "dp"), [(2, 2, 1, 1, 1), (2, 4, 2, 1, 1),
                                                       (4, 2, 1, 2, 1), (4, 4, 2, 1, 2),
                                                       (4, 2, 3, 1, 1), (3, 2, 2, 1, 1)])
def test_interleaved_bubble_end_to_end(p: int, v: int, k: int, tp: int, dp: int) -> None:
    """Real block costs, free communication: each rank idles (p − 1)/v slots of
    T_F + T_B (bubble (p−1)/v out of m + (p−1)/v), against 1F1B's p − 1 on the same
    model; see _check_pipeline for the tolerance."""
    m = k * p
    model = {**BALANCED, "layers": p * 8}
    results = {}
    for schedule, vv in (("interleaved", v), ("1f1b", 1)):
        # no embedding dropout: the first chunk stays as light as _check_pipeline assumes
        s = make(tp=tp, pp=p, dp=dp, m=m, model=model, free=True, schedule=schedule,
                 virtual_stages=vv, stack={**STACK, "hidden_dropout": 0.0})
        res, spans = run(s)
        times = _stage_times(spans, s)
        slot = times.median()[["F", "B"]].sum()
        _check_pipeline(res, times.sum(axis=1), m, (p - 1) / vv, slot)
        results[schedule] = res
    q = (p - 1) / v
    inter, one = results["interleaved"], results["1f1b"]
    eps = 0.03
    assert inter["bubble_fraction"] == pytest.approx(q / (m + q), abs=2 * eps * (1 - q / (m + q)))
    assert inter["bubble_fraction"] < one["bubble_fraction"]
    assert inter["step_time_s"] < one["step_time_s"]


# ================================================================== ZB-H1


@pytest.mark.parametrize(("p", "m", "tp", "dp"), [(2, 4, 1, 1), (4, 8, 1, 1), (4, 6, 2, 2),
                                                  (3, 5, 2, 1), (5, 7, 1, 1)])
def test_zb_h1_bubble_end_to_end(p: int, m: int, tp: int, dp: int) -> None:
    """Real block costs (T_F, T_B = input gradient, T_W = weight gradient, read from
    the spans), free communication: per stage 1F1B idles (p−1)(T_F+T_B+T_W), ZB-H1
    (p−1)(T_F+T_B−T_W), its W filling the drain; see _check_pipeline for the
    tolerance. Same activation memory as 1F1B."""
    model = {**BALANCED, "layers": 4 * p}
    zb = make(tp=tp, pp=p, dp=dp, m=m, model=model, free=True, schedule="zb-h1")
    one = make(tp=tp, pp=p, dp=dp, m=m, model=model, free=True, schedule="1f1b")
    rz, sz = run(zb)
    r1, s1 = run(one)
    tz, t1 = _stage_times(sz, zb), _stage_times(s1, one)
    assert "B" not in tz and tz["W"].gt(0).all() and "I" not in t1
    inner = tz.median()
    t_f, t_b, t_w = inner["F"], inner["I"], inner["W"]
    # B = I + W on every stage (the head's and the embedding's parts included)
    assert list(t1["B"]) == pytest.approx(list(tz["I"] + tz["W"]), rel=1e-9)
    _check_pipeline(r1, t1.sum(axis=1), m, p - 1, t_f + t_b + t_w)
    _check_pipeline(rz, tz.sum(axis=1), m, p - 1, t_f + t_b - t_w)
    assert rz["step_time_s"] < r1["step_time_s"]
    assert [x["activations"] for x in rz["memory"]] == [x["activations"] for x in r1["memory"]]


# ================================================================== recomputation


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize(("tp", "pp", "sp", "schedule"), [(1, 1, False, "1f1b"),
                                                          (2, 2, True, "1f1b"),
                                                          (2, 2, False, "zb-h1"),
                                                          (2, 2, True, "interleaved")])
def test_recompute_adds_the_forward(recompute: str, tp: int, pp: int, sp: bool,
                                    schedule: str) -> None:
    """Per stage, the R spans sum to the layers' forward compute (full) or to the
    attention core's forward (selective); F, B, I, W are unchanged."""
    m = 4
    v = 2 if schedule == "interleaved" else 1
    common: dict[str, Any] = {"tp": tp, "pp": pp, "m": m, "free": True, "schedule": schedule,
                              "virtual_stages": v, "sequence_parallel": sp}
    base = make(**common)
    rec = make(**common, recompute=recompute)
    _, sb = run(base)
    _, sr = run(rec)
    assert not (sb["op"] == "R").any()
    cost = CostModel(rec.hardware, rec.training.dtype, host_us=rec.stack.host_us,
                     ranks=rec.parallel.world)  # every rank at the slowest's pace
    attn = cost.ops_time(op for op in mdl.layer_ops(rec.model, 1, tp, sp, "bf16", "fwd",
                                                    stack=rec.stack)
                         if op.name in CORE_OPS)  # the unfused core: QKᵀ ... AV
    for stage in range(pp):
        b, r = stage_of(sb, stage), stage_of(sr, stage)
        for op in ("F", "B", "I", "W"):
            assert r[r["op"] == op]["dur"].sum() == pytest.approx(b[b["op"] == op]["dur"].sum(),
                                                                  rel=REL)
        recomputed = r[r["op"] == "R"]["dur"].sum()
        if recompute == "full":
            layer_fwd = r[(r["op"] == "F") & (r["layer"] >= 0)]["dur"].sum()
            assert recomputed == pytest.approx(layer_fwd, rel=REL)
        else:
            assert recomputed == pytest.approx(m * rec.model.layers // pp * attn, rel=REL)
        # per layer per micro-batch: the attention and MLP blocks (full) or the core
        blocks = 2 if recompute == "full" else 1
        assert (r["op"] == "R").sum() == m * rec.model.layers // pp * blocks


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_recompute_flops_hfu_and_tp_collectives(recompute: str) -> None:
    """Model FLOPs never change; hardware FLOPs add the recomputed forward; HFU/MFU =
    hardware/model FLOPs (Narayanan's 96·B·s·l·h²(1 + s/6h + V/16lh) for full, exactly,
    on this GPT block). Full recomputation re-runs the forward TP collectives too:
    6 per layer per micro-batch instead of 4 (×2 with sequence parallelism)."""
    tp, pp, m = 2, 2, 4
    s = make(tp=tp, pp=pp, m=m, free=True, recompute=recompute, sequence_parallel=True)
    res, spans = run(s)
    world, step = s.parallel.world, res["step_time_s"]
    B = s.training.global_batch
    model_flops = res["model_tflops_per_gpu"] * 1e12 * step * world
    hw_flops = res["hardware_tflops_per_gpu"] * 1e12 * step * world
    assert model_flops == pytest.approx(mdl.megatron_model_flops(s.model, B), rel=1e-9)
    extra = mdl.ops_flops(mdl.layer_recompute_ops(s.model, B, recompute=s.parallel.recompute))
    assert hw_flops == pytest.approx(model_flops + s.model.layers * extra, rel=1e-9)
    assert res["hfu"] / res["mfu"] == pytest.approx(hw_flops / model_flops, rel=1e-9)
    if recompute == "none":
        assert res["hfu"] == pytest.approx(res["mfu"], rel=1e-12)
    else:
        assert res["hfu"] > res["mfu"]
    if recompute == "full":
        assert hw_flops == pytest.approx(mdl.megatron_hardware_flops(s.model, B, "full"),
                                         rel=1e-9)
    per_layer_mb = {"none": 4, "selective": 4, "full": 6}[recompute]
    for stage in range(pp):
        tp_spans = stage_of(spans, stage)
        tp_spans = tp_spans[(tp_spans["kind"] == "tp") & (tp_spans["layer"] >= 0)]
        for op in ("tp.all_gather", "tp.reduce_scatter"):
            assert (tp_spans["op"] == op).sum() == per_layer_mb * m * s.model.layers // pp


# ================================================================== sequence parallelism


@pytest.mark.parametrize(("tp", "pp", "dp", "schedule"), [(2, 1, 1, "1f1b"), (4, 2, 1, "1f1b"),
                                                          (2, 2, 2, "zb-h1")])
def test_sequence_parallel_swaps_all_reduce_for_ag_rs(tp: int, pp: int, dp: int,
                                                     schedule: str) -> None:
    """Per layer per micro-batch 4 all-reduces of b·s·h become 4 all-gathers + 4
    reduce-scatters of the same b·s·h: the same volume per rank, 2(t−1)/t · S ×4, and
    Narayanan's l_stage · 8bsh(t−1)/t elements per micro-batch."""
    m, b = 3, 2
    common: dict[str, Any] = {"tp": tp, "pp": pp, "dp": dp, "m": m, "b": b, "free": True,
                              "schedule": schedule}
    _, plain = run(make(**common))
    _, seq = run(make(**common, sequence_parallel=True))
    spec = make(**common).model
    size = mdl.tp_comm_bytes_per_layer(spec, b)
    for stage in range(pp):
        n_layers = spec.layers // pp
        # per-layer collectives (the vocab-parallel ends are tested elsewhere)
        a = stage_of(plain, stage)
        a = a[(a["kind"] == "tp") & (a["layer"] >= 0)]
        c = stage_of(seq, stage)
        c = c[(c["kind"] == "tp") & (c["layer"] >= 0)]
        assert set(a["op"]) == {"tp.all_reduce"}
        assert set(c["op"]) == {"tp.all_gather", "tp.reduce_scatter"}
        assert len(a) == 4 * n_layers * m
        assert (c["op"] == "tp.all_gather").sum() == (c["op"] == "tp.reduce_scatter").sum() \
            == 4 * n_layers * m
        assert (a["bytes"] == size).all() and (c["bytes"] == size).all()
        va, vc = per_rank_elements(a, tp), per_rank_elements(c, tp)
        assert va == pytest.approx(vc, rel=REL)
        bsh = b * spec.seq_len * spec.hidden
        assert va == pytest.approx(m * n_layers * 8 * bsh * (tp - 1) / tp, rel=REL)


def _korthikanti(s: Scenario) -> float:
    """Table 2 bytes per layer (16-bit), GPT block."""
    sp, t, rec = s.parallel.sequence_parallel, s.parallel.tp, s.parallel.recompute
    seq, b, h, a = s.model.seq_len, s.training.micro_batch, s.model.hidden, s.model.heads
    sbh = seq * b * h
    if rec == "full":
        return 2 * sbh / (t if sp else 1)
    scores = 0.0 if rec == "selective" else 5 * a * seq / (h * t)
    return sbh * ((34 / t if sp else 10 + 24 / t) + scores)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 2), (4, 1), (4, 2)])
def test_sequence_parallel_activation_memory(recompute: str, tp: int, pp: int) -> None:
    """results["memory"] activations per stage = in-flight micro-batches × (layers ×
    Table 2 + the embedding's dropout mask sbh on stage 0 + the final-norm and logits
    inputs 4sbh on the last), everything outside the attention-score term divided by t
    with sequence parallelism."""
    m = 4
    for sp in (False, True):
        s = make(tp=tp, pp=pp, m=m, b=2, recompute=recompute, sequence_parallel=sp)
        res, _ = run(s)
        sbh = s.model.seq_len * 2 * s.model.hidden / (tp if sp else 1)
        for mem in res["memory"]:
            st = mem["stage"]
            per_mb = s.model.layers // pp * _korthikanti(s)
            per_mb += sbh * (st == 0) + 4 * sbh * (st == pp - 1)
            inflight = in_flight_microbatches("1f1b", pp, m, 1, st)
            assert mem["activations"] == pytest.approx(inflight * per_mb, rel=REL)


def test_sequence_parallel_pipeline_sends_are_sharded() -> None:
    s = make(tp=2, pp=2, m=2, sequence_parallel=True)
    _, spans = run(s)
    sends = spans[spans["op"] == "pp.send"]
    assert (sends["bytes"] == mdl.pp_activation_bytes(s.model, 1) / 2).all()


# ================================================================== bundled scenarios


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_scenario_runs(name: str, tmp_path: Path) -> None:
    path = SCENARIOS / f"{name}.yaml"
    header = path.read_text().split("\nname:")[0]
    assert "Demonstrates" in header and "Expect" in header
    assert main(["run", str(path), "--out", str(tmp_path), "--no-plots"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["scenario"]["name"] == name
    assert results["fits_in_memory"]
    assert results["sim_wall_s"] < 10


def test_bundled_pairs_differ_only_in_schedule() -> None:
    for a, b, key in (("interleaved-vs-1f1b-1f1b", "interleaved-vs-1f1b-interleaved",
                       ("schedule", "virtual_stages")),
                      ("zb-h1-vs-1f1b-1f1b", "zb-h1-vs-1f1b-zbh1", ("schedule",))):
        da = load_scenario(SCENARIOS / f"{a}.yaml").to_dict()
        db = load_scenario(SCENARIOS / f"{b}.yaml").to_dict()
        for d in (da, db):
            d.pop("name")
            for k in key:
                d["parallel"].pop(k)
        assert da == db


def test_offload_scenario_fits_only_with_offload() -> None:
    path = SCENARIOS / "llama2-7b-1gpu-offload.yaml"
    assert all(m.fits for m in memory_report(load_scenario(path)))
    assert not all(m.fits for m in memory_report(load_scenario(
        path, ["parallel.zero_offload=false"])))


def test_bundled_pair_claims() -> None:
    """What the pairs' headers claim: interleaving and ZB-H1 each beat 1F1B on the same
    job; interleaving sends 2m(pv − 1) activations/gradients against 2m(p − 1) and
    holds more activations; ZB-H1 holds exactly 1F1B's."""
    got = {}
    for name in ("interleaved-vs-1f1b-1f1b", "interleaved-vs-1f1b-interleaved",
                 "zb-h1-vs-1f1b-1f1b", "zb-h1-vs-1f1b-zbh1"):
        s = load_scenario(SCENARIOS / f"{name}.yaml")
        res, spans = run(s)
        got[name] = (s, res, int((spans["op"] == "pp.send").sum()))
    _, r1, n1 = got["interleaved-vs-1f1b-1f1b"]
    si, ri, ni = got["interleaved-vs-1f1b-interleaved"]
    p, m, v = si.parallel.pp, si.microbatches, si.parallel.virtual_stages
    assert (n1, ni) == (2 * m * (p - 1), 2 * m * (p * v - 1))
    assert ri["step_time_s"] < r1["step_time_s"] and ri["bubble_fraction"] < r1["bubble_fraction"]
    assert ri["memory_peak_bytes"] > r1["memory_peak_bytes"]
    (_, ra, _), (_, rz, _) = got["zb-h1-vs-1f1b-1f1b"], got["zb-h1-vs-1f1b-zbh1"]
    assert rz["step_time_s"] < 0.95 * ra["step_time_s"]
    assert rz["memory_peak_bytes"] == ra["memory_peak_bytes"]


@pytest.mark.parametrize("zero", [0, 3])
def test_device_without_comm_overlap_runs_transfers_in_line(zero: int) -> None:
    """cpu-1thread declares gpu.comm_overlaps_compute: false: every DP, PP and ZeRO
    transfer then sits on the compute stream; the GPU presets keep their overlap."""
    s = make(pp=2, dp=2, m=4, zero=zero, cluster={"system": "cpu-1thread", "nodes": 2,
                                                    "gpus_per_node": 2})
    assert not s.hardware.gpu.comm_overlaps_compute
    _, spans = run(s)
    comm = spans[spans["kind"].isin(["dp", "pp", "zero"])]
    assert len(comm) and set(comm["stream"]) == {"compute"}
    overlapping = scenario_from_dict({**s.to_dict(), "cluster": {**s.to_dict()["cluster"],
                                                                   "system": "dgx-a100-80gb"}})
    assert overlapping.hardware.gpu.comm_overlaps_compute


@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_ends(sp: bool) -> None:
    """Per micro-batch, Megatron's vocab-parallel embedding reduces its partial sums
    (all-reduce; reduce-scatter with SP, whose backward all-gathers), the output layer
    all-gathers its input with SP and reduces its input gradient, and the parallel
    cross-entropy makes three fp32-per-token all-reduces."""
    m, b = 2, 1
    s = make(tp=2, pp=2, m=m, b=b, sequence_parallel=sp)
    _, spans = run(s)
    ends = spans[(spans["kind"] == "tp") & (spans["layer"] < 0)]
    first, last = stage_of(ends, 0), stage_of(ends, 1)
    size = mdl.tp_comm_bytes_per_layer(s.model, b)
    expect_first = ["tp.reduce_scatter", "tp.all_gather"] if sp else ["tp.all_reduce"]
    assert sorted(first["op"]) == sorted(expect_first * m)
    assert (first["bytes"] == size).all()
    big = last[last["bytes"] == size]
    assert sorted(big["op"]) == sorted((["tp.all_gather", "tp.reduce_scatter"] if sp
                                        else ["tp.all_reduce"]) * m)
    loss = last[last["bytes"] == 4 * b * s.model.seq_len]
    assert list(loss["op"]) == ["tp.all_reduce"] * 3 * m
