"""``clustersim run --uncertainty N``: Monte Carlo over the profile's fitted terms."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml

from simulator.analysis.uncertainty import (
    draw_factors,
    monte_carlo,
    perturbed,
    step_time_of,
    with_hardware,
)
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.spec.load import load_scenario
from simulator.system.profiles import load_system
from tests.small_scenario import SMALL

SPREAD = {"gemm": 0.05, "attention": 0.08, "memory": 0.1, "intra_node": 0.1,
          "kernel_overhead": 0.2}


def _profile(tmp_path: Path, spread: dict[str, float] | None) -> Path:
    data = load_system("dgx-a100-80gb").model_dump(mode="json")
    data["gpu"]["kernel_overhead_us"] = 4.0
    data["gpu"]["interference"] = {"intra_node": 1.2}
    data["uncertainty"] = spread or {}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _scenario(tmp_path: Path, spread: dict[str, float] | None) -> Path:
    profile = _profile(tmp_path, spread)
    path = tmp_path / "small.yaml"
    # no host cost per kernel: on a GPU tiny-gpt is launch-bound, and the spread of the
    # fitted curves would not move it
    path.write_text(SMALL.replace("system: dgx-a100-80gb", f"system: {profile}")
                    + "stack: {host_overhead_us: 0.0}\n")
    return path


def _run(tmp_path: Path, scenario: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    assert main(["run", str(scenario), "--no-plots", "--out", str(out), *extra]) == 0
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return results


def test_factors_are_seeded_lognormal_with_the_spread_as_cv() -> None:
    draws = [draw_factors({"gemm": 0.1, "memory": 0.0}, seed=7, sample=i) for i in range(4000)]
    assert all(set(d) == {"gemm"} for d in draws)  # a zero spread is no term at all
    g = [d["gemm"] for d in draws]
    assert statistics.median(g) == pytest.approx(1.0, abs=0.01)
    assert statistics.stdev(g) / statistics.fmean(g) == pytest.approx(0.1, rel=0.05)
    assert draw_factors({"gemm": 0.1}, 7, 3) == draws[3]  # a sample does not depend on N
    assert draw_factors({"gemm": 0.1}, 8, 3) != draws[3]


def test_perturbed_profile_scales_each_term_and_clamps() -> None:
    hw = load_system("dgx-a100-80gb").model_copy()
    gpu = hw.gpu.model_copy(update={"kernel_overhead_us": 4.0, "interference": {
        "intra_node": 1.5}})
    hw = hw.model_copy(update={"gpu": gpu})
    out = perturbed(hw, {"gemm": 2.0, "memory": 0.5, "kernel_overhead": 2.0, "intra_node": 1.25,
                         "interference": 0.5})
    assert all(e == min(2 * e0, 1.0) for (_, e), (_, e0) in
               zip(out.gpu.gemm_efficiency.points, hw.gpu.gemm_efficiency.points, strict=True))
    assert out.gpu.memory_efficiency(1e9) == pytest.approx(0.5 * hw.gpu.memory_efficiency(1e9))
    assert out.gpu.attention_efficiency == hw.gpu.attention_efficiency
    assert out.gpu.kernel_overhead_us == 2.0  # twice as fast: half the overhead
    assert out.intra_node.bandwidth_GBps == 1.25 * hw.intra_node.bandwidth_GBps
    assert out.inter_node == hw.inter_node
    assert out.gpu.interference_factor("intra_node") == 1.0  # 0.75, kept at 1
    assert out.gpu.attention_kernels == hw.gpu.attention_kernels
    assert perturbed(hw, {}) == hw


def test_the_attention_term_scales_the_fused_kernels_curves_too() -> None:
    hw = load_system("dgx-h100")
    out = perturbed(hw, {"attention": 1.5})
    for name, kernel in hw.gpu.attention_kernels.items():
        for pass_ in ("fwd", "bwd"):
            assert out.gpu.attention_kernels[name].efficiency(pass_, 4096, 128) == \
                pytest.approx(min(1.5 * kernel.efficiency(pass_, 4096, 128), 1.0))


@pytest.mark.parametrize("method", ["analytic", "engine"])
def test_an_unperturbed_sample_is_the_plain_run(tmp_path: Path, method: str) -> None:
    s = load_scenario(_scenario(tmp_path, SPREAD), [])
    plain, _ = simulate_scenario(s, method)
    same = with_hardware(s, perturbed(s.hardware, {}))
    assert step_time_of(same, method, plain.get("fidelity")) == plain["step_time_s"]
    faster = with_hardware(s, perturbed(s.hardware, {"gemm": 1.5, "intra_node": 1.5}))
    assert step_time_of(faster, method, plain.get("fidelity")) < plain["step_time_s"]


def test_without_a_spread_the_three_percentiles_are_the_plain_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = _run(tmp_path, _scenario(tmp_path, None), "--uncertainty", "20")
    for metric in ("step_time_s", "mfu"):
        assert res[f"{metric}_p5"] == res[f"{metric}_p50"] == res[f"{metric}_p95"] \
            == res[metric]
    assert res["uncertainty"]["samples"] == 0
    out = capsys.readouterr().out
    assert "has no uncertainty section" in out
    assert sum("no uncertainty section" in ln for ln in out.splitlines()) == 1


def test_with_a_spread_percentiles_order_and_the_seed_reproduces(tmp_path: Path) -> None:
    scenario = _scenario(tmp_path, SPREAD)
    a = _run(tmp_path, scenario, "--uncertainty", "24", "--seed", "3", "--method", "analytic")
    b = _run(tmp_path, scenario, "--uncertainty", "24", "--seed", "3", "--method", "analytic")
    c = _run(tmp_path, scenario, "--uncertainty", "24", "--seed", "4", "--method", "analytic")
    t = [a[f"step_time_s_{p}"] for p in ("p5", "p50", "p95")]
    m = [a[f"mfu_{p}"] for p in ("p5", "p50", "p95")]
    assert t[0] < t[1] < t[2] and m[0] < m[1] < m[2]
    assert t[0] < a["step_time_s"] < t[2]
    assert m[1] == pytest.approx(a["mfu"] * a["step_time_s"] / t[1], rel=0.05)
    keys = [k for k in a if k.startswith(("step_time_s_", "mfu_"))]
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert a["step_time_s_p50"] != c["step_time_s_p50"]
    assert a["uncertainty"]["relative_std"] == SPREAD and a["uncertainty"]["seed"] == 3


def test_engine_samples_use_the_engine(tmp_path: Path) -> None:
    s = load_scenario(_scenario(tmp_path, {"gemm": 0.1}), [])
    plain, _ = simulate_scenario(s, "engine")
    priced: list[str] = []

    def price(sc: Any) -> float:
        priced.append(sc.hardware.name)
        return step_time_of(sc, "engine", plain["fidelity"])

    block = monte_carlo(s, 5, 0, plain, price)
    assert len(priced) == 5
    lo, mid, hi = (block["step_time_s"][p] for p in ("p5", "p50", "p95"))
    assert lo < mid < hi
    assert math.isclose(block["mfu"]["p50"] * mid, plain["mfu"] * plain["step_time_s"],
                        rel_tol=1e-9)


@pytest.mark.parametrize("value", ["0", "-3", "10001", "2.5", "abc", "1e3"])
def test_bad_sample_counts_are_one_line_errors(tmp_path: Path, value: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    scenario = _scenario(tmp_path, SPREAD)
    assert main(["run", str(scenario), "--no-plots", "--out", str(tmp_path / "o"),
                 "--uncertainty", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --uncertainty")
    assert "from 1 to 10,000" in err[0]
    assert not (tmp_path / "o").exists()


def test_bad_seed_is_a_one_line_error(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    scenario = _scenario(tmp_path, SPREAD)
    assert main(["run", str(scenario), "--no-plots", "--uncertainty", "5", "--seed", "x",
                 "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --seed = 'x'")
