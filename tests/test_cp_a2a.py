"""Context parallelism by all-to-all (DeepSpeed-Ulysses) and its hierarchical variant.

Oracles from Transformer Engine's layout (``transformer_engine/pytorch/attention/
dot_product_attention/context_parallel.py``, ``AttnFuncWithCPAndQKVOA2A`` and
``flash_attn_a2a_communicate``): each of Q, K, V is one all-to-all of the rank's
``[b, s/cp, h/tp, d]`` chunk into ``[b, s, h/(tp·cp), d]`` before the core, the output
one back after it; backward dO in, dQ, dK, dV out, all blocking. The core then runs the
whole sequence for 1/cp of the heads: the same FLOPs as the ring's, in one kernel call
at sequence length s. a2a+p2p (``AttnFuncWithCPAndKVP2P`` with two groups) is the
all-to-all within cp_a2a consecutive CP ranks and the ring over the others: with
cp_a2a 1 it is p2p exactly, with cp_a2a = cp a2a exactly, as TE falls back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_context_parallel import exposed_cp_at_32k

from simulator.api import simulate_scenario
from simulator.builder.workload import block_costs, build_workload, local_scenario
from simulator.cli.main import main
from simulator.errors import ScenarioError
from simulator.imports.megatron import classify
from simulator.model import transformer as mdl
from simulator.model.inventory.attention import context_parallel_ops
from simulator.model.memory import activation_bytes_per_layer
from simulator.spec.load import load_scenario, scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.system.costs import CostModel
from simulator.system.layout import Layout

MODEL = {"layers": 4, "hidden": 512, "heads": 16, "kv_heads": 8, "vocab": 1024, "seq_len": 4096,
         "activation": "swiglu", "norm": "rmsnorm", "bias": False, "position": "rope",
         "tied_embeddings": False}
HEAD_DIM = MODEL["hidden"] // MODEL["heads"]
REL = 1e-9


def make(*, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, m: int = 2, gpn: int = 8,
         model: dict[str, Any] | None = None, **parallel: Any) -> Scenario:
    world = tp * cp * pp * dp
    gpn = min(world, gpn)
    return scenario_from_dict({
        "name": "a2a", "model": model or MODEL,
        "cluster": {"system": "dgx-h100", "nodes": world // gpn, "gpus_per_node": gpn},
        "parallel": {"tp": tp, "cp": cp, "pp": pp, "dp": dp, **parallel},
        "training": {"global_batch": m * dp, "micro_batch": 1},
    })


def _q(cp: int, tp: int) -> float:
    """One rank's query (or output) chunk: s/cp tokens · heads/tp · head dim · 2 B."""
    return MODEL["seq_len"] / cp * MODEL["heads"] / tp * HEAD_DIM * 2


def _k(cp: int, tp: int) -> float:
    """One rank's key (or value) chunk: s/cp tokens · kv heads/tp · head dim · 2 B."""
    return MODEL["seq_len"] / cp * MODEL["kv_heads"] / tp * HEAD_DIM * 2


def _cp_tasks(s: Scenario, rank: int = 0) -> list[Any]:
    w = build_workload(s, fidelity="full")
    return [t for t in w.tasks if t.rank == rank and t.kind == "cp" and t.layer == 0
            and t.microbatch == 0]


@pytest.mark.parametrize(("tp", "cp"), [(1, 2), (2, 4), (1, 4)])
def test_a2a_moves_q_k_v_o_chunks_as_transformer_engine_lays_them_out(tp: int, cp: int) -> None:
    s = make(tp=tp, cp=cp, cp_comm_type="a2a", recompute="none")
    tasks = _cp_tasks(s)
    q, k = _q(cp, tp), _k(cp, tp)
    assert [(t.name.split()[1], t.nbytes) for t in tasks] == [
        ("q", q), ("k", k), ("v", k), ("o", q),  # forward
        ("do", q), ("dq", q), ("dk", k), ("dv", k)]  # backward
    lay = build_workload(s, fidelity="folded").layout
    assert all(t.op == "cp.all_to_all" and t.stream == "compute"
               and t.group == lay.cp_group(0) for t in tasks)


def test_hierarchical_a2a_inside_groups_and_ring_across() -> None:
    """cp 4 as 2 × 2: the all-to-alls over CP ranks {0, 1}, the ring over {0, 2} (its
    chunk twice as long, its heads half), overlapped on the cp stream."""
    s = make(tp=2, cp=4, cp_comm_type="a2a+p2p", cp_a2a=2, recompute="none")
    tasks = _cp_tasks(s)
    q, k = _q(4, 2), _k(4, 2)
    ring = 2 * (2 * k)  # the ring's two ranks' K and V: each rank's K and V of s/cp tokens
    assert [(t.op, t.nbytes, t.stream) for t in tasks] == [
        *[("cp.all_to_all", n, "compute") for n in (q, k, k)],
        ("cp.all_gather", ring, "cp"), ("cp.all_to_all", q, "compute"),
        ("cp.all_to_all", q, "compute"),
        ("cp.all_gather", 2 * ring, "cp"), *[("cp.all_to_all", n, "compute") for n in (q, k, k)]]
    cp_ranks = (0, 2, 4, 6)  # tp 2: CP peers two apart
    assert {t.group for t in tasks if t.op == "cp.all_to_all"} == {cp_ranks[:2]}
    assert {t.group for t in tasks if t.op == "cp.all_gather"} == {cp_ranks[::2]}


@given(cp_exp=st.integers(1, 4), a_exp=st.integers(0, 4), tp=st.sampled_from([1, 2, 4]),
       rank=st.integers(0, 1023), by=st.integers(0, 15))
def test_hierarchical_groups_tile_the_cp_group(cp_exp: int, a_exp: int, tp: int,
                                               rank: int, by: int) -> None:
    """Every CP rank is in one all-to-all group and one ring, which meet in it alone,
    a2a · ring = cp; and cp_shift (what shared programs move a prototype by) maps
    every all-to-all group and every ring onto one."""
    cp, a = 2 ** cp_exp, 2 ** min(a_exp, cp_exp)
    lay = Layout(tp=tp, pp=1, dp=2, gpus_per_node=8, cp=cp, cp_a2a=a)
    r = rank % lay.world
    inner, ring = lay.cp_a2a_group(r), lay.cp_ring_group(r)
    assert set(inner) & set(ring) == {r} and len(inner) * len(ring) == cp
    assert set(inner) | set(ring) <= set(lay.cp_group(r))
    c = lay.coord(r)

    def moved(group: tuple[int, ...]) -> set[int]:
        return {lay.rank(c.pp, c.dp, c.tp, lay.cp_shift(lay.coord(x).cp, by % cp))
                for x in group}

    image = lay.rank(c.pp, c.dp, c.tp, lay.cp_shift(c.cp, by % cp))
    assert moved(inner) == set(lay.cp_a2a_group(image))
    assert moved(ring) == set(lay.cp_ring_group(image))


def test_a2a_core_runs_the_whole_sequence_for_its_share_of_heads() -> None:
    """The kernel sees s (a2a), s · cp_a2a / cp (a2a+p2p) or s / cp (the ring's chunk);
    the FLOPs are the same in all three: 1/cp of the sequence's attention."""
    cores = {}
    for kind, a2a in (("p2p", 1), ("a2a", 4), ("a2a+p2p", 2)):
        s = make(cp=4)
        local = local_scenario(s).model
        for p in ("fwd", "bwd_input"):
            ops = context_parallel_ops(mdl.layer_ops(local, 1, 1, False, "bf16", p), local, 1,
                                       1, "bf16", p, 4, a2a=a2a)
            cores[kind, p] = {op.name: op for op in ops}["attn_core"]
    full = {op.name: op for op in mdl.layer_ops(make().model, 1, 1, False, "bf16", "fwd")}
    for p in ("fwd", "bwd_input"):
        assert cores["a2a", p].flops == pytest.approx(cores["p2p", p].flops, rel=REL)
        assert cores["a2a+p2p", p].flops == pytest.approx(cores["p2p", p].flops, rel=REL)
    assert cores["p2p", "fwd"].flops == pytest.approx(full["attn_core"].flops / 4, rel=REL)
    seq = MODEL["seq_len"]
    assert cores["a2a", "fwd"].attn.seq_len == seq  # type: ignore[union-attr]
    assert cores["a2a+p2p", "fwd"].attn.seq_len == seq // 2  # type: ignore[union-attr]
    assert cores["p2p", "fwd"].attn.seq_len == seq // 4  # type: ignore[union-attr]
    # one call over the whole sequence (a2a), two ring steps (a2a+p2p), four (p2p)
    assert [cores[k, "fwd"].kernels for k in ("a2a", "a2a+p2p", "p2p")] == [1, 2, 4]
    assert cores["a2a", "fwd"].gemm_flops == cores["a2a", "fwd"].flops


def test_a2a_copies_each_exchanged_tensor_twice_in_the_attention_block() -> None:
    """Around each all-to-all TE copies the tensor to contiguous and reorders its
    sequence chunks (``movedim(...).contiguous()``, ``index_select``): four tensors,
    two copies each of one read and one write, per pass."""
    s = make(tp=2, cp=4, cp_comm_type="a2a")
    local = local_scenario(s).model
    ops = {op.name: op for op in context_parallel_ops(
        mdl.layer_ops(local, 1, 2, False, "bf16", "fwd"), local, 1, 2, "bf16", "fwd", 4,
        a2a=4)}
    assert ops["cp_reorder"].bytes == pytest.approx(4 * (2 * _q(4, 2) + 2 * _k(4, 2)), rel=REL)
    assert ops["cp_reorder"].kernels == 8


@settings(max_examples=30, deadline=None)
@given(cp=st.sampled_from([2, 4, 8]), tp=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 4]), seq=st.sampled_from([8192, 16384]))
def test_a2a_moves_a_cp_th_of_the_rings_bytes_per_rank(cp: int, tp: int, group: int,
                                                       seq: int) -> None:
    """Bytes a rank sends per forward: the ring (cp − 1) K, V chunks, constant in cp;
    the all-to-alls (cp − 1)/cp of its Q, K, V, O chunks, which shrink as 1/cp. So
    a2a / ring · cp is (heads / kv heads + 1), whatever cp, tp and the sequence."""
    kv = 16 // group
    if kv // tp % cp:
        return  # the all-to-all cannot split these heads (a rule, tested below)
    model = {**MODEL, "kv_heads": kv, "seq_len": seq}
    sent = {}
    for kind in ("p2p", "a2a"):
        s = make(tp=tp, cp=cp, cp_comm_type=kind, recompute="none", model=model)
        fwd = [t for t in _cp_tasks(s) if "kv+dkv" not in t.name and t.name.split()[1]
               in ("q", "k", "v", "o", "kv")]
        sent[kind] = sum((cp - 1) / cp * t.nbytes for t in fwd)
    assert sent["a2a"] * cp / sent["p2p"] == pytest.approx(16 / kv + 1, rel=1e-12)


@pytest.mark.parametrize(("kind", "same"), [("p2p", 1), ("a2a", 4)])
def test_hierarchical_with_one_level_of_one_is_the_other_variant(kind: str, same: int) -> None:
    """TE's own fallback: a2a+p2p with an all-to-all of one is p2p, with a ring of one
    a2a; the simulated steps are the same to the last bit."""
    mine, _ = simulate_scenario(make(cp=4, cp_comm_type="a2a+p2p", cp_a2a=same), "engine")
    theirs, _ = simulate_scenario(make(cp=4, cp_comm_type=kind), "engine")
    assert mine["step_time_s"] == theirs["step_time_s"]


@pytest.mark.parametrize(("kind", "extra"), [("a2a", {}), ("a2a+p2p", {"cp_a2a": 2})])
@pytest.mark.parametrize("par", [
    {"tp": 2, "cp": 2, "pp": 2, "dp": 2},
    {"tp": 1, "cp": 4, "pp": 1, "dp": 2, "zero": 3},
    {"tp": 2, "cp": 4, "pp": 2, "dp": 1, "recompute": "full", "sequence_parallel": True},
    {"tp": 1, "cp": 4, "pp": 2, "dp": 2, "schedule": "interleaved", "virtual_stages": 2},
])
def test_a2a_folded_equals_full(kind: str, extra: dict[str, Any], par: dict[str, Any]) -> None:
    if kind == "a2a+p2p" and par["cp"] == 2:
        extra = {"cp_a2a": 2}  # a ring of one: still a valid split
    m = 4 if par.get("schedule") == "interleaved" else 2
    s = make(m=m, cp_comm_type=kind, model={**MODEL, "layers": 8}, **par, **extra)
    folded, _ = simulate_scenario(s, "engine", "folded")
    full, _ = simulate_scenario(s, "engine", "full")
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=REL)
    for c, v in full["step_breakdown_s"].items():
        assert folded["step_breakdown_s"][c] == pytest.approx(v, rel=REL, abs=1e-15)


def test_a2a_engine_and_analytic_agree_at_32k() -> None:
    """Llama 2 7B at 32K tokens, tp 4 · cp 4 over two nodes: the all-to-alls are blocking,
    so a2a exposes more than the ring, which its long attention block hides; engine
    and analytic agree within 10% on each variant, as for p2p and all-gather."""
    out = {kind: exposed_cp_at_32k(kind, **extra)
           for kind, extra in (("p2p", {}), ("a2a", {}), ("a2a+p2p", {"cp_a2a": 2}))}
    assert 0 <= out["p2p"] < out["a2a"]


def test_a2a_keeps_the_attention_output_before_its_all_to_all() -> None:
    """TE saves ``out_part`` (the head-split output) and returns the exchanged copy, which
    the next linear keeps: one output chunk more per layer, unless the core is
    recomputed (selective or full)."""
    s = make(tp=2, cp=4)
    spec = s.model
    for mode in ("none", "selective", "full"):
        base = activation_bytes_per_layer(spec, 1, 2, False, mode, "bf16", 0, 4, s.stack)
        a2a = activation_bytes_per_layer(spec, 1, 2, False, mode, "bf16", 0, 4, s.stack,
                                         cp_a2a=True)
        assert a2a - base == pytest.approx(_q(4, 2) if mode == "none" else 0.0, rel=REL)
    cost = CostModel(s.hardware, "bf16")
    ring, a2a_costs = block_costs(s, cost), block_costs(make(tp=2, cp=4, cp_comm_type="a2a"),
                                                         cost)
    assert a2a_costs.fwd[1] == ring.fwd[1] and a2a_costs.bwd_weight == ring.bwd_weight


@pytest.mark.parametrize(("extra", "field"), [
    ({"tp": 4, "cp": 4, "cp_comm_type": "a2a"}, "parallel.cp_comm_type"),  # 2 kv heads / 4
    ({"tp": 2, "cp": 8, "cp_comm_type": "a2a"}, "parallel.cp_comm_type"),  # 4 kv heads / 8
    ({"tp": 2, "cp": 8, "cp_comm_type": "a2a+p2p", "cp_a2a": 8}, "parallel.cp_a2a"),
    ({"tp": 1, "cp": 4, "cp_comm_type": "a2a+p2p"}, "parallel.cp_a2a"),  # no degree
    ({"tp": 1, "cp": 4, "cp_comm_type": "a2a+p2p", "cp_a2a": 3}, "parallel.cp_a2a"),
    ({"tp": 1, "cp": 4, "cp_a2a": 2}, "parallel.cp_a2a"),  # p2p has no all-to-all
])
def test_bad_a2a_input_is_one_line(extra: dict[str, Any], field: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    world = extra["tp"] * extra["cp"]
    path.write_text(json.dumps({
        "name": "bad", "model": MODEL,
        "cluster": {"system": "dgx-h100", "nodes": max(world // 8, 1),
                    "gpus_per_node": min(world, 8)},
        "parallel": {"dp": 1, **extra}, "training": {"global_batch": 2}}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{field} = " in err[0], err


def test_hierarchical_a2a_valid_where_a2a_alone_is_not() -> None:
    """tp 2 · cp 8 over 8 kv heads (4 a TP rank): a2a cannot split them eightfold,
    a2a+p2p with an all-to-all of 4 (Megatron-LM's --hierarchical-context-parallel-sizes
    4 2) can."""
    make(tp=2, cp=8, cp_comm_type="a2a+p2p", cp_a2a=4)
    with pytest.raises(ScenarioError, match=r"parallel\.cp_comm_type = "):
        make(tp=2, cp=8, cp_comm_type="a2a")


BASE = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--seq-length", "2048", "--micro-batch-size", "1", "--vocab-size", "50257",
        "--context-parallel-size", "4"]


@pytest.mark.parametrize(("extra", "kind", "a2a"), [
    (["--cp-comm-type", "a2a"], "a2a", None),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
     "a2a+p2p", 2),
    (["--cp-comm-type", "all_gather"], "allgather", None),
])
def test_megatron_cp_comm_types_import(tmp_path: Path, extra: list[str], kind: str,
                                       a2a: int | None) -> None:
    out = tmp_path / "imported.yaml"
    assert main(["import", "megatron", "--gpus", "8", "--out", str(out), "--",
                 *BASE, *extra]) == 0
    par = load_scenario(out).parallel
    assert (par.cp, par.cp_comm_type, par.cp_a2a) == (4, kind, a2a)
    assert classify("--hierarchical-context-parallel-sizes") == ("mapped", "")


@pytest.mark.parametrize("sizes", [[], ["4"], ["2", "x"], ["2", "4"], ["2", "2", "1"]])
def test_megatron_a2a_p2p_without_two_sizes_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], sizes: list[str]) -> None:
    out = tmp_path / "imported.yaml"
    hier = ["--hierarchical-context-parallel-sizes", *sizes] if sizes else []
    rc = main(["import", "megatron", "--gpus", "8", "--out", str(out), "--", *BASE,
               "--cp-comm-type", "a2a+p2p", *hier])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--hierarchical-context-parallel-sizes" in err[0], err
