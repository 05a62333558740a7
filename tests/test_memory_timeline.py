"""Memory over time (issue 4 item 7): each rank's allocated bytes replayed from the trace,
against memory.py's per-stage totals and an action-level replay of the schedule.

Agreement is exact (rel 1e-12: the curve sums the same byte counts in another order)
wherever memory.py's components are all held at one instant, and otherwise differs
by exactly the component the timeline shows is not (or is additionally) held there;
see simulator/analysis/memory_timeline.py's docstring for the reasons."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from simulator.analysis.memory import stage_breakdown
from simulator.analysis.memory_timeline import (
    component_bytes,
    downsample,
    memory_timeline,
    peak,
    stage_peaks,
    static_bytes,
)
from simulator.builder.workload import build_workload
from simulator.engine.engine import simulate
from simulator.engine.result import SimResult
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.memory import activation_bytes_per_layer
from simulator.model.transformer import layer_params
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.strategies.zero3.buffers import (
    zero3_layer_bytes,
    zero3_moments,
    zero3_peak,
    zero3_root_bytes,
)

EXACT = 1e-12
# 8 layers, h 128, a 8, V 512, s 64: a gathered layer (0.40 MB) is larger than the
# head's inputs and both fp32 logits copies (0.29 MB), which the ZeRO-3 cases rely on
MODEL = {"layers": 8, "hidden": 128, "heads": 8, "vocab": 512, "seq_len": 64}


def make(tp: int = 1, pp: int = 1, dp: int = 1, m: int = 4, fidelity: str = "folded",
         model: dict[str, Any] | None = None, **parallel: Any) -> Scenario:
    return scenario_from_dict({
        "name": "memory-timeline-test",
        "model": model or MODEL,
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": tp * pp * dp},
        "parallel": {"tp": tp, "pp": pp, "dp": dp, **parallel},
        "training": {"global_batch": m * dp, "micro_batch": 1},
        "simulation": {"fidelity": fidelity},
        # 16-bit gradients (fp32 reductions of a tiny model are communication-bound, when
        # two unsharded gradients may coexist: the module docstring's exception) and dropout
        # (without an embedding mask the ZeRO-3 first-stage peak differs: see the issue note)
        "stack": {"preset": "deepspeed", "zero3_unit": "layer"},
    })


def run(s: Scenario) -> tuple[SimResult, list[dict[str, Any]]]:
    result = simulate(build_workload(s), s.hardware)
    return result, memory_timeline(s, result)


def sizes(s: Scenario) -> dict[str, float]:
    """The allocation sizes, from memory.py's formulas (not the module under test)."""
    spec, par, b = s.model, s.parallel, s.training.micro_batch
    t, sp, dt = par.tp, par.sequence_parallel, s.training.dtype
    tok = b * spec.seq_len * spec.hidden * dtype_bytes(dt) / 2 / (t if sp else 1)
    logits = 4.0 * b * spec.seq_len * spec.vocab / t
    return {"layer": activation_bytes_per_layer(spec, b, t, sp, par.recompute, dt,
                                                stack=s.stack),
            "embed": tok if s.stack.hidden_dropout > 0 else 0.0,  # the embedding dropout mask
            "tok": tok,  # a b·s·h 16-bit tensor: the unit of the head's inputs
            "head": 4 * tok + logits, "dlogits": logits,
            "unit": layer_params(spec) / t * dtype_bytes(dt)}


def replay_peak(s: Scenario, result: SimResult, stage: int) -> float:
    """Action-level oracle: walk the stage's schedule, a chunk's activations (its layers,
    the embedding mask on the first virtual stage, head inputs and logits on the last)
    held from its F to its B / I, the logits' second copy at the last stage's backward."""
    sched, z = result.workload.schedule, sizes(s)
    last = sched.total_stages - 1
    per_chunk = s.model.layers // sched.total_stages * z["layer"]

    def chunk_bytes(vs: int) -> float:
        return per_chunk + (z["embed"] if vs == 0 else 0.0) + (z["head"] if vs == last else 0.0)

    held = top = 0.0
    for a in sched.actions[stage]:
        if a.kind == "F":
            held += chunk_bytes(a.stage)
            top = max(top, held)
        elif a.kind in ("B", "I"):
            if a.stage == last:
                top = max(top, held + z["dlogits"])
            held -= chunk_bytes(a.stage)
    return static_bytes(s, stage) + top


def totals(s: Scenario) -> dict[int, float]:
    return {st: stage_breakdown(s, st).total for st in range(s.parallel.pp)}


# ---------------------------------------------------------------- exact agreement

EXACT_CASES = [
    pytest.param({"pp": 4, "schedule": "gpipe"}, id="gpipe-pp4"),
    pytest.param({"pp": 4, "schedule": "1f1b", "m": 8}, id="1f1b-pp4"),
    pytest.param({"pp": 4, "schedule": "1f1b", "m": 2}, id="1f1b-pp4-m<p"),
    pytest.param({"pp": 4, "schedule": "zb-h1", "m": 8}, id="zb-h1-pp4"),
    pytest.param({"pp": 1, "dp": 2, "m": 3}, id="single-stage-ddp"),
    pytest.param({"tp": 2, "pp": 2, "dp": 2, "zero": 0}, id="ddp-tp-pp"),
    pytest.param({"pp": 2, "dp": 2, "zero": 1, "schedule": "gpipe", "recompute": "full"},
                 id="zero1-gpipe-full"),
    pytest.param({"tp": 2, "pp": 2, "dp": 2, "zero": 2, "recompute": "selective",
                  "sequence_parallel": True}, id="zero2-tp-sp-selective"),
    pytest.param({"tp": 2, "pp": 4, "schedule": "zb-h1", "recompute": "full",
                  "sequence_parallel": True, "m": 6}, id="zb-h1-tp-sp-full"),
    pytest.param({"pp": 2, "dp": 2, "zero": 2, "zero_offload": True}, id="zero2-offload"),
]


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipe"])
def test_moe_layers_hold_their_own_activations(schedule: str) -> None:
    """A mixture of experts whose first layer is dense: each layer holds its own kind's
    activations, so the curve's peak is memory.py's (it held the dense layer's for every
    layer before 2026-12-06: DeepSeek-V3's curve peaked 12 GB under the table)."""
    model = {**MODEL, "experts": 4, "experts_per_token": 2, "first_dense_layers": 1}
    extra = {"virtual_stages": 2} if schedule == "dualpipe" else {}
    s = make(pp=2, m=4, model=model, schedule=schedule, **extra)
    _, tl = run(s)
    got = stage_peaks(tl)
    layer = max(activation_bytes_per_layer(s.model, 1, layer=i, stack=s.stack)
                for i in range(s.model.layers))
    for st, total in totals(s).items():
        if schedule == "dualpipe":  # memory.py: the mean of the rank's two chunks in flight
            assert total - layer < got[st] <= total, st
        else:
            assert got[st] == pytest.approx(total, rel=EXACT), st


@pytest.mark.parametrize("case", EXACT_CASES)
def test_peak_equals_memory_py(case: dict[str, Any]) -> None:
    """No ZeRO-3: at the first backward's start every in-flight micro-batch's activations
    (and on the last stage both logits copies) are held at once, as memory.py sums them."""
    s = make(**case)
    result, tl = run(s)
    got = stage_peaks(tl)
    for st, total in totals(s).items():
        assert got[st] == pytest.approx(total, rel=EXACT), st
        assert got[st] == pytest.approx(replay_peak(s, result, st), rel=EXACT), st


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 4), (4, 2, 8), (2, 3, 6)])
def test_interleaved_peak(pp: int, v: int, m: int) -> None:
    """Interleaved: the schedule's replay exactly; memory.py exactly on middle stages; on
    the first and last it scales the embedding mask / head inputs by the fractional
    in-flight (warm-up + 1) / v instead of counting micro-batches of that chunk, so the
    difference is at most one such allocation per chunk forward in flight."""
    s = make(pp=pp, m=m, schedule="interleaved", virtual_stages=v,
             model={**MODEL, "layers": 2 * pp * v})
    result, tl = run(s)
    got, z = stage_peaks(tl), sizes(s)
    for st, total in totals(s).items():
        assert got[st] == pytest.approx(replay_peak(s, result, st), rel=EXACT), st
        warm = min(2 * (pp - st - 1) + (v - 1) * pp + 1, m * v)
        extra = (z["embed"] if st == 0 else 0.0) + (4 * z["tok"] if st == pp - 1 else 0.0)
        assert abs(got[st] - total) <= extra * warm + 1e-6 * total, st
        if 0 < st < pp - 1:
            assert got[st] == pytest.approx(total, rel=EXACT)


# ---------------------------------------------------------------- ZeRO-3


def _zero3(**kw: Any) -> tuple[Scenario, dict[int, float], dict[int, float], dict[str, float]]:
    s = make(pp=kw.pop("pp", 2), dp=kw.pop("dp", 2), zero=3, **kw)
    _, tl = run(s)
    return s, stage_peaks(tl), totals(s), sizes(s)


@pytest.mark.parametrize("case", [
    pytest.param({}, id="1f1b"),
    pytest.param({"schedule": "gpipe"}, id="gpipe"),
    pytest.param({"fsdp_prefetch": 0}, id="prefetch0"),
    pytest.param({"fsdp_prefetch": 2}, id="prefetch2"),
    pytest.param({"tp": 2, "recompute": "full", "sequence_parallel": True}, id="tp-sp-full"),
    pytest.param({"tp": 2, "recompute": "selective", "fidelity": "full"}, id="tp-selective-full"),
])
def test_zero3_first_stage_exact_last_stage_frees_the_head_inputs(case: dict[str, Any]) -> None:
    """At the first backward of a non-last stage the curve holds all in-flight activations,
    the backward's gathered layer, the prefetched ones and the first unsharded gradient:
    memory.py's sum exactly. On the last stage of this model (a gathered layer outweighs
    the logits) the table's peak is its first block's backward (zero3_moments' "block":
    the loss's copies freed, the output layer's gradient made); the curve holds the same
    less the head's inputs (final norm's and logits GEMM's, 4 b·s·h), which the head's
    backward frees and the table keeps in the activations."""
    s, got, total, z = _zero3(**case)
    assert got[0] == pytest.approx(total[0], rel=EXACT)
    last = s.parallel.pp - 1
    assert zero3_peak(s, last).name == "block"
    assert got[last] == pytest.approx(total[last] - 4 * z["tok"], rel=EXACT)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_zero3_loss_moment_with_the_engine_prefetches(prefetch: int) -> None:
    """A large vocabulary: the table's peak is the loss's backward (every logits copy, the
    root unit and the running layer gathered, no gradient yet, as FSDPMemTracker sees
    it); the engine issues the first backward's prefetched gathers during the loss's
    backward (FSDP2 issues them at the first block's pre-backward), so the curve holds
    ``fsdp_prefetch`` gathered layers more."""
    s, got, total, z = _zero3(model={**MODEL, "vocab": 8192}, fsdp_prefetch=prefetch)
    last = s.parallel.pp - 1
    assert zero3_peak(s, last).name == "loss"
    assert got[0] == pytest.approx(total[0], rel=EXACT)
    assert got[last] == pytest.approx(total[last] + prefetch * z["unit"], rel=EXACT)


def test_zero3_single_stage() -> None:
    _, got, total, z = _zero3(pp=1, dp=4)
    assert got[0] == pytest.approx(total[0] - 4 * z["tok"], rel=EXACT)


def test_zero3_zb_h1_has_no_gradient_buffer_at_the_activation_peak() -> None:
    """ZB-H1's I computes no weight gradient: the unsharded gradients (W, later: a
    layer's, and on the last stage the output layer's) never coincide with the
    activation peak. A first stage holds memory.py's total less the layer's gradient; the
    last stage's curve peaks at the loss's backward (its moment, with the engine's
    prefetched layer: the test above)."""
    s, got, total, z = _zero3(schedule="zb-h1")
    last = s.parallel.pp - 1
    for st in total:
        head_grad = zero3_root_bytes(s, st)[1]
        assert head_grad == 0 or st == last
    assert got[0] == pytest.approx(total[0] - z["unit"], rel=EXACT)
    br = stage_breakdown(s, last)
    loss = zero3_moments(s, last)[0]
    at_loss = total[last] - br.logits - br.comm_buffers + loss.total
    assert got[last] == pytest.approx(at_loss + z["unit"], rel=EXACT)


def test_zero3_interleaved_with_tp() -> None:
    s = make(tp=2, pp=2, dp=2, zero=3, m=4, schedule="interleaved", virtual_stages=2)
    result, tl = run(s)
    got, total, z = stage_peaks(tl), totals(s), sizes(s)
    # stage 0: memory.py's sum plus the interleaved embedding-mask count (replay - memory.py
    # without ZeRO-3 buffers); last stage: the table's peak is its first block's backward
    # (no logits), where the curve holds the replay's activations less the head's inputs
    # and both logits copies (freed by the head's backward), and the table's buffers
    for st in total:
        replay_gap = replay_peak(s, result, st) - (total[st] - stage_breakdown(s, st)
                                                    .comm_buffers)
        if st == 0:
            assert got[st] == pytest.approx(total[st] + replay_gap, rel=EXACT)
        else:
            assert zero3_peak(s, st).name == "block"
            gap = z["head"] + z["dlogits"]
            assert got[st] == pytest.approx(total[st] + replay_gap - gap, rel=EXACT)


def test_zero3_without_reshard_holds_every_layer_until_its_backward() -> None:
    """reshard_after_forward: false keeps the stage's L/pp layers gathered from forward to
    backward: L/pp gathered + one gradient, as memory.py counts it."""
    _, got, total, _ = _zero3(reshard_after_forward=False)
    assert got[0] == pytest.approx(total[0], rel=EXACT)


def test_zero3_without_prefetch_overlap_gathers_nothing_ahead() -> None:
    """overlap.zero3_prefetch: false gathers on the compute stream just before use: no
    prefetched layer is held, and memory.py counts none."""
    _, got, total, _ = _zero3(overlap={"zero3_prefetch": False})
    assert got[0] == pytest.approx(total[0], rel=EXACT)


def test_zero3_gathered_units_follow_the_trace() -> None:
    """Between steps of the curve the ZeRO-3 buffers are whole layers: every value is the
    static bytes plus a non-negative combination of the allocation sizes, and the curve
    leaves the static level exactly when the first all-gather starts."""
    s = make(pp=1, dp=4, zero=3, m=2)
    result, tl = run(s)
    (entry,) = tl
    pts = np.asarray(entry["points"])
    base = static_bytes(s, 0)
    first_gather = min(a for tid, a, _ in result.spans
                       if result.workload.tasks[tid].op == "zero.all_gather")
    assert pts[0].tolist() == [0.0, base]
    assert pts[1, 0] == pytest.approx(first_gather)
    # the first gather is the root unit's (embedding and head), before the embedding
    assert pts[1, 1] == pytest.approx(base + zero3_root_bytes(s, 0)[0], rel=EXACT)
    assert (pts[:, 1] >= base - 1e-6).all()


@pytest.mark.parametrize("case", [{"pp": 1, "dp": 4, "m": 2}, {"pp": 2, "dp": 2, "m": 4}])
def test_zero3_last_gradients_held_until_their_reduce_scatter_ends(case: dict[str, Any]) -> None:
    """Each micro-batch's unsharded layer gradient is freed when the reduce-scatter that
    waits on it ends (ZeRO-3 reduces after every micro-batch): the curve steps down by
    one layer exactly there; the root unit's reduce-scatter frees the output layer's
    gradient on the last stage."""
    s = make(zero=3, **case)
    result, tl = run(s)
    tasks, unit = result.workload.tasks, sizes(s)["unit"]
    checked = roots = cancelled = 0
    gathers: dict[int, list[float]] = {}
    for tid, start, _ in result.spans:
        if tasks[tid].op == "zero.all_gather":
            gathers.setdefault(tasks[tid].rank, []).append(start)
    for e in tl:
        pts = np.asarray(e["points"])
        head_grad = zero3_root_bytes(s, e["stage"])[1]
        for tid, _, end in result.spans:
            t = tasks[tid]
            if t.rank == e["rank"] and t.op == "dp.reduce_scatter" and " root " in t.name \
                    and head_grad:
                at = np.searchsorted(pts[:, 0], end * (1 + 1e-12), side="right") - 1
                before = np.searchsorted(pts[:, 0], end * (1 - 1e-9), side="right") - 1
                # (the next micro-batch's gathers may start at the same instant)
                roots += pts[at, 0] == pytest.approx(end, rel=1e-12) \
                    and pts[before, 1] - pts[at, 1] == pytest.approx(head_grad, rel=EXACT)
            elif (t.rank == e["rank"] and t.op == "dp.reduce_scatter"
                    and tasks[t.deps[0]].layer >= 0 and " root " not in t.name):
                at = np.searchsorted(pts[:, 0], end * (1 + 1e-12), side="right") - 1
                before = np.searchsorted(pts[:, 0], end * (1 - 1e-9), side="right") - 1
                if pts[at, 0] != pytest.approx(end, rel=1e-12):
                    # the next micro-batch's gradient is allocated at this very instant,
                    # or the gather the reduce-scatter held back on their communicator
                    # (simulator/strategies/zero3/communicator.py) starts: free and
                    # allocate cancel and the curve has no change point here
                    cancelled += any(abs(a - end) <= 1e-12 * end for a in gathers[t.rank])
                    continue
                assert pts[before, 1] - pts[at, 1] == pytest.approx(unit, rel=EXACT)
                checked += 1
    # at least every layer of the last micro-batch, on the rank that holds it
    assert s.model.layers <= checked + cancelled <= s.model.layers * s.microbatches
    assert roots >= 1  # the last micro-batch's at least: nothing follows it


# ---------------------------------------------------------------- curve properties


def test_curve_shape_and_format() -> None:
    s = make(tp=2, pp=2, dp=2, zero=1, m=4, fidelity="full")
    result, tl = run(s)
    assert [e["rank"] for e in tl] == sorted(result.workload.programs)  # every simulated rank
    json.dumps(tl, allow_nan=False)
    for e in tl:
        assert set(e) == {"rank", "stage", "points"}
        assert e["stage"] == result.workload.layout.coord(e["rank"]).pp
        pts = np.asarray(e["points"])
        assert pts.shape[1] == 2
        assert (np.diff(pts[:, 0]) >= 0).all()
        assert pts[0, 0] == 0.0
        assert pts[0, 1] == pytest.approx(static_bytes(s, e["stage"]), rel=EXACT)
        assert pts[-1, 1] == pytest.approx(pts[0, 1], rel=EXACT)  # everything freed by the end
        assert pts[-1, 0] <= result.end_time
        assert (pts[1:, 1] != pts[:-1, 1]).all()  # change points only
    # the tp and dp peers of a stage hold the same bytes
    by_stage: dict[int, set[float]] = {}
    for e in tl:
        by_stage.setdefault(e["stage"], set()).add(round(peak(e), 3))
    assert all(len(v) == 1 for v in by_stage.values())


def test_rank_subset() -> None:
    s = make(tp=2, pp=2, dp=2, m=4, fidelity="full")
    result = simulate(build_workload(s), s.hardware)
    sub = memory_timeline(s, result, ranks=[0, 4, 99])
    assert [e["rank"] for e in sub] == [0, 4]
    assert sub == [e for e in memory_timeline(s, result) if e["rank"] in (0, 4)]


def test_folded_and_full_fidelity_agree() -> None:
    folded = stage_peaks(run(make(tp=2, pp=2, dp=2, zero=3, m=4))[1])
    full = stage_peaks(run(make(tp=2, pp=2, dp=2, zero=3, m=4, fidelity="full"))[1])
    assert folded == pytest.approx(full, rel=EXACT)


def test_activations_follow_the_schedule_in_time() -> None:
    """1F1B on 4 stages: rank 0 reaches its peak when F of micro-batch p - 1 ends, and its
    curve then holds p micro-batches' activations above the static bytes."""
    s = make(pp=4, m=8)
    result, tl = run(s)
    tasks = result.workload.tasks
    rank0 = next(e for e in tl if e["stage"] == 0)
    pts = np.asarray(rank0["points"])
    t_peak = pts[np.argmax(pts[:, 1]), 0]
    f_end = max(b for tid, _, b in result.spans
                if tasks[tid].rank == rank0["rank"] and tasks[tid].op == "F"
                and tasks[tid].microbatch == 3)
    assert t_peak == pytest.approx(f_end)
    z = sizes(s)
    held = 4 * (s.model.layers // 4 * z["layer"] + z["embed"])
    assert pts[:, 1].max() - pts[0, 1] == pytest.approx(held, rel=EXACT)


def test_downsample_keeps_peak_and_end_and_bounds_from_above() -> None:
    s = make(pp=1, dp=2, m=64)  # 64 micro-batches x 8 layers: ~1000 change points
    result, full_tl = run(s)
    capped = memory_timeline(s, result, max_points=40)
    (full,), (small,) = full_tl, capped
    assert len(full["points"]) > 200
    assert len(small["points"]) <= 40
    assert peak(small) == peak(full)
    assert small["points"][-1][1] == full["points"][-1][1]
    f, c = np.asarray(full["points"]), np.asarray(small["points"])
    assert (np.diff(c[:, 0]) >= 0).all()
    probe = np.linspace(0.0, result.end_time, 2001)

    def at(curve: np.ndarray, t: np.ndarray) -> np.ndarray:
        return curve[np.searchsorted(curve[:, 0], t, side="right") - 1, 1]

    assert (at(c, probe) >= at(f, probe) - 1e-9).all()  # an upper envelope
    assert downsample(full["points"], 10**6) == full["points"]
    with pytest.raises(ValueError):
        downsample(full["points"], 3)


def test_peak_accepts_every_shape() -> None:
    tl = [{"rank": 0, "stage": 0, "points": [[0.0, 1.0], [1.0, 5.0], [2.0, 1.0]]},
          {"rank": 1, "stage": 1, "points": [[0.0, 2.0], [1.0, 3.0]]}]
    assert peak(tl) == 5.0
    assert peak(tl[1]) == 3.0
    assert peak(tl[1]["points"]) == 3.0
    assert peak({0: tl[0]["points"], 1: tl[1]["points"]}) == 5.0
    assert peak([]) == 0.0
    assert stage_peaks(tl) == {0: 5.0, 1: 3.0}


def test_component_sizes_match_memory_py() -> None:
    s = make(tp=2, pp=2, dp=2, sequence_parallel=True, recompute="selective")
    assert component_bytes(s) == {"activation_layer": sizes(s)["layer"],
                                  **{k: sizes(s)[k] for k in ("embed", "head", "dlogits",
                                                              "unit")},
                                  "metrics": 0.0,  # Megatron's stack: no trainer metrics
                                  # deferred ZeRO-3's per layer (buffers.accumulated_grads)
                                  "accumulated": zero3_layer_bytes(s) / 2
                                  * s.stack.reduce_bytes(2)}


def test_plot_draws_the_curves() -> None:
    """plots.memory_figure draws results["memory_timeline"] given as {rank: points}."""
    from simulator.analysis.report import common_metrics
    from simulator.outputs.plots.memory import memory_figure

    s = make(pp=2, dp=2, zero=3)
    result, tl = run(s)
    results = {**common_metrics(s, result.end_time), "scenario": s.to_dict(),
               "memory_timeline": {e["rank"]: e["points"] for e in tl}}
    fig = memory_figure(results)
    assert len(fig.axes) >= 2


def test_the_loss_components_are_memory_pys_per_cp_rank_and_under_flash_attns_loss() -> None:
    """The head's and the loss gradient's allocations are memory.py's loss tensors: under
    context parallelism a rank's chunk of the sequence (it held the whole sequence's fp32
    logits on every CP rank), under flash-attn's fused loss the 16-bit logits with a
    per-token log-sum-exp and a 16-bit gradient (it held fp32 ones)."""
    from simulator.model.memory import loss_tensors

    cp = scenario_from_dict({**make(dp=2).to_dict(),
                             "cluster": {"system": "dgx-a100-80gb", "nodes": 1,
                                         "gpus_per_node": 4},
                             "parallel": {"dp": 2, "cp": 2}})
    flash = scenario_from_dict({**make(dp=2).to_dict(), "stack": {"preset": "composer-fsdp1"}})
    assert flash.stack.loss == "flash"
    for s in (cp, flash):
        saved, gradients = loss_tensors(s)
        tok = sizes(s)["tok"]
        got = component_bytes(s)
        assert (got["head"], got["dlogits"]) == (4 * tok + saved, gradients)
    assert component_bytes(cp)["dlogits"] == sizes(cp)["dlogits"] / 2
