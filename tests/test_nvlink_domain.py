"""NVLink domains larger than a node (a GB200 NVL72 rack: 72 GPUs over 18 trays of 4):
a group whose members all lie in one domain runs over NVLink, one that spans racks
crosses the network; a system whose domain is its node is what it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from simulator.builder.tasks import Program, Task, Workload
from simulator.builder.workload import build_workload, layout_of
from simulator.cli.main import main
from simulator.engine.engine import simulate
from simulator.errors import ScenarioError, UserError
from simulator.schedules.registry import build_schedule
from simulator.spec.load import scenario_from_dict
from simulator.spec.rules import consistency_problems, scenario_warnings
from simulator.strategies.timing import collective_time
from simulator.system.collectives.choice import make_plan
from simulator.system.collectives.plan import GroupShape
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout
from simulator.system.profiles import load_system, validate_profile
from simulator.system.topology import Topology

NVL72 = load_system("gb200-nvl72")
B_NVL = NVL72.intra_node.bandwidth_GBps * 1e9 * NVL72.intra_node.efficiency
A_NVL = NVL72.intra_node.latency_us * 1e-6


def ring_all_reduce_time(n: int, size: float, bw: float, alpha: float) -> float:
    return 2 * (n - 1) / n * size / bw + 2 * (n - 1) * alpha


def _scenario(nodes: int, tp: int, dp: int, system: str = "gb200-nvl72",
              **cluster: Any) -> Any:
    return scenario_from_dict({
        "name": "nvl", "model": {"layers": 2, "hidden": 1024, "heads": 16, "vocab": 512,
                                 "seq_len": 256},
        "cluster": {"system": system, "nodes": nodes, **cluster},
        "parallel": {"tp": tp, "dp": dp},
        "training": {"global_batch": dp},
        "simulation": {"collective_algorithm": "ring"}})


def test_the_rack_is_one_domain_of_trays() -> None:
    layout = Layout(tp=16, pp=1, dp=9, gpus_per_node=4, domain_gpus=72)
    topo = Topology(layout, NVL72)
    assert layout.node(4) == 1 and layout.domain(4) == 0  # another tray, the same rack
    assert topo.link_class(0, 71) == "intra_node"
    assert topo.link_class(71, 72) == "inter_node"
    assert layout.node(15) == 3 and layout.group_link(layout.tp_group(0)) == "intra_node"


def test_a_domain_of_one_node_is_the_node() -> None:
    """Without nvlink_domain_gpus the node is the domain: DGX H100 as before."""
    hw = load_system("dgx-h100")
    assert hw.nvlink_domain_gpus is None and hw.domain_gpus == hw.gpus_per_node == 8
    layout = Layout(tp=16, pp=1, dp=1, gpus_per_node=8)
    assert layout.domains_spanned(layout.tp_group(0)) == 2
    assert layout.group_link(layout.tp_group(0)) == "inter_node"


@pytest.mark.parametrize("size", [1e6, 64e6])
def test_tp16_across_four_trays_is_an_nvlink_ring(size: float) -> None:
    """A TP-16 all-reduce on one NVL72 rack (4 trays): the analytic helper and the engine
    both give the closed-form ring over NVLink, 2(n−1)/n·S/B + 2(n−1)α."""
    s = _scenario(nodes=16, tp=16, dp=4)
    layout = layout_of(s)
    group = layout.tp_group(0)
    expected = ring_all_reduce_time(16, size, B_NVL, A_NVL)
    assert collective_time(s, layout, "all_reduce", size, group, s.hardware) \
        == pytest.approx(expected, rel=1e-12)
    plan = make_plan("all_reduce", size, GroupShape(16, 16 // layout.domains_spanned(group)),
                     "ring", s.hardware)
    assert {leg.link_class for ph in plan.phases for leg in ph.legs} == {"intra_node"}
    res = simulate(_one_collective(plan, group, layout), s.hardware)
    assert res.end_time == pytest.approx(expected, rel=1e-9)


def _one_collective(plan: Any, group: tuple[int, ...], layout: Layout) -> Workload:
    programs = {r: Program(r, {"compute": [], "pp": [], "dp": []}) for r in group}
    tasks = []
    for r in group:
        t = Task(id=len(tasks), rank=r, stream="compute", op="tp.all_reduce", kind="tp",
                 name="c", plan=plan, group=group, group_key=("c", 0), nbytes=plan.size)
        tasks.append(t)
        programs[r].streams["compute"].append(t)
    return Workload(programs, tasks, layout, build_schedule("1f1b", 1, 1), 1.0, "full")


def _link_classes(s: Any, kind: str) -> set[str]:
    w = build_workload(s, fidelity="full")
    return {leg.link_class for t in w.tasks if t.kind == kind and t.plan is not None
            for ph in t.plan.phases for leg in ph.legs}


def test_tp_within_the_rack_and_dp_across_racks() -> None:
    """TP 16 over 4 trays of one rack stays on NVLink; DP over two racks crosses the
    network; the same job on DGX H100 nodes takes TP 16 over the network."""
    two_racks = _scenario(nodes=36, tp=16, dp=9)  # 144 GPUs; 72 % 16: see the warning
    s = _scenario(nodes=32, tp=8, dp=16)  # 128 GPUs, TP 8 dividing the rack
    assert _link_classes(s, "tp") == {"intra_node"}
    assert "inter_node" in _link_classes(s, "dp")
    assert _link_classes(_scenario(nodes=16, tp=16, dp=4), "tp") == {"intra_node"}
    h100 = _scenario(nodes=8, tp=16, dp=4, system="dgx-h100")
    assert "inter_node" in _link_classes(h100, "tp")
    assert any("does not divide the NVLink domain (72 GPUs)" in w
               for w in scenario_warnings(two_racks))


def test_tp_rules_speak_of_the_domain() -> None:
    """TP larger than a tray but inside the rack: no warning; beyond the rack: one."""
    assert not any("parallel.tp" in w for w in scenario_warnings(_scenario(16, 16, 4)))
    beyond = _scenario(nodes=8, tp=16, dp=4, system="dgx-h100")
    assert any("larger than an NVLink domain (8 GPUs)" in w
               for w in scenario_warnings(beyond))


def test_gpus_per_node_must_divide_the_domain() -> None:
    with pytest.raises(ScenarioError) as err:
        _scenario(nodes=4, tp=1, dp=20, gpus_per_node=5)
    assert [p.field for p in err.value.problems] == ["cluster.gpus_per_node"]
    assert "NVLink domain (72 GPUs)" in str(err.value.problems[0])
    assert consistency_problems(_scenario(nodes=4, tp=1, dp=8, gpus_per_node=2)) == []


def test_a_profile_domain_holds_whole_nodes() -> None:
    data = NVL72.model_dump(mode="json")
    data["nvlink_domain_gpus"] = 70
    with pytest.raises(UserError, match="nvlink_domain_gpus"):
        validate_profile(data, "bad.yaml")
    data.pop("nvlink_domain_gpus")
    assert validate_profile(data, "tray.yaml").domain_gpus == 4


@pytest.mark.parametrize("name", ["dgx-b200", "gb200-nvl72"])
def test_blackwell_presets_state_their_datasheet_figures(name: str) -> None:
    hw: HardwareProfile = load_system(name)
    per_gpu = {"dgx-b200": (2250, 180, 8000, 1000), "gb200-nvl72": (2500, 186, 8000, 1200)}
    bf16, mem, hbm, watts = per_gpu[name]
    assert (hw.gpu.peak_tflops["bf16"], hw.gpu.memory_GB, hw.gpu.hbm_bandwidth_GBps) \
        == (bf16, mem, hbm)
    assert hw.power is not None and hw.power.gpu_W == watts
    assert hw.intra_node.bandwidth_GBps * 2 == 1800  # NVLink 5: 1.8 TB/s bidirectional


def test_colocate_refuses_a_domain_of_several_nodes(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """colocate places jobs node by node on a network of nodes: a rack-wide NVLink
    domain is refused in one line, exit 2."""
    job = {"name": "dp", "model": {"preset": "tiny-gpt"},
           "cluster": {"system": "gb200-nvl72", "nodes": 2},
           "parallel": {"tp": 4, "pp": 1, "dp": 2},
           "training": {"global_batch": 8, "micro_batch": 2, "dtype": "bf16"}}
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(job))
    spec = {"name": "two", "system": "gb200-nvl72", "nodes": 4,
            "jobs": [{"scenario": "dp.yaml", "steps": 1}, {"scenario": "dp.yaml", "steps": 1}]}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(spec))
    assert main(["colocate", str(tmp_path / "cluster.yaml"), "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NVLink domains join 18 nodes" in err[0], err
