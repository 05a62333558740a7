"""Context parallelism: the sequence split over cp ranks, and the key/value exchange.

Oracles: a rank computes on s/cp tokens, its attention core against all s keys
(1/cp of the sequence's attention FLOPs); the ring moves each rank's KV chunk
around the CP group ((cp − 1) chunks in, per layer and forward, twice that in
backward), the all-gather variant gathers cp chunks before the core and
reduce-scatters their gradients after it; gradients reduce over dp · cp ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload, local_scenario
from simulator.cli.main import main
from simulator.model import transformer as mdl
from simulator.model.inventory.attention import context_parallel_ops
from simulator.model.inventory.ops import Op
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.system.layout import Layout

MODEL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "vocab": 1024, "seq_len": 4096,
         "activation": "swiglu", "norm": "rmsnorm", "bias": False, "position": "rope",
         "tied_embeddings": False}
REL = 1e-9


def make(*, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, m: int = 2, gpn: int = 8,
         cluster: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
         **parallel: Any) -> Scenario:
    world = tp * cp * pp * dp
    gpn = min(world, gpn)
    return scenario_from_dict({
        "name": "cp", "model": model or MODEL,
        "cluster": {"system": "dgx-h100", "nodes": world // gpn, "gpus_per_node": gpn,
                    **(cluster or {})},
        "parallel": {"tp": tp, "cp": cp, "pp": pp, "dp": dp, **parallel},
        "training": {"global_batch": m * dp, "micro_batch": 1},
    })


def test_layout_puts_cp_between_tp_and_dp() -> None:
    """Megatron's order tp-cp-dp-pp: CP peers tp apart, DP peers tp·cp apart; the
    gradient group is every rank of the stage with the same TP index."""
    lay = Layout(tp=2, pp=2, dp=2, gpus_per_node=8, cp=2)
    assert lay.world == 16 and lay.per_stage == 8
    assert lay.cp_group(0) == (0, 2) and lay.tp_group(2) == (2, 3)
    assert lay.dp_group(1) == (1, 3, 5, 7)
    c = lay.coord(13)
    assert (c.pp, c.dp, c.cp, c.tp) == (1, 1, 0, 1)
    assert lay.rank(c.pp, c.dp, c.tp, c.cp) == 13


def test_attention_core_against_the_whole_sequence() -> None:
    s = make(cp=4, dp=1)
    local = local_scenario(s).model
    assert local.seq_len == 1024
    full = mdl.layer_ops(s.model, 1, 1, False, "bf16", "fwd")
    part = context_parallel_ops(mdl.layer_ops(local, 1, 1, False, "bf16", "fwd"), local,
                                    1, 1, "bf16", "fwd", 4)
    core = {op.name: op for op in full}["attn_core"]
    mine = {op.name: op for op in part}["attn_core"]
    assert mine.flops == pytest.approx(core.flops / 4, rel=REL)
    qkv = {op.name: op for op in full}["qkv"]
    assert {op.name: op for op in part}["qkv"].flops == pytest.approx(qkv.flops / 4, rel=REL)


def _kv_bytes(cp: int, tp: int) -> float:
    """One rank's K and V chunk of one layer: 2 · s/cp · (kv heads / tp) · head dim · 2 B."""
    head_dim = MODEL["hidden"] // MODEL["heads"]
    return 2 * MODEL["seq_len"] / cp * max(MODEL["kv_heads"] / tp, 1) * head_dim * 2


@pytest.mark.parametrize("kind", ["p2p", "allgather"])
@pytest.mark.parametrize(("tp", "cp"), [(1, 2), (2, 4)])
def test_cp_traffic_per_layer_is_the_hand_calculation(kind: str, tp: int, cp: int) -> None:
    s = make(tp=tp, cp=cp, cp_comm_type=kind, recompute="none")
    w = build_workload(s, fidelity="folded")
    rank0 = [t for t in w.tasks if t.rank == 0 and t.kind == "cp" and t.layer == 0
             and t.microbatch == 0]
    gathered = cp * _kv_bytes(cp, tp)
    if kind == "p2p":  # forward: the KV chunks around; backward: again, and their gradients
        assert [(t.op, t.nbytes) for t in rank0] == [("cp.all_gather", gathered),
                                                     ("cp.all_gather", 2 * gathered)]
        assert all(t.stream == "cp" for t in rank0)
    else:  # forward gather; backward gather again, reduce-scatter the gradients
        assert [(t.op, t.nbytes) for t in rank0] == [
            ("cp.all_gather", gathered), ("cp.all_gather", gathered),
            ("cp.reduce_scatter", gathered)]
        assert all(t.stream == "compute" for t in rank0)
    for t in rank0:  # the ring moves (cp − 1) chunks per rank: (cp − 1)/cp of the size
        assert t.plan is not None and t.group == w.layout.cp_group(0)


@pytest.mark.parametrize("kind", ["p2p", "allgather"])
@pytest.mark.parametrize("par", [
    {"tp": 2, "cp": 2, "pp": 2, "dp": 2},
    {"tp": 1, "cp": 4, "pp": 1, "dp": 2, "zero": 3},
    {"tp": 2, "cp": 2, "pp": 2, "dp": 1, "recompute": "full", "sequence_parallel": True},
    {"tp": 1, "cp": 2, "pp": 4, "dp": 2, "schedule": "interleaved", "virtual_stages": 2},
])
def test_cp_folded_equals_full(kind: str, par: dict[str, Any]) -> None:
    m = 4 if par.get("schedule") == "interleaved" else 2
    s = make(m=m, cp_comm_type=kind, model={**MODEL, "layers": 8}, **par)
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, _ = simulate_scenario(s, "engine", "full")
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=REL)
    for c, v in full["step_breakdown_s"].items():
        assert folded["step_breakdown_s"][c] == pytest.approx(v, rel=REL, abs=1e-15)
    assert full["step_breakdown_s"]["cp_transfer"] + full["step_breakdown_s"]["cp_wait"] >= 0


def test_cp_gradients_reduce_over_dp_times_cp() -> None:
    s = make(cp=2, dp=2)
    w = build_workload(s, fidelity="full")
    groups = {t.group for t in w.tasks if t.kind == "dp" and t.plan is not None}
    assert groups == {(0, 1, 2, 3)}


LONG = {"model": {"preset": "llama2-7b", "seq_len": 32768},
        "cluster": {"system": "dgx-h100", "nodes": 2, "gpus_per_node": 8},
        "training": {"global_batch": 8, "micro_batch": 1}}


def exposed_cp_at_32k(kind: str, **parallel: Any) -> float:
    """Llama 2 7B at 32K tokens, TP 4 · CP 4 over 2 nodes, with ``cp_comm_type`` ``kind``:
    the engine's exposed CP seconds (transfer and wait), after checking that the analytic
    estimate is within 10% of the engine's step."""
    s = scenario_from_dict({**LONG, "name": kind,
                            "parallel": {"tp": 4, "cp": 4, "dp": 1, "pp": 1,
                                         "cp_comm_type": kind, **parallel}})
    engine, _ = simulate_scenario(s, "engine")
    analytic, _ = simulate_scenario(s, "analytic")
    assert analytic["step_time_s"] == pytest.approx(engine["step_time_s"], rel=0.10)
    mean = engine["step_breakdown_s"]
    return float(mean["cp_transfer"] + mean["cp_wait"])


def test_ring_hides_behind_long_attention_and_analytic_agrees() -> None:
    """At 32K tokens the attention block is long: the ring is mostly hidden, the
    all-gather is not; engine and analytic agree within 10%."""
    assert 0 <= exposed_cp_at_32k("p2p") < exposed_cp_at_32k("allgather")


@pytest.mark.parametrize(("extra", "needle"), [
    ({"cp_comm_type": "a2a"}, "parallel.cp_comm_type"),  # 1 kv head a TP rank over cp 2
])
def test_bad_cp_input_is_one_line(extra: dict[str, Any], needle: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({
        "name": "bad", "model": MODEL, "cluster": {"system": "dgx-h100", "nodes": 1},
        "parallel": {"tp": 2, "cp": 2, "dp": 2, **extra}, "training": {"global_batch": 2}}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_cp_with_experts_is_refused_by_run(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({
        "name": "moe-cp", "model": {**MODEL, "experts": 4, "experts_per_token": 2},
        "cluster": {"system": "dgx-h100", "nodes": 1},
        "parallel": {"cp": 2, "dp": 4}, "training": {"global_batch": 4}}))
    assert main(["run", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "parallel.cp = 2: not yet simulated" in capsys.readouterr().err


def test_cp_without_dp_still_reduces_gradients_over_cp() -> None:
    """dp = 1, cp = 2: the two CP ranks hold the same weights, so their gradients are
    all-reduced (and ZeRO shards over them)."""
    w = build_workload(make(cp=2, dp=1), fidelity="full")
    assert {t.group for t in w.tasks if t.kind == "dp" and t.plan is not None} == {(0, 1)}
    z = build_workload(make(cp=2, dp=1, zero=3), fidelity="full")
    assert any(t.kind == "zero" for t in z.tasks)


def test_allgather_reorders_the_gathered_kv_in_the_attention_block() -> None:
    """The all-gather variant puts the gathered K and V in sequence order before the
    core (and their gradients back after it in backward): one read and one write of
    the gathered bytes each, in the attention block; the ring does not."""
    from simulator.builder.workload import block_costs
    from simulator.system.costs import CostModel

    ring, gathered = make(tp=2, cp=4), make(tp=2, cp=4, cp_comm_type="allgather")
    cost = CostModel(ring.hardware, "bf16")
    a, b = block_costs(ring, cost), block_costs(gathered, cost)
    nbytes = 2 * 4 * _kv_bytes(4, 2)
    fwd = cost.ops_time([Op("cp_reorder", "memory", 0.0, nbytes, 0.0)])
    bwd = cost.ops_time([Op("cp_reorder", "memory", 0.0, 2 * nbytes, 0.0)])
    assert b.fwd[0] - a.fwd[0] == pytest.approx(fwd, rel=1e-9)
    assert b.bwd_input[0] - a.bwd_input[0] == pytest.approx(bwd, rel=1e-9)
    assert b.fwd[1] == a.fwd[1] and b.bwd_weight == a.bwd_weight


def _saved(**kw: Any) -> Scenario:
    """The all-gather variant under a stack that keeps the gathered keys and values."""
    s = make(cp_comm_type="allgather", **kw)
    return s.model_copy(update={"stack": s.stack.model_copy(update={"cp_kv_backward": "saved"})})


def test_a_stack_that_keeps_the_gathered_kv_does_not_gather_them_again() -> None:
    """``cp_kv_backward: saved`` (an autograd all-gather whose output attention saves, as
    the measured CP worker runs it): per layer and micro-batch one all-gather forward and
    the gradients' reduce-scatter backward; Transformer Engine's regather has two."""
    s = _saved(tp=2, cp=4, recompute="none")
    assert s.cp_keeps_gathered_kv and not make(cp=4, cp_comm_type="allgather").cp_keeps_gathered_kv
    w = build_workload(s, fidelity="folded")
    rank0 = [t for t in w.tasks if t.rank == 0 and t.kind == "cp" and t.layer == 0
             and t.microbatch == 0]
    gathered = 4 * _kv_bytes(4, 2)
    assert [(t.op, t.nbytes) for t in rank0] == [("cp.all_gather", gathered),
                                                 ("cp.reduce_scatter", gathered)]
    # full recomputation drops the gathered ones: the recomputed forward gathers again
    r = build_workload(_saved(tp=2, cp=4, recompute="full"), fidelity="folded")
    assert [t.op for t in r.tasks if t.rank == 0 and t.kind == "cp" and t.layer == 0
            and t.microbatch == 0] == ["cp.all_gather", "cp.all_gather", "cp.reduce_scatter"]


def test_kept_gathered_kv_costs_its_memory_and_one_backward_reorder() -> None:
    """Memory: cp − 1 more key/value chunks per layer (none under full recomputation);
    compute: the backward reorders only the gradients (one copy of the gathered bytes,
    not two); the analytic estimate drops one all-gather per layer and micro-batch."""
    from simulator.builder.workload import block_costs
    from simulator.model.memory import activation_bytes_per_layer
    from simulator.system.costs import CostModel

    regather, saved = make(tp=2, cp=4, cp_comm_type="allgather"), _saved(tp=2, cp=4)
    spec = saved.model
    base = activation_bytes_per_layer(spec, 1, 2, False, "none", "bf16", 0, 4, saved.stack)
    kept = activation_bytes_per_layer(spec, 1, 2, False, "none", "bf16", 0, 4, saved.stack, True)
    assert kept - base == pytest.approx(3 * _kv_bytes(4, 2), rel=REL)
    assert activation_bytes_per_layer(spec, 1, 2, False, "full", "bf16", 0, 4, saved.stack,
                                      True) == activation_bytes_per_layer(
        spec, 1, 2, False, "full", "bf16", 0, 4, saved.stack)
    cost = CostModel(saved.hardware, "bf16")
    a, b = block_costs(regather, cost), block_costs(saved, cost)
    nbytes = 2 * 4 * _kv_bytes(4, 2)  # one read and one write of the gathered K and V
    one, two = (cost.ops_time([Op("cp_reorder", "memory", 0.0, k * nbytes, 0.0)])
                for k in (1, 2))
    assert a.bwd_input[0] - b.bwd_input[0] == pytest.approx(two - one, rel=1e-9)
    assert b.fwd == a.fwd
    re_a, _ = simulate_scenario(regather, "analytic")
    re_b, _ = simulate_scenario(saved, "analytic")
    assert re_b["step_time_s"] < re_a["step_time_s"]
    for s in (regather, saved):  # engine and analytic agree on both
        e, _ = simulate_scenario(s, "engine")
        an, _ = simulate_scenario(s, "analytic")
        assert an["step_time_s"] == pytest.approx(e["step_time_s"], rel=0.10)
