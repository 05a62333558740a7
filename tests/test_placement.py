"""Uneven pipeline stages (``parallel.layers_per_stage``) against closed forms.

- GPipe with stage times (F_i, B_i) and free communication is two flow shops of m
  identical jobs: the pipeline phase is Σ_i (F_i + B_i) + (m − 1)(max F + max B).
- 1F1B whose last stage is the slowest: that stage runs all m forwards and
  backwards back to back, after the others' first forwards and before their last
  backwards, so the phase is Σ_{i<p−1} (F_i + B_i) + m (F_{p−1} + B_{p−1}) — a lower
  bound for any schedule with this order, which 1F1B attains.
- The analytic method equals the engine to rounding for every schedule, stages
  without layers included; accounting sums to the step, and the lighter stages'
  extra idle is ``imbalance_idle``; folded equals full.
- Memory per stage follows the placement; validation errors name field, value, fix.
"""

from __future__ import annotations

import pytest
from test_accounting import assert_partition
from test_engine import balanced, make_scenario, run_engine

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.analysis.memory import memory_report, peak_memory
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.errors import ScenarioError
from simulator.model.memory import stage_params
from simulator.model.transformer import param_count
from simulator.spec.load import load_scenario, scenario_from_dict
from simulator.spec.placement import chunk_layers, stage_layer_count, stage_layers
from simulator.spec.scenario import ParallelSpec

MODEL = {"hidden": 512, "heads": 8, "vocab": 4096, "seq_len": 128}
EXACT = 1e-9
T_F, T_B = 1e-3, 2e-3  # one layer's forward and backward (balanced(): no embedding or head)


def uneven(counts: list[int], schedule: str = "1f1b", v: int = 1, m: int = 6, **kw: object):
    pp = len(counts) // v
    return make_scenario(pp=pp, m=m, schedule=schedule, v=v, free=True,
                         model={**MODEL, "layers": sum(counts)},
                         parallel={"layers_per_stage": counts}, **kw)  # type: ignore[arg-type]


def phase(met: dict) -> float:
    p0, p1 = met["pipeline_phase_s"]
    return p1 - p0


# ------------------------------------------------------------------ placement


def test_chunks_are_consecutive_runs_in_virtual_stage_order() -> None:
    par = ParallelSpec(pp=2, virtual_stages=2, schedule="interleaved",
                       layers_per_stage=(1, 3, 0, 2))
    assert [chunk_layers(6, par, k) for k in range(4)] == [range(0, 1), range(1, 4),
                                                           range(4, 4), range(4, 6)]
    assert stage_layers(6, par, 0) == [range(0, 1), range(4, 4)]  # virtual stages 0 and 2
    assert stage_layers(6, par, 1) == [range(1, 4), range(4, 6)]
    assert [stage_layer_count(6, par, r) for r in range(2)] == [1, 5]
    even = ParallelSpec(pp=2, virtual_stages=2, schedule="interleaved")
    assert [chunk_layers(8, even, k) for k in range(4)] == [range(2 * k, 2 * k + 2)
                                                            for k in range(4)]


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("counts", [[1, 2, 2, 3], [3, 0, 2, 1], [0, 4], [2, 1, 1, 1, 3],
                                    [1, 1, 5]])
@pytest.mark.parametrize("m", [1, 4, 7])
def test_gpipe_is_two_flow_shops(counts: list[int], m: int) -> None:
    met, _ = run_engine(uneven(counts, "gpipe", m=m), costs=balanced(T_F, T_B))
    f = [n * T_F for n in counts]
    b = [n * T_B for n in counts]
    assert phase(met) == pytest.approx(sum(f) + sum(b) + (m - 1) * (max(f) + max(b)), rel=EXACT)


@pytest.mark.parametrize("counts", [[1, 2, 2, 3], [0, 3, 1, 3], [2, 5], [3, 1, 2, 0, 4]])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_1f1b_with_the_last_stage_slowest(counts: list[int], m: int) -> None:
    met, _ = run_engine(uneven(counts, "1f1b", m=m), costs=balanced(T_F, T_B))
    t = [n * (T_F + T_B) for n in counts]
    assert phase(met) == pytest.approx(sum(t[:-1]) + m * t[-1], rel=EXACT)


def test_lighter_ends_shorten_the_phase_within_its_bounds() -> None:
    """One layer fewer on the first and last stage (1F1B): shorter than the even split's
    (m + p − 1)·t, never shorter than the middle stage's m·t_mid after the first
    stage's first forward and before its last backward."""
    even, _ = run_engine(uneven([3, 3, 3, 3], m=8), costs=balanced(T_F, T_B))
    light, _ = run_engine(uneven([2, 3, 3, 2], m=8), costs=balanced(T_F, T_B))
    assert phase(even) == pytest.approx((8 + 3) * 3 * (T_F + T_B), rel=EXACT)
    assert 2 * T_F + 8 * 3 * (T_F + T_B) + 2 * T_B <= phase(light) < phase(even)


# ------------------------------------------------------------------ engine vs analytic


@pytest.mark.parametrize(("schedule", "v", "counts"), [
    ("gpipe", 1, [3, 0, 2, 1]),
    ("1f1b", 1, [1, 2, 2, 3]),
    ("1f1b", 1, [3, 1, 2, 2]),
    ("1f1b", 1, [0, 3, 0, 3]),
    ("interleaved", 2, [0, 1, 2, 1, 1, 2, 1, 0]),
    ("interleaved", 2, [2, 1, 1, 1, 1, 1, 1, 0]),
    ("zb-h1", 1, [2, 1, 3, 0]),
    ("zbv", 2, [2, 1, 1, 0, 1, 1, 1, 1]),  # V: rank 0 holds stages 0 and 7, rank 3 the lightest
])
def test_analytic_equals_engine_and_both_partition_the_step(schedule: str, v: int,
                                                            counts: list[int]) -> None:
    costs = balanced(T_F, T_B, T_F if schedule in ("zb-h1", "zbv") else 0.0)
    s = uneven(counts, schedule, v=v, m=4 if v > 1 else 6)
    met, _ = run_engine(s, costs=costs)
    ana = analytic_estimate(s, costs=costs)
    assert ana["step_time_s"] == pytest.approx(met["step_time_s"], rel=EXACT)
    assert phase(ana) == pytest.approx(phase(met), rel=EXACT)
    for results in (met, ana):
        assert_partition(results)
        idle = {e["stage"]: e["imbalance_idle"] for e in results["time_breakdown_s"]}
        per_stage = [stage_layer_count(sum(counts), s.parallel, r) for r in range(s.parallel.pp)]
        lightest = per_stage.index(min(per_stage))
        assert idle[lightest] > 0.5 * T_F  # the light stage waits for the heavy one
        assert results["step_breakdown_s"]["imbalance_idle"] > 0


def test_even_placement_written_out_changes_nothing() -> None:
    costs = balanced(T_F, T_B)
    implicit = make_scenario(pp=4, m=6, free=True, model={**MODEL, "layers": 8})
    explicit = uneven([2, 2, 2, 2], m=6)
    a, _ = run_engine(implicit, costs=costs)
    b, _ = run_engine(explicit, costs=costs)
    assert a["step_time_s"] == b["step_time_s"]
    assert a["step_breakdown_s"] == b["step_breakdown_s"]
    assert analytic_estimate(implicit, costs=costs)["step_time_s"] == \
        analytic_estimate(explicit, costs=costs)["step_time_s"]


@pytest.mark.parametrize(("schedule", "v", "counts"), [("1f1b", 1, [1, 2, 0, 3]),
                                                       ("interleaved", 2, [1, 0, 2, 1])])
def test_folded_equals_full(schedule: str, v: int, counts: list[int]) -> None:
    s = make_scenario(pp=len(counts) // v, tp=2, dp=2, m=4, schedule=schedule, v=v,
                      model={**MODEL, "layers": sum(counts)},
                      parallel={"layers_per_stage": counts})
    folded, _ = run_engine(s, fidelity="folded")
    full, _ = run_engine(s, fidelity="full")
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=EXACT)


# ------------------------------------------------------------------ memory


def test_memory_per_stage_follows_the_placement() -> None:
    s = uneven([1, 5, 2, 0], m=4)
    spec = s.model
    report = memory_report(s)
    params = [stage_params(spec, 4, st, stage_layers(spec.layers, s.parallel, st))
              for st in range(4)]
    assert sum(params) == param_count(spec) + spec.vocab * spec.hidden  # + tied copy
    # weights: 2 bytes per parameter, tp = 1
    assert [r.weights for r in report] == pytest.approx([2.0 * p for p in params])
    assert peak_memory(s).stage == 1  # five layers outweigh the embedding
    assert report[3].activations < report[2].activations  # no layers, only the head's inputs


# ------------------------------------------------------------------ validation


def _problems(counts: object, layers: int = 8, pp: int = 4, v: int = 1) -> str:
    schedule = "interleaved" if v > 1 else "1f1b"
    with pytest.raises(ScenarioError) as err:
        make_scenario(pp=pp, m=4, v=v, schedule=schedule, model={**MODEL, "layers": layers},
                      parallel={"layers_per_stage": counts})
    return str(err.value)


@pytest.mark.parametrize(("counts", "layers", "v", "needle"), [
    ([2, 2, 2], 8, 1, "has 3 entries; it needs pp(4) entries"),
    ([2, 2, 2, 2], 8, 2, "pp(4) * virtual_stages(2) = 8 entries"),
    ([2, 2, 2, 3], 8, 1, "sums to 9 layers, not model.layers (8)"),
    ([2, -1, 5, 2], 8, 1, "must be >= 0"),
    ([2, True, 3, 2], 8, 1, "whole number"),
    ([2, 2.5, 1.5, 2], 8, 1, "whole number"),
    ("2,2,2,2", 8, 1, "parallel.layers_per_stage"),
    ([], 8, 1, "parallel.layers_per_stage"),
])
def test_bad_placements_name_field_value_and_fix(counts: object, layers: int, v: int,
                                                 needle: str) -> None:
    text = _problems(counts, layers, v=v)
    assert "parallel.layers_per_stage" in text and needle in text


def test_indivisible_layers_point_at_the_uneven_split() -> None:
    with pytest.raises(ScenarioError) as err:
        make_scenario(pp=4, m=4, model={**MODEL, "layers": 10})
    text = str(err.value)
    assert "model.layers = 10" in text and "parallel.layers_per_stage" in text
    assert len(text.splitlines()) == 1


def test_cli_refuses_a_bad_placement_in_one_line(tmp_path, capsys) -> None:
    base = load_scenario("scenarios/llama2-7b-8gpu-pp4-1f1b.yaml")
    assert base.parallel.pp == 4
    rc = main(["run", "scenarios/llama2-7b-8gpu-pp4-1f1b.yaml", "--set",
               "parallel.layers_per_stage=[8, 8, 8, 9]", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error")]
    assert len(lines) == 1 and "parallel.layers_per_stage" in lines[0] and "sums to 33" in lines[0]


@pytest.mark.parametrize("method", ["powersgd", "fp8"])
def test_a_last_stage_without_layers_keeps_its_gradient_unit(method: str) -> None:
    """The head's gradients are their own unit on a last stage that holds no layers
    (the compression pass buckets the same units as the data pass)."""
    data = make_scenario(pp=4, dp=2, m=4, model={**MODEL, "layers": 6},
                         parallel={"layers_per_stage": [2, 2, 2, 0]}).to_dict()
    data["training"]["gradient_compression"] = {"method": method}
    s = scenario_from_dict(data)
    for how in ("engine", "analytic"):
        results, _ = simulate_scenario(s, how)
        assert results["gradient_compression"]["compressed_step"]
        assert_partition(results)
