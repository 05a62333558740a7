"""The extension points: a strategy, a schedule and a collective algorithm are each one
module plus one registry entry, and nothing else needs to know their names.

A toy strategy (``toy_strategy.py``: an all-reduce of the gradient norm's partial sums
before the optimizer step) and a toy schedule (``toy_schedule.py``: GPipe with its
backwards last in, first out) are added from one file each and followed through every
command's machinery: the scenario's validation, the engine, the closed form, memory and
the planner's search.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from toy_schedule import GPIPE_LIFO, gpipe_lifo
from toy_strategy import GRADNORM

from simulator.analysis.accounting.vocabulary import COMM_KINDS, categories, comm_kinds
from simulator.analysis.memory import memory_report
from simulator.api import simulate_scenario
from simulator.errors import ScenarioError
from simulator.schedules import registry as schedules
from simulator.schedules.registry import build_schedule, schedule_spec
from simulator.schedules.validate import validate
from simulator.search.candidates import KNOBS, PlanRequest, knobs
from simulator.search.plan import run_plan
from simulator.spec.load import scenario_from_dict
from simulator.strategies import registry
from simulator.strategies.timing import collective_time
from simulator.system.collectives.registry import ALGORITHMS, choosable
from simulator.system.collectives.tuner import nccl_algorithms

BASE: dict[str, Any] = {
    "name": "toy",
    "model": {"preset": "tiny-gpt"},
    "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 8},
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "schedule": "1f1b"},
    "training": {"global_batch": 16, "micro_batch": 2},
}
REQUEST = PlanRequest("tiny-gpt", 8, "dgx-a100-80gb", 16, top_k=1, micro_batches=(2,),
                      schedules=("1f1b",), zero_stages=(0,), recompute=("none",))


def scenario(**sections: Any) -> Any:
    return scenario_from_dict({**BASE, **sections})


@pytest.fixture
def with_gradnorm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "STRATEGIES", (*registry.STRATEGIES, GRADNORM))


@pytest.fixture
def with_lifo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedules, "SCHEDULES", {**schedules.SCHEDULES, "gpipe-lifo": GPIPE_LIFO})


# ------------------------------------------------------------ the built-in registries


def test_every_communication_kind_belongs_to_one_strategy() -> None:
    """The accounting's built-in kinds are exactly the built-in strategies' kinds, each
    declared once: the vocabulary and the strategies cannot drift apart."""
    declared = [k for s in registry.strategies() for k in s.kinds]
    assert sorted(declared) == sorted(COMM_KINDS)
    assert comm_kinds() == COMM_KINDS


def test_strategies_have_distinct_names_and_a_docstring_each() -> None:
    names = [s.name for s in registry.strategies()]
    assert len(set(names)) == len(names) and "" not in names
    for s in registry.strategies():
        assert type(s).__module__.startswith("simulator.strategies.")
        assert (__import__(type(s).__module__, fromlist=["x"]).__doc__ or "").strip()


def test_the_schema_lists_the_registries() -> None:
    from simulator.spec.scenario import Scenario

    props = Scenario.model_json_schema()["$defs"]
    assert props["ParallelSpec"]["properties"]["schedule"]["enum"] == list(schedules.SCHEDULES)
    assert props["SimulationSpec"]["properties"]["collective_algorithm"]["enum"] == \
        choosable() == ["auto", "ring", "tree", "hierarchical"]


def test_nccl_algorithms_are_the_registry_entries_with_an_nccl_form() -> None:
    from simulator.system.collectives.plan import GroupShape

    offered = {a for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
               for shape in (GroupShape(8, 8), GroupShape(16, 8), GroupShape(4, 1))
               for a in nccl_algorithms(op, shape, "2.27", nvls=True)}
    assert offered == {name for name, a in ALGORITHMS.items() if a.nccl_id is not None}


# ------------------------------------------------------------ a toy strategy


def test_an_unregistered_strategy_section_is_refused() -> None:
    with pytest.raises(ScenarioError) as exc:
        scenario(strategies={"gradnorm": {"enabled": True}})
    assert exc.value.problems[0].field == "strategies.gradnorm"
    assert "unknown strategy" in str(exc.value.problems[0])


def test_a_toy_strategy_is_validated(with_gradnorm: None) -> None:
    with pytest.raises(ScenarioError) as exc:
        scenario(strategies={"gradnorm": {"enabled": True, "bytes": 6}})
    assert [p.field for p in exc.value.problems] == ["strategies.gradnorm.bytes"]
    assert "multiple of 4" in str(exc.value.problems[0])
    with pytest.raises(ScenarioError) as exc:
        scenario(strategies={"gradnorm": {"enabled": True, "byte": 8}})
    assert exc.value.problems[0].field == "strategies.gradnorm.byte"
    assert "did you mean 'bytes'" in str(exc.value.problems[0])
    assert scenario(strategies={"gradnorm": {"enabled": True, "bytes": 8}}).to_dict()[
        "strategies"] == {"gradnorm": {"enabled": True, "bytes": 8}}


def test_a_toy_strategy_is_simulated_by_the_engine(with_gradnorm: None) -> None:
    off, _ = simulate_scenario(scenario(), "engine")
    on, spans = simulate_scenario(scenario(strategies={"gradnorm": {"enabled": True,
                                                                    "bytes": 1 << 20}}),
                                  "engine")
    assert on["step_time_s"] > off["step_time_s"]
    assert spans is not None and (spans["kind"] == "gradnorm").sum() == 2  # a rank per stage
    assert "gradnorm_transfer" in categories()
    for entry in on["time_breakdown_s"]:  # its own category, and the partition still holds
        assert entry["gradnorm_transfer"] > 0
        parts = sum(v for k, v in entry.items() if k not in ("rank", "stage"))
        assert parts == pytest.approx(on["step_time_s"], rel=1e-9)
    assert on["exposed_comm_s"]["gradnorm"] > 0


def test_a_toy_strategy_is_priced_by_the_closed_form(with_gradnorm: None) -> None:
    off = simulate_scenario(scenario(), "analytic")[0]["step_time_s"]
    s = scenario(strategies={"gradnorm": {"enabled": True, "bytes": 1 << 20}})
    on, _ = simulate_scenario(s, "analytic")
    from simulator.builder.workload import layout_of

    layout = layout_of(s)
    term = collective_time(s, layout, "all_reduce", float(1 << 20), layout.dp_group(0),
                           s.hardware)
    assert on["step_time_s"] - off == pytest.approx(term, rel=1e-9)
    assert on["step_breakdown_s"]["gradnorm_transfer"] == pytest.approx(term, rel=1e-12)


def test_a_toy_strategy_is_counted_in_memory(with_gradnorm: None) -> None:
    off = memory_report(scenario())
    on = memory_report(scenario(strategies={"gradnorm": {"enabled": True, "bytes": 4096}}))
    assert [b.comm_buffers - a.comm_buffers for a, b in zip(off, on, strict=True)] == \
        [4096.0, 4096.0]
    assert [b.total - a.total for a, b in zip(off, on, strict=True)] == [4096.0, 4096.0]


def test_a_toy_strategy_is_searched_by_plan(with_gradnorm: None) -> None:
    assert "gradnorm" in knobs() and "gradnorm" not in KNOBS  # the registration adds it
    with ThreadPoolExecutor(1) as pool:
        plan = run_plan(REQUEST, pool)
    table = plan.table
    assert set(table["gradnorm"]) == {False, True}
    assert (table["gradnorm"]).sum() == (~table["gradnorm"].astype(bool)).sum()
    fits = table[table["fits"]]
    on, off = fits[fits["gradnorm"]], fits[~fits["gradnorm"].astype(bool)]
    dp2 = on["dp"] > 1  # with one replica there is nothing to exchange
    assert (on[dp2]["analytic_step_time_s"].to_numpy()
            > off[off["dp"] > 1]["analytic_step_time_s"].to_numpy()).all()
    assert plan.chosen is not None and not table.loc[plan.chosen, "gradnorm"]


# ------------------------------------------------------------ a toy schedule


def test_a_toy_schedule_builds_and_validates(with_lifo: None) -> None:
    assert build_schedule("gpipe-lifo", 4, 6) == gpipe_lifo(4, 6)
    validate(build_schedule("gpipe-lifo", 4, 6))
    assert schedule_spec("gpipe-lifo").flush and not schedule_spec("gpipe-lifo").chunked


def test_a_toy_schedule_is_validated(with_lifo: None) -> None:
    s = scenario(parallel={**BASE["parallel"], "schedule": "gpipe-lifo"})
    assert s.parallel.schedule == "gpipe-lifo"
    with pytest.raises(ScenarioError) as exc:
        scenario(parallel={**BASE["parallel"], "schedule": "gpipe-lifo", "virtual_stages": 2})
    assert exc.value.problems[0].field == "parallel.virtual_stages"


def test_an_unregistered_schedule_is_refused() -> None:
    with pytest.raises(ScenarioError) as exc:
        scenario(parallel={**BASE["parallel"], "schedule": "gpipe-lifo"})
    assert exc.value.problems[0].field == "parallel.schedule"


def test_a_toy_schedule_is_simulated_costed_and_counted(with_lifo: None) -> None:
    gpipe = scenario(parallel={**BASE["parallel"], "schedule": "gpipe"})
    lifo = scenario(parallel={**BASE["parallel"], "schedule": "gpipe-lifo"})
    assert simulate_scenario(lifo, "analytic")[0]["step_time_s"] == \
        simulate_scenario(gpipe, "analytic")[0]["step_time_s"]
    engine, spans = simulate_scenario(lifo, "engine")
    assert spans is not None and engine["bubble_fraction"] > 0
    order = spans[(spans["rank"] == 0) & (spans["op"] == "B")].sort_values("start")
    assert list(dict.fromkeys(order["microbatch"])) == [3, 2, 1, 0]  # last in, first out
    assert engine["step_time_s"] == pytest.approx(
        simulate_scenario(gpipe, "engine")[0]["step_time_s"], rel=0.05)
    assert [m.total for m in memory_report(lifo)] == [m.total for m in memory_report(gpipe)]


def test_a_toy_schedule_is_searched_by_plan(with_lifo: None) -> None:
    from dataclasses import replace

    with ThreadPoolExecutor(1) as pool:
        plan = run_plan(replace(REQUEST, schedules=("1f1b", "gpipe-lifo")), pool)
    piped = plan.table[plan.table["pp"] > 1]
    assert set(piped["schedule"]) == {"1f1b", "gpipe-lifo"}
    assert (piped["schedule"] == "gpipe-lifo").sum() == (piped["schedule"] == "1f1b").sum()
