"""torch.distributed.pipelining's host time per action (``gpu.pipeline_action_us``,
calibration/measured/pipeline_cost.py): the figure from two degenerate launches' slopes,
and the charge, one task per F and per B action of every stage, on the critical path
2(m + p − 1) times under GPipe, in the engine and the analytic estimate alike; nothing
under another runtime, without a host cost per kernel, or without pipelining."""

from __future__ import annotations

from typing import Any

import pytest

from calibration.measured.pipeline_cost import action_us
from simulator.analysis.uncertainty import step_time_of, with_hardware
from simulator.builder.workload import build_workload
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario

ACTION_US = 700.0


def test_the_figure_is_half_the_slope_the_profile_misses() -> None:
    # measured 2 ms a micro-batch more, simulated 0.5: 1.5 ms for an F and a B
    assert action_us((0.010, 0.034), (0.006, 0.012), (4, 16)) == pytest.approx(750.0)
    assert action_us((0.010, 0.012), (0.006, 0.012), (4, 16)) == 0.0  # never negative


def _pipeline(m: int, action: float | None, stack: Any = "pytorch-eager",
              pp: int = 2) -> Scenario:
    s = scenario_from_dict({
        "name": "pipe-runtime", "stack": stack,
        "model": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 128},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": pp},
        "parallel": {"tp": 1, "pp": pp, "dp": 1, "schedule": "gpipe"},
        "training": {"global_batch": m, "micro_batch": 1}})
    gpu = s.hardware.gpu.model_copy(update={"pipeline_action_us": action})
    return with_hardware(s, s.hardware.model_copy(update={"gpu": gpu}))


@pytest.mark.parametrize("m", [1, 4])
def test_gpipe_grows_by_the_actions_on_its_critical_path(m: int) -> None:
    base, charged = _pipeline(m, None), _pipeline(m, ACTION_US)
    tasks = [t for p in build_workload(charged).programs.values()
             for t in p.streams["compute"] if t.name.startswith("pp.runtime")]
    assert len(tasks) == 2 * 2 * m  # an F and a B per micro-batch on each of two stages
    assert {t.duration for t in tasks} == {ACTION_US * 1e-6}
    on_path = 2 * (m + 2 - 1)
    for method in ("engine", "analytic"):
        grown = step_time_of(charged, method, None) - step_time_of(base, method, None)
        assert grown == pytest.approx(on_path * ACTION_US * 1e-6, rel=1e-6), method


@pytest.mark.parametrize("variant", ["megatron", "cuda_graphs", "no_pp"])
def test_no_charge_outside_torch_pipelining_with_a_host_cost(variant: str) -> None:
    stack: Any = {"megatron": "megatron-core",
                  "cuda_graphs": {"preset": "pytorch-eager", "cuda_graphs": True},
                  "no_pp": "pytorch-eager"}[variant]
    pp = 1 if variant == "no_pp" else 2
    base, charged = _pipeline(4, None, stack, pp), _pipeline(4, ACTION_US, stack, pp)
    for method in ("engine", "analytic"):
        assert step_time_of(charged, method, None) == step_time_of(base, method, None)
