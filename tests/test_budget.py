"""The cost estimate before building: close to the built workload, and a limit that
refuses runaway scenarios with one line while every bundled scenario still runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from simulator.api import simulate_scenario
from simulator.builder.budget import (
    BYTES_PER_SHARED_TASK,
    DEFAULT_MAX_TASKS,
    MAX_STAGES,
    check_engine_cost,
    engine_cost,
)
from simulator.builder.workload import build_workload
from simulator.errors import UserError
from simulator.spec.load import load_scenario

SCENARIOS = Path(__file__).parents[1] / "scenarios"
SMALL = SCENARIOS / "llama2-7b-8gpu-ddp.yaml"


@pytest.mark.parametrize(("name", "sets"), [
    ("llama2-7b-8gpu-ddp", []),
    ("llama2-7b-8gpu-zero2", []),
    ("llama2-7b-8gpu-fsdp", []),
    ("llama2-7b-8gpu-pp4-1f1b", []),
    ("zb-h1-vs-1f1b-zbh1", []),
    ("interleaved-vs-1f1b-interleaved", []),
    ("gpt-2.7b-32gpu-4pernode", []),
    ("gpt-10b-8xa100-40gb-zero3", ["training.global_batch=16"]),
    ("llama2-7b-1gpu-offload", []),
    ("mixtral-8x7b-64xh100-ep8", ["training.global_batch=64"]),
    ("deepseek-v3-2048xh800", ["training.global_batch=4096"]),  # DualPipe: m >= 2 pp
])
def test_estimate_is_within_30_percent_of_the_built_workload(name: str,
                                                            sets: list[str]) -> None:
    s = load_scenario(SCENARIOS / f"{name}.yaml", sets)
    built = len(build_workload(s, fidelity="folded").tasks)
    assert 0.7 <= engine_cost(s, "folded").tasks / built <= 1.3


def test_full_fidelity_scales_with_simulated_ranks() -> None:
    s = load_scenario(SCENARIOS / "llama2-7b-8gpu-pp4-1f1b.yaml")
    full, folded = engine_cost(s, "full"), engine_cost(s, "folded")
    assert full.ranks == s.parallel.world and folded.ranks == s.parallel.pp
    assert full.tasks == folded.tasks * s.parallel.world // s.parallel.pp
    built = len(build_workload(s, fidelity="full").tasks)
    assert 0.7 <= full.tasks / built <= 1.3


# 16,384 GPUs: full fidelity would build ~3e7 tasks; it runs folded (its point)
FOLDED_ONLY = {"llama3-405b-16k-h100", "llama3-405b-131k-16k-h100-cp16"}


def test_every_bundled_scenario_runs_by_default_even_at_full_fidelity() -> None:
    for path in sorted(SCENARIOS.glob("*.yaml")):
        s = load_scenario(path)
        assert check_engine_cost(s, "folded").tasks <= DEFAULT_MAX_TASKS // 1.5, path
        if path.stem in FOLDED_ONLY:
            with pytest.raises(UserError) as exc:
                check_engine_cost(s, "full")
            assert "--fidelity folded" in exc.value.lines()[0]
            continue
        assert check_engine_cost(s, "full").tasks <= DEFAULT_MAX_TASKS // 1.5, path


@pytest.mark.parametrize("sets", [
    ["training.global_batch=800000000"],
    ["model.layers=1000000000"],
])
def test_runaway_scenarios_are_refused_before_building(sets: list[str]) -> None:
    s = load_scenario(SMALL, sets)
    with pytest.raises(UserError) as exc:
        simulate_scenario(s, "engine")
    (line,) = exc.value.lines()
    assert "would build about" in line and "--max-tasks" in line
    assert "--method analytic" in line
    # the analytic method answers the same question in closed form
    results, _ = simulate_scenario(s, "analytic")
    assert results["step_time_s"] > 0


def test_max_tasks_override_both_ways() -> None:
    s = load_scenario(SMALL)
    with pytest.raises(UserError) as exc:
        simulate_scenario(s, "engine", max_tasks=10)
    assert "above the limit of 10 tasks" in str(exc.value)
    results, spans = simulate_scenario(s, "engine", max_tasks=10**6)
    assert spans is not None and results["step_time_s"] > 0


def test_full_fidelity_hint_names_folded() -> None:
    s = load_scenario(SCENARIOS / "gpt3-175b-1024.yaml")
    with pytest.raises(UserError) as exc:
        check_engine_cost(s, "full", max_tasks=10**6)
    assert "--fidelity folded" in str(exc.value)


def test_pipelines_too_long_to_tabulate() -> None:
    layers = 2 * MAX_STAGES
    s = load_scenario(SMALL, [f"model.layers={layers}", f"parallel.pp={layers}",
                              "parallel.dp=1", f"cluster.nodes={layers // 8}"])
    with pytest.raises(UserError) as exc:
        simulate_scenario(s, "analytic")
    assert "pipeline stages" in str(exc.value)


def test_shared_programs_cost_what_the_full_command_measured() -> None:
    """Full fidelity shares each stage's program (no object per task): the memory an
    estimate names is the whole command's measured bytes per task (Llama 3 405B on 16,384
    GPUs: 11.1 GB for 31.3M tasks, its TP collectives then in line), not the per-object
    figure (it said ~50 GB)."""
    s = load_scenario(SCENARIOS / "llama3-405b-16k-h100.yaml", ["stack.tp_overlap=none"])
    full = engine_cost(s, "full")
    assert full.shared and full.memory_bytes == full.tasks * BYTES_PER_SHARED_TASK
    assert 9e9 < full.memory_bytes < 13e9
    with pytest.raises(UserError) as exc:
        check_engine_cost(s, "full")
    said = re.search(r"needing about ([0-9.]+) GB", exc.value.lines()[0])
    assert said is not None and 9 < float(said.group(1)) < 13
    assert not engine_cost(s, "folded").shared
    moe = load_scenario(SCENARIOS / "mixtral-8x7b-64xh100-ep8.yaml")
    assert not engine_cost(moe, "full").shared  # every rank built: its token loads differ
