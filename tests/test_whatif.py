"""--what-if: per-class speed factors and the step's sensitivity to each cost class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simulator.analysis.accounting.vocabulary import COMPUTE_CATEGORIES
from simulator.analysis.whatif import SPEEDUP, cost_classes, step_time_with, what_if, what_if_lines
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.model.inventory.ops import Op
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.system.collectives.choice import make_plan
from simulator.system.collectives.cost import estimate
from simulator.system.collectives.plan import GroupShape
from simulator.system.costs import COMPUTE_CLASSES, CostModel
from simulator.system.layout import Layout
from simulator.system.link_specs import AlphaBeta
from simulator.system.topology import Topology

SAVED = 1 - 1 / SPEEDUP  # what a 10% faster step saves when all of it scales
FREE = {"intra_node_bandwidth_GBps": 1e12, "inter_node_bandwidth_GBps": 1e12,
        "link_latency_us": 0}
GEMM = Op("g", "gemm", 1e12, 1e6, 1e12)
ATTN = Op("a", "attention", 1e11, 1e6, 1e11)
MEM = Op("m", "memory", 0.0, 1e9, 0.0)


def scenario(*, tp: int = 1, pp: int = 1, dp: int = 1, gpn: int = 8, m: int = 8,
             cluster: dict[str, Any] | None = None) -> Scenario:
    world = tp * pp * dp
    gpn = min(gpn, world)
    return scenario_from_dict({
        "name": "what-if", "model": {"preset": "tiny-gpt", "layers": max(4, pp)},
        "cluster": {"system": "dgx-a100-80gb", "nodes": world // gpn, "gpus_per_node": gpn,
                    **(cluster or {})},
        "parallel": {"tp": tp, "pp": pp, "dp": dp},
        "training": {"global_batch": m * dp, "micro_batch": 1},
        # no host cost per kernel: a tiny model would be launch-bound, not what these test
        "stack": {"host_overhead_us": 0.0}})


def sensitivities(s: Scenario, method: str, fidelity: str = "folded") -> dict[str, Any]:
    results, _ = simulate_scenario(s, method, fidelity)
    return what_if(s, results["step_time_s"], method, fidelity)


# ------------------------------------------------------------------ the hooks


def test_speed_divides_only_its_class() -> None:
    hw = scenario().hardware
    base = CostModel(hw, "bf16")
    for cls in COMPUTE_CLASSES:
        fast = CostModel(hw, "bf16", {cls: SPEEDUP})
        for op in (GEMM, ATTN, MEM):
            want = base.op_time(op) / (SPEEDUP if op.kind == cls else 1.0)
            assert fast.op_time(op) == pytest.approx(want, rel=1e-12)
        want_mem = base.memory_time(1e9) / (SPEEDUP if cls == "memory" else 1.0)
        assert fast.memory_time(1e9) == pytest.approx(want_mem, rel=1e-12)
    with pytest.raises(ValueError, match="classes are"):
        CostModel(hw, "bf16", {"gemms": 2.0})
    with pytest.raises(ValueError, match="factors > 0"):
        CostModel(hw, "bf16", {"gemm": 0.0})


@pytest.mark.parametrize("link", ["intra_node", "inter_node"])
def test_faster_link_divides_a_transfer_by_the_factor(link: str) -> None:
    hw = scenario().hardware
    hw = hw.model_copy(update={"collectives": {"all_gather": {
        "intra_node": AlphaBeta(alpha_us=7.0, busbw_GBps=90.0)}}})
    fast = hw.with_faster_link(link, SPEEDUP)  # type: ignore[arg-type]
    shape = GroupShape(8, 8 if link == "intra_node" else 1)
    for op in ("send_recv", "all_reduce", "all_gather"):
        plan = make_plan(op, 64e6, shape, "ring", hw)  # type: ignore[arg-type]
        assert estimate(plan, fast) == pytest.approx(estimate(plan, hw) / SPEEDUP, rel=1e-12)
    other = "inter_node" if link == "intra_node" else "intra_node"
    assert fast.link(other) == hw.link(other)  # type: ignore[arg-type]


def test_core_is_its_own_class() -> None:
    flat = scenario(tp=1, dp=16, gpn=8).hardware
    assert "core" not in flat.link_classes
    hw = scenario(dp=16, cluster={"oversubscription": 2.0}).hardware
    assert hw.link_classes == ("intra_node", "inter_node", "core")
    layout = Layout(1, 1, 16, 8)
    base = Topology(layout, hw)
    nic = Topology(layout, hw.with_faster_link("inter_node", SPEEDUP))
    core = Topology(layout, hw.with_faster_link("core", SPEEDUP))
    assert nic.inter_rate == pytest.approx(base.inter_rate * SPEEDUP)
    assert nic.core_rate == pytest.approx(base.core_rate)  # a faster NIC leaves the core
    assert core.core_rate == pytest.approx(base.core_rate * SPEEDUP)
    assert core.inter_rate == base.inter_rate


# ------------------------------------------------------------------ sensitivities


@pytest.mark.parametrize("method", ["engine", "analytic"])
def test_compute_only_step_saves_exactly_the_speedup(method: str) -> None:
    """One GPU, no communication: the compute classes partition the step."""
    entry = sensitivities(scenario(), method)
    classes = entry["classes"]
    assert set(classes) == {*COMPUTE_CLASSES, "intra_node", "inter_node"}
    assert sum(classes[c]["sensitivity"] for c in COMPUTE_CLASSES) == pytest.approx(SAVED,
                                                                                    rel=1e-9)
    for c in COMPUTE_CLASSES:
        assert classes[c]["sensitivity"] > 0
    for link in ("intra_node", "inter_node"):
        assert classes[link]["sensitivity"] == 0.0
        assert classes[link]["step_time_s"] == entry["step_time_s"]


@pytest.mark.parametrize("fidelity", ["folded", "full"])
def test_free_communication_leaves_links_insensitive(fidelity: str) -> None:
    """Free links: nothing to gain from faster ones; the step is compute and pipeline
    idle that scales with it, so the compute classes save about 1 − 1/1.1 together."""
    s = scenario(tp=2, pp=2, dp=2, gpn=4, cluster=FREE)
    entry = sensitivities(s, "engine", fidelity)
    classes = entry["classes"]
    for link in ("intra_node", "inter_node"):
        assert abs(classes[link]["sensitivity"]) < 1e-6
    compute = sum(classes[c]["sensitivity"] for c in COMPUTE_CLASSES)
    assert compute == pytest.approx(SAVED, rel=1e-6)


@pytest.mark.parametrize("kw", [{"tp": 2, "pp": 2, "dp": 2, "gpn": 2},
                                {"pp": 4, "dp": 2, "gpn": 2, "m": 16},
                                {"tp": 2, "pp": 2, "dp": 4, "gpn": 4,
                                 "cluster": {"oversubscription": 3.0}}])
def test_compute_sensitivity_is_the_critical_paths_compute_share(kw: dict[str, Any]) -> None:
    """A small speed-up of every compute class shortens the step by what it saves on
    the critical path: the compute sensitivities sum to (1 − 1/1.1) × the path's
    compute share, and the links take the communication on it."""
    s = scenario(**kw)
    results, _ = simulate_scenario(s, "engine")
    path, step = results["critical_path_s"], results["step_time_s"]
    compute_share = sum(path[c] for c in COMPUTE_CATEGORIES) / step
    classes = what_if(s, step, "engine", "folded")["classes"]
    compute = sum(classes[c]["sensitivity"] for c in COMPUTE_CLASSES)
    links = sum(row["sensitivity"] for c, row in classes.items() if c not in COMPUTE_CLASSES)
    assert 0.1 < compute_share < 0.9
    assert compute / SAVED == pytest.approx(compute_share, abs=2e-3)
    assert links / SAVED == pytest.approx(1 - compute_share, abs=0.05)


def test_links_bound_a_communication_heavy_step() -> None:
    """TP across nodes over slow NICs: the NICs are what bounds it."""
    s = scenario(tp=4, gpn=2, cluster={"inter_node_bandwidth_GBps": 1.0})
    for method in ("engine", "analytic"):
        classes = sensitivities(s, method)["classes"]
        top = max(classes, key=lambda c: classes[c]["sensitivity"])
        assert top == "inter_node"
        assert 0.5 < classes["inter_node"]["elasticity"] <= 1.0 + 1e-9


def test_classes_of_a_scenario_and_an_unknown_class() -> None:
    s = scenario()
    assert cost_classes(s) == (*COMPUTE_CLASSES, "intra_node", "inter_node")
    with pytest.raises(ValueError, match="not one of"):
        step_time_with(s, "pcie", SPEEDUP, "engine", "folded")
    oversubscribed = scenario(dp=16, cluster={"oversubscription": 2.0})
    assert cost_classes(oversubscribed)[-1] == "core"


def test_table_lists_every_class_most_sensitive_first() -> None:
    entry = sensitivities(scenario(tp=2, pp=2, dp=2, gpn=8), "engine")
    lines = what_if_lines(entry)
    assert lines[0].startswith("what bounds this step")
    body = lines[2:-1]
    assert len(body) == len(entry["classes"])
    saves = [float(line.split()[-2].rstrip("%")) for line in body]
    assert saves == sorted(saves, reverse=True)


def test_cli_what_if(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nmodel: {preset: tiny-gpt}\n"
                    "cluster: {system: dgx-a100-80gb, nodes: 1, gpus_per_node: 8}\n"
                    "parallel: {tp: 2, pp: 2, dp: 2}\n"
                    "training: {global_batch: 16, micro_batch: 1}\n")
    for method in ("engine", "analytic"):
        out = tmp_path / method
        assert main(["run", str(path), "--out", str(out), "--no-plots", "--what-if",
                     "--method", method]) == 0
        entry = json.loads((out / "results.json").read_text())["what_if"]
        assert entry["method"] == method and entry["speedup"] == SPEEDUP
        assert set(entry["classes"]) == {*COMPUTE_CLASSES, "intra_node", "inter_node"}
        assert "what bounds this step" in capsys.readouterr().out
