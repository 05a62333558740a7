"""TP communication overlap (``stack.tp_overlap``, simulator/strategies/tensor/overlap.py): the
closed forms of what each overlapped collective leaves exposed, the engine's pieces
against them (the analytic method is the second, independent implementation), what
bulk and pipelined each move, the limits (free and very slow links), and the refusals.
Also the receive of a pipeline stage gating the sequence-parallel all-gather before its
first block (a bug: the all-gather used to start before the activation arrived)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.uncertainty import step_time_of
from simulator.builder.workload import block_costs, build_workload, layout_of
from simulator.errors import ScenarioError
from simulator.model import transformer as mdl
from simulator.spec.load import scenario_from_dict
from simulator.spec.rules import not_yet_simulated
from simulator.spec.scenario import Scenario
from simulator.strategies.tensor.overlap import (
    COMM_SMS,
    PIPELINE_SPLITS,
    Window,
    exposed,
    margin,
    overlap_windows,
    partials_sum,
)
from simulator.strategies.timing import collective_time


def _tp(mode: str, *, schedule: str = "1f1b", pp: int = 1, bandwidth: float | None = None,
        latency: float | None = None, system: str = "dgx-h100", **par: Any) -> Scenario:
    gpus = 4 * pp * int(par.get("cp", 1))
    cluster: dict[str, Any] = {"system": system, "nodes": 1, "gpus_per_node": gpus}
    if bandwidth is not None:
        cluster["intra_node_bandwidth_GBps"] = bandwidth
    if latency is not None:
        cluster["link_latency_us"] = latency
    return scenario_from_dict({
        "name": "tp-overlap", "stack": {"preset": "megatron-core", "tp_overlap": mode},
        "model": {"layers": 2 * pp, "hidden": 4096, "heads": 32, "vocab": 32000,
                  "seq_len": 2048},
        "cluster": cluster,
        "parallel": {"tp": 4, "pp": pp, "dp": 1, "sequence_parallel": True,
                     "schedule": schedule, **par},
        "training": {"global_batch": 4, "micro_batch": 1}})


def _cost(s: Scenario) -> Any:
    from simulator.system.costs import CostModel

    return CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)


def test_exposed_closed_forms() -> None:
    """Ring exchange and pipeline: t − (p − 1)·c exposed, p·c − whole added; bulk: t − W."""
    w = {(label, side, bwd): Window("g", 4.0, 1.25, 4) for label in ("attn", "mlp")
         for side in ("ag", "rs") for bwd in (False, True)}
    w["attn", "rs", True] = w["mlp", "rs", True] = Window("g", 3.0, 3.0, 1, weight=True)
    # t = 5: each chunked side exposes 5 − 3·1.25 = 1.25 and adds 4·1.25 − 4 = 1
    assert exposed("pipelined", w, 5.0, False) == pytest.approx((4 * 1.25, 4 * 1.0))
    # backward: two ring sides as above, two bulk sides expose 5 − 3 = 2 and add nothing
    assert exposed("pipelined", w, 5.0, True) == pytest.approx((2 * 1.25 + 2 * 2.0, 2.0))
    assert exposed("bulk", w, 5.0, False) == (20.0, 0.0)  # all in line
    assert exposed("bulk", w, 5.0, True) == pytest.approx((2 * 5.0 + 2 * 2.0, 0.0))
    assert exposed("bulk", w, 5.0, True, weights=False) == (20.0, 0.0)  # an I action
    assert exposed("pipelined", w, 1.0, False) == pytest.approx((0.0, 4.0))  # hidden


def test_windows_are_the_blocks_projections_and_chunks_cost_more() -> None:
    s = _tp("pipelined")
    w = overlap_windows(s, _cost(s))
    assert {k: v.gemm for k, v in w.items() if not k[2]} == {
        ("attn", "ag", False): "qkv", ("attn", "rs", False): "out_proj",
        ("mlp", "ag", False): "mlp_up", ("mlp", "rs", False): "mlp_down"}
    assert w["attn", "ag", True].gemm == "out_proj" and w["attn", "rs", True].gemm == "qkv"
    for v in w.values():
        if v.parts > 1:  # a quarter of the rows cannot be more efficient than all of them
            assert v.parts == 4 and v.parts * v.chunk >= v.whole > v.chunk
        else:
            assert v.chunk == v.whole
    assert overlap_windows(_tp("none"), _cost(s)) == {}


def _pieces(s: Scenario, prefix: str) -> list[Any]:
    return [t for t in build_workload(s).programs[0].streams["compute"]
            if t.name.startswith(prefix)]


@pytest.mark.parametrize("mode", ["bulk", "pipelined"])
def test_the_split_keeps_each_blocks_compute_and_weight_share(mode: str) -> None:
    """The pieces of a block add up to the block's seconds plus the split's extra, and a
    backward block's weight-gradient share is kept but for the SM margin's share of the
    bulk piece (all weights: the weight-gradient GEMM on TE's margin takes m times as
    long)."""
    base, s = _tp("none"), _tp(mode)
    w = block_costs(s, _cost(s)).tp_windows
    for prefix, label, bwd in (("fwd.attn L0 mb0", "attn", False),
                               ("fwd.mlp L1 mb2", "mlp", False),
                               ("bwd.attn L0 mb1", "attn", True),
                               ("bwd.mlp L1 mb3", "mlp", True)):
        (whole,) = _pieces(base, prefix)
        pieces = _pieces(s, prefix)
        ag = mode == "pipelined"
        extra = sum(w[label, side, bwd].extra for side, on in (("ag", ag), ("rs", ag or bwd))
                    if on)
        assert sum(t.duration for t in pieces) == pytest.approx(whole.duration + extra)
        bulk = w[label, "rs", True]
        margin = (bulk.slow - 1) * bulk.whole if bwd else 0.0
        assert sum(t.weight_s for t in pieces) == pytest.approx(whole.weight_s + margin)
        if mode == "bulk" and not bwd:
            assert [t.duration for t in pieces] == [whole.duration]  # forward in line


@pytest.mark.parametrize("mode", ["bulk", "pipelined"])
@pytest.mark.parametrize("bandwidth", [None, 20.0])
def test_engine_and_analytic_move_alike(mode: str, bandwidth: float | None,
                                        one_compute_speed: None) -> None:
    """The engine's pieces and the analytic closed form save the same seconds, with the
    preset's NVLink and with links slow enough that nothing is fully hidden (TE's
    userbuffers hold no SMs of their own, their GEMMs' margin is priced alike; the
    fixture keeps any NCCL collective's SMs out of both)."""
    base, s = _tp("none", bandwidth=bandwidth), _tp(mode, bandwidth=bandwidth)
    saved = {m: step_time_of(base, m, None) - step_time_of(s, m, None)
             for m in ("engine", "analytic")}
    assert saved["engine"] > 0
    assert saved["engine"] == pytest.approx(saved["analytic"], rel=1e-6)


def test_limits_free_links_cost_only_the_split_slow_links_hide_every_window() -> None:
    free: dict[str, Any] = {"bandwidth": 1e9, "latency": 0.0}
    s = _tp("pipelined", **free)
    w = block_costs(s, _cost(s)).tp_windows
    layers, mbs = 2, 4
    per_layer = {bwd: sum(w[label, side, bwd].extra for label in ("attn", "mlp")
                          for side in ("ag", "rs")) for bwd in (False, True)}
    grown = step_time_of(s, "engine", None) - step_time_of(_tp("none", **free), "engine", None)
    assert grown == pytest.approx(layers * mbs * (per_layer[False] + per_layer[True]),
                                  rel=1e-3)
    slow: dict[str, Any] = {"bandwidth": 0.5}
    s = _tp("pipelined", **slow)
    w = block_costs(s, _cost(s)).tp_windows
    hidden = sum(v.hidden - v.extra for v in w.values())  # per layer, forward + backward
    # a pipeline's last chunk reduce-scatters on its own: its share's latency again
    t = collective_time(s, layout_of(s), "reduce_scatter",
                        mdl.tp_comm_bytes_per_layer(s.model, 1, "bf16"), (0, 1, 2, 3),
                        s.hardware)
    split = sum(t * (sum(v.shares) - 1) for v in w.values())
    assert split > 0
    saved = step_time_of(_tp("none", **slow), "engine", None) - step_time_of(s, "engine", None)
    assert saved == pytest.approx(layers * mbs * (hidden - split), rel=1e-3)


def test_an_i_action_has_no_weight_gradient_to_hide_the_reduce_scatter() -> None:
    tasks = build_workload(_tp("bulk", schedule="zb-h1", pp=2)).programs[0].streams
    assert not [t for t in tasks["tp"] if "reduce_scatter" in t.op]
    assert [t for t in tasks["compute"] if t.op == "I" and t.kind == "backward"]


def test_a_device_that_cannot_overlap_runs_them_in_line() -> None:
    cpu: dict[str, Any] = {"system": "cpu-1thread"}
    a, b = build_workload(_tp("none", **cpu)), build_workload(_tp("pipelined", **cpu))
    assert [(t.name, t.duration) for t in a.tasks] == [(t.name, t.duration) for t in b.tasks]
    assert "tp" not in b.programs[0].streams


def test_without_sequence_parallelism_it_is_one_line_naming_the_field() -> None:
    with pytest.raises(ScenarioError) as err:
        _tp("pipelined", sequence_parallel=False)
    text = str(err.value)
    assert "stack.tp_overlap" in text and "sequence_parallel: true" in text
    assert "\n" not in text.strip()


def test_with_context_parallelism_it_is_refused_as_not_yet_simulated() -> None:
    [problem] = not_yet_simulated(_tp("pipelined", cp=2))
    assert problem.field == "parallel.cp" and "not yet simulated" in problem.fix
    assert not not_yet_simulated(_tp("none", cp=2))


@pytest.mark.parametrize("mode", ["none", "pipelined"])
def test_the_stage_receive_gates_the_sequence_parallel_all_gather(mode: str) -> None:
    """A later stage's first compute-stream task of an F is the all-gather before its
    first block (in line) or the mark it starts from (overlapped); it must wait for the
    activation from the stage before (the in-line one used to start without it)."""
    w = build_workload(_tp(mode, pp=2))
    stage1 = next(r for r in w.programs if w.layout.coord(r).pp == 1)
    first = w.programs[stage1].streams["compute"][0]
    sends = {t.id for t in w.tasks if t.op == "pp.send" and t.rank != stage1}
    assert sends & set(first.deps)
    if mode == "none":
        assert first.op == "tp.all_gather"
    else:
        assert first.name == "tp.start L2 mb0" and first.duration == 0
        gather = w.programs[stage1].streams["tp"][0]
        assert gather.op == "tp.all_gather" and gather.deps == [first.id]


@pytest.mark.parametrize("bandwidth", [None, 20.0])
def test_a_functional_collectives_host_issue_is_never_hidden(bandwidth: float | None) -> None:
    """Under DTensor the issue of each overlapped collective stays on the compute stream
    (before the GEMM it meets): the overlap saves what it saves without one, in the
    engine and in the closed form alike, with a GEMM that hides the transfer (NVLink)
    and with one that does not."""
    from simulator.analysis.uncertainty import with_hardware

    def dtensor(mode: str, funcol: float | None) -> Scenario:
        s = _tp(mode, bandwidth=bandwidth)
        s = s.model_copy(update={"stack": s.stack.model_copy(update={"dtensor": True})})
        gpu = s.hardware.gpu.model_copy(update={"funcol_overhead_us": funcol})
        return with_hardware(s, s.hardware.model_copy(update={"gpu": gpu}))

    saved = {}
    for funcol in (None, 20.0):
        base, s = dtensor("none", funcol), dtensor("pipelined", funcol)
        saved[funcol] = {m: step_time_of(base, m, None) - step_time_of(s, m, None)
                         for m in ("engine", "analytic")}
    for m in ("engine", "analytic"):
        assert saved[20.0][m] == pytest.approx(saved[None][m], rel=1e-6)
        assert saved[20.0][m] > 0

    def issues(mode: str) -> int:
        return sum(t.name == "tp.funcol issue" for t in build_workload(
            dtensor(mode, 20.0)).programs[0].streams["compute"])

    assert issues("pipelined") == issues("none") > 0


def test_an_overlapped_all_gather_starts_with_its_block_whatever_else_precedes_it() -> None:
    """ZeRO-3 by modules puts a ``zero3.wait`` before the MLP block (after the TP pass's
    start mark); the TP all-gather must still start from its own mark, not wait for the
    parameters' gather (it used to take the task just before the block)."""
    s = scenario_from_dict({
        "name": "tp-overlap-zero3", "stack": {"preset": "deepspeed", "tp_overlap": "pipelined"},
        "model": {"layers": 2, "hidden": 1024, "heads": 16, "vocab": 8192, "seq_len": 1024},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 8},
        "parallel": {"tp": 2, "dp": 4, "zero": 3, "sequence_parallel": True},
        "training": {"global_batch": 8, "micro_batch": 1}})
    w = build_workload(s)
    by_id = {t.id: t for t in w.tasks}
    gathers = [t for t in w.programs[0].streams["tp"] if t.op == "tp.all_gather"]
    assert gathers and any(t.name.startswith("zero3.wait")
                           for t in w.programs[0].streams["compute"])
    for t in gathers:
        assert [by_id[d].name.split(" L")[0] for d in t.deps] == ["tp.start"]


def test_te_userbuffers_defaults() -> None:
    """Transformer Engine's ``initialize_ub`` defaults (``get_default_config``, v1.9
    through v2.x): a ring exchange splits in tp chunks moved by copy engines (no SM
    margin), a pipeline in 4 chunks whatever tp is and a bulk overlap whole, both on
    the SMs 16 communication SMs leave (``set_sm_margin``, TE 2.x): 132/116 on an H100;
    the pipeline's last chunk's transfer after the GEMMs (1/4), nobody else's."""
    assert (COMM_SMS, PIPELINE_SPLITS) == (16, 4)
    for tp in (2, 4, 8):
        s = _tp("pipelined")
        s = s.model_copy(update={"parallel": s.parallel.model_copy(update={"tp": tp})})
        w = overlap_windows(s, _cost(s))
        for label in ("attn", "mlp"):
            assert (w[label, "ag", False].parts, w[label, "ag", True].parts) == (tp, tp)
            assert w[label, "ag", False].slow == w[label, "ag", True].slow == 1.0
            assert w[label, "rs", False].parts == 4 and w[label, "rs", True].parts == 1
            assert w[label, "rs", False].slow == w[label, "rs", True].slow \
                == pytest.approx(132 / 116)
            assert w[label, "rs", False].tail == 0.25
            assert w[label, "rs", True].aside > 0 and w[label, "rs", False].aside == 0
    assert margin(_tp("pipelined", system="dgx-a100-80gb")) == pytest.approx(108 / 92)
    assert margin(_tp("pipelined", system="cpu-1thread")) == 1.0


def test_userbuffers_collectives_hold_no_sms_of_their_own() -> None:
    """The overlapped collectives are TE's userbuffers, not NCCL's kernels: their plans
    hold no SMs (the margin is the GEMMs'), where an in-line one keeps NCCL's channels."""
    w = build_workload(_tp("pipelined"))
    tp = w.programs[0].streams["tp"]
    assert tp and all(t.plan.sms == 0 for t in tp)
    tails = [t for t in w.programs[0].streams["compute"] if "(last chunk)" in t.name]
    assert tails and all(t.plan.sms == 0 for t in tails)
    assert len(tails) == 2 * 2 * 4  # each layer's two blocks, each micro-batch's forward


def test_pipeline_closed_form_with_margin_and_tail() -> None:
    """pipeline: m·c + max((p − 1)·t/p, m·(p − 1)·c) + t/p, p·m·c − W added; bulk:
    max(t, m·W) and (m − 1) times the input-gradient GEMM beside it."""
    m = 1.5
    pipe = Window("g", 4.0, 1.25, 4, m, tail=0.25)
    bulk = Window("g", 3.0, 3.0, 1, m, aside=0.5, weight=True)
    ring = Window("g", 4.0, 1.25, 4)
    w = {(label, side, bwd): (ring if side == "ag" else bulk if bwd else pipe)
         for label in ("attn", "mlp") for side in ("ag", "rs") for bwd in (False, True)}
    # t = 8: a pipeline side waits 6 − 3·1.875 = 0.375 beside its chunks, then 2 after
    comm, extra = exposed("pipelined", w, 8.0, False)
    assert comm == pytest.approx(2 * (8 - 3 * 1.25) + 2 * (0.375 + 2.0))
    assert extra == pytest.approx(2 * 1.0 + 2 * (4 * 1.25 * m - 4.0))
    # backward: the bulk sides expose 8 − 4.5 and add 3·0.5 + 0.5 each
    comm, extra = exposed("pipelined", w, 8.0, True)
    assert comm == pytest.approx(2 * (8 - 3 * 1.25) + 2 * (8 - 4.5))
    assert extra == pytest.approx(2 * 1.0 + 2 * (4.5 - 3.0 + 0.5))


def test_symmetric_memory_runs_a_chunk_per_rank_and_sums_the_partials() -> None:
    """PyTorch's async TP (torchtitan; torch/distributed/_symmetric_memory): copy
    engines (no margin), a chunk per rank on every side, nothing of the transfer after
    the GEMMs; each reduce-scatter ends with one kernel summing the tp partial chunks the
    rank received (the block's output read, the shard written) and in the backward meets
    the first projection's input-gradient GEMM, not the weight gradient's, so a
    zero-bubble I action overlaps it too."""
    def with_runtime(runtime: str, **par: Any) -> Scenario:
        s = _tp("pipelined", **par)
        stack = s.stack.model_copy(update={"tp_overlap_runtime": runtime})
        return s.model_copy(update={"stack": stack})

    sym = with_runtime("symmetric_memory")
    w = overlap_windows(sym, _cost(sym))
    assert margin(sym) == 1.0
    for (_, side, _), v in w.items():
        assert v.slow == 1.0 and v.tail == 0.0 and v.aside == 0.0 and not v.weight
        assert v.parts == sym.parallel.tp
        assert (v.after > 0) == (side == "rs")
    assert w["attn", "rs", True].gemm == "qkv" and w["mlp", "rs", True].gemm == "mlp_up"
    op = partials_sum(sym)
    tp_bytes = mdl.tp_comm_bytes_per_layer(sym.model, 1, "bf16")
    assert op.bytes == pytest.approx(tp_bytes * (4 + 1) / 4)
    assert w["attn", "rs", False].after == pytest.approx(_cost(sym).op_time(op))
    # the engine's pieces: the sum after the wait, and an I action keeps the overlap
    tasks = build_workload(with_runtime("symmetric_memory", schedule="zb-h1", pp=2)).programs[0]
    assert [t for t in tasks.streams["tp"] if "reduce_scatter" in t.op]
    sums = [t for t in tasks.streams["compute"] if t.name.startswith("tp.partials_sum")]
    assert sums and all(t.duration == pytest.approx(w["attn", "rs", False].after) for t in sums)
    for bandwidth in (None, 20.0):
        base = with_runtime("symmetric_memory", bandwidth=bandwidth)
        none = base.model_copy(update={"stack": base.stack.model_copy(
            update={"tp_overlap": "none"})})
        saved = {m: step_time_of(none, m, None) - step_time_of(base, m, None)
                 for m in ("engine", "analytic")}
        assert saved["engine"] == pytest.approx(saved["analytic"], rel=1e-6)


@given(sms=st.integers(17, 400), fewer=st.integers(1, 64))
@settings(max_examples=25, deadline=None)
def test_userbuffers_margin_moves_time_as_te_sets_it(sms: int, fewer: int) -> None:
    """``tp_overlap_runtime: userbuffers`` (TE's ``set_sm_margin``): the pipeline and bulk
    GEMMs take sms / (sms − 16) as long, ring exchanges none of it, so a GPU with fewer
    SMs pays more of it; symmetric memory pays none whatever the SM count (GEMMs priced
    without the tiles' wave quantisation, which the SM count also moves)."""
    from simulator.analysis.uncertainty import with_hardware

    def on(n: int, runtime: str = "userbuffers") -> Scenario:
        s = _tp("pipelined")
        s = s.model_copy(update={"stack": s.stack.model_copy(
            update={"tp_overlap_runtime": runtime})})
        gpu = s.hardware.gpu.model_copy(update={"sms": n, "gemm_tiles": ()})
        return with_hardware(s, s.hardware.model_copy(update={"gpu": gpu}))

    def extra(s: Scenario) -> float:
        return sum(w.extra for w in overlap_windows(s, _cost(s)).values())

    more, less = on(sms + fewer), on(sms)
    w = overlap_windows(less, _cost(less))
    assert w["attn", "rs", False].slow == pytest.approx(sms / (sms - COMM_SMS))
    assert w["attn", "ag", False].slow == w["attn", "ag", True].slow == 1.0
    assert extra(less) > extra(more)
    assert extra(on(sms, "symmetric_memory")) == pytest.approx(
        extra(on(sms + fewer, "symmetric_memory")))


# ---------------------------------------------------------------- Megatron's async backward

def test_async_closed_forms() -> None:
    """``async``: the forward's collectives in line; in backward the gather of the output
    gradient in line and the input gradient's collective exposing t − W beside the
    weight-gradient GEMM (all of t in an I action); nothing added to the GEMMs."""
    w = {(label, "rs", True): Window("g", 3.0, 3.0, 1, weight=True) for label in ("attn", "mlp")}
    assert exposed("async", w, 5.0, False) == (20.0, 0.0)
    assert exposed("async", w, 5.0, True) == pytest.approx((2 * (5.0 + 2.0), 0.0))
    assert exposed("async", w, 5.0, True, weights=False) == (20.0, 0.0)
    assert exposed("async", w, 5.0, False, sp=False) == (10.0, 0.0)  # one all-reduce each
    assert exposed("async", w, 5.0, True, sp=False) == pytest.approx((4.0, 0.0))
    assert exposed("async", w, 1.0, True, labels=("mlp",)) == pytest.approx((1.0, 0.0))


@pytest.mark.parametrize("sp", [True, False])
def test_async_windows_are_the_column_parallel_weight_gradients(sp: bool) -> None:
    s = _tp("async", sequence_parallel=sp)
    w = overlap_windows(s, _cost(s))
    assert set(w) == {("attn", "rs", True), ("mlp", "rs", True)}
    assert w["attn", "rs", True].gemm == "qkv" and w["mlp", "rs", True].gemm == "mlp_up"
    assert all(v.weight and v.slow == 1.0 and v.parts == 1 and not v.extra for v in w.values())
    bulk = overlap_windows(_tp("bulk"), _cost(s))  # the same GEMM, without TE's margin
    for k, v in w.items():
        assert v.whole == bulk[k].whole and bulk[k].slow > v.slow


@pytest.mark.parametrize("sp", [True, False])
def test_async_split_keeps_each_blocks_compute_and_weight_share(sp: bool) -> None:
    """No chunks, no margin: a block's pieces add up to its seconds and weight share, the
    forward is one piece, the backward's weight-gradient GEMM stands beside the
    collective, NCCL's own (holding its channels' SMs), on the tp stream."""
    base, s = _tp("none", sequence_parallel=sp), _tp("async", sequence_parallel=sp)
    w = block_costs(s, _cost(s)).tp_windows
    for prefix, label, bwd in (("fwd.attn L0 mb0", "attn", False),
                               ("bwd.attn L0 mb1", "attn", True),
                               ("bwd.mlp L1 mb3", "mlp", True)):
        (whole,) = _pieces(base, prefix)
        pieces = _pieces(s, prefix)
        assert sum(t.duration for t in pieces) == pytest.approx(whole.duration)
        assert sum(t.weight_s for t in pieces) == pytest.approx(whole.weight_s)
        if bwd:
            assert pieces[1].duration == pytest.approx(w[label, "rs", True].whole)
            assert pieces[1].weight_s == pieces[1].duration
        else:
            assert len(pieces) == 1
    side = build_workload(s).programs[0].streams["tp"]
    assert {t.op for t in side} == {"tp.reduce_scatter" if sp else "tp.all_reduce"}
    assert all(t.plan.sms > 0 for t in side)


@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("bandwidth", [None, 20.0])
def test_async_engine_and_analytic_move_alike(sp: bool, bandwidth: float | None,
                                              one_compute_speed: None) -> None:
    """Against in line, the engine and the analytic closed form save the same seconds
    (the fixture keeps NCCL's SMs out of both), and it is a saving."""
    base = _tp("none", bandwidth=bandwidth, sequence_parallel=sp)
    s = _tp("async", bandwidth=bandwidth, sequence_parallel=sp)
    saved = {m: step_time_of(base, m, None) - step_time_of(s, m, None)
             for m in ("engine", "analytic")}
    assert saved["engine"] > 0
    assert saved["engine"] == pytest.approx(saved["analytic"], rel=1e-6)


def test_async_collectives_hold_sms_that_slow_the_gemm_beside() -> None:
    """With NCCL's kernels holding their channels' SMs the engine's step is slower than
    the analytic form's, which has no SM term (within a few per cent)."""
    s = _tp("async")
    engine, analytic = step_time_of(s, "engine", None), step_time_of(s, "analytic", None)
    assert analytic < engine < 1.05 * analytic


def test_async_in_line_beside_context_parallelism_and_refused_under_dtensor() -> None:
    s = _tp("async", cp=2)
    assert not not_yet_simulated(s) and overlap_windows(s, _cost(s)) == {}
    assert "tp" not in build_workload(s).programs[0].streams
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict({
            "name": "dtensor-async", "stack": {"preset": "pytorch-eager", "tp_overlap": "async"},
            "model": {"layers": 2, "hidden": 1024, "heads": 8, "vocab": 32000,
                      "seq_len": 1024},
            "cluster": {"system": "dgx-h100", "nodes": 1, "gpus_per_node": 4},
            "parallel": {"tp": 4, "dp": 1},
            "training": {"global_batch": 4, "micro_batch": 1}})
    assert "stack.tp_overlap" in str(err.value) and "none" in str(err.value)


def test_megatron_stacks_run_the_async_backward_from_2022() -> None:
    """megatron-2021 (the SC'21 code) all-reduces in line; the asynchronous backward is in
    Megatron-LM from 2021-09 (megatron-2022) and in Transformer Engine's layers
    (megatron-core)."""
    from simulator.spec.stack import load_stack

    assert load_stack("megatron-2021").tp_overlap == "none"
    assert load_stack("megatron-2022").tp_overlap == "async"
    assert load_stack("megatron-core").tp_overlap == "async"
