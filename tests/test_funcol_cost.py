"""The host time of DTensor's functional collectives (``gpu.funcol_overhead_us``,
calibration/measured/host_cost.py): one task before each TP collective of a DTensor
stack, each on the critical path of a TP-only step, in the engine; the analytic estimate
adds it to its per-layer TP collectives; nothing without DTensor or a host cost."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.analysis.uncertainty import step_time_of, with_hardware
from simulator.builder.workload import build_workload
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario

FUNCOL_US = 80.0


def _tp(funcol: float | None, stack: Any = "pytorch-eager", sp: bool = False) -> Scenario:
    s = scenario_from_dict({
        "name": "funcol", "stack": stack,
        "model": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 2},
        "parallel": {"tp": 2, "pp": 1, "dp": 1, "sequence_parallel": sp},
        "training": {"global_batch": 2, "micro_batch": 1}})
    gpu = s.hardware.gpu.model_copy(update={"funcol_overhead_us": funcol})
    return with_hardware(s, s.hardware.model_copy(update={"gpu": gpu}))


@pytest.mark.parametrize("sp", [False, True])
def test_each_tp_collective_pays_the_issue_once_on_the_critical_path(sp: bool) -> None:
    base, charged = _tp(None, sp=sp), _tp(FUNCOL_US, sp=sp)
    stream = build_workload(charged).programs[0].streams["compute"]
    issues = [t for t in stream if t.name == "tp.funcol issue"]
    collectives = [t for t in stream if t.kind == "tp"]
    assert len(issues) == len(collectives) > 0
    assert {t.duration for t in issues} == {FUNCOL_US * 1e-6}
    grown = step_time_of(charged, "engine", None) - step_time_of(base, "engine", None)
    assert grown == pytest.approx(len(collectives) * FUNCOL_US * 1e-6, rel=1e-6)
    grown_analytic = (step_time_of(charged, "analytic", None)
                      - step_time_of(base, "analytic", None))
    assert 0 < grown_analytic <= grown * (1 + 1e-9)


@pytest.mark.parametrize("stack", ["megatron-core", {"preset": "pytorch-eager",
                                                     "cuda_graphs": True}])
def test_no_charge_without_dtensor_or_a_host_cost(stack: Any) -> None:
    base, charged = _tp(None, stack), _tp(FUNCOL_US, stack)
    for method in ("engine", "analytic"):
        assert step_time_of(charged, method, None) == step_time_of(base, method, None)
