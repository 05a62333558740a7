"""Where a table's error sits, by cost class (``clustersim validate-runs --by-class``):
each row's step split into the shares its GEMMs, attention and memory-bound kernels move
(``--what-if``'s elasticities), its links and the other, and the factor per class fitted by least
squares, and the same with two classes, the attention kernels against the rest, per GPU,
kernel and head dimension. Oracles: rows made from known factors give those factors back
exactly; a share is the elasticity ``clustersim run --what-if`` reports for the same
step."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.whatif import what_if
from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.published.classes import (
    CLASSES,
    FIT_COLUMNS,
    SHARE_COLUMNS,
    SPLIT_COLUMNS,
    fit_classes,
    fit_split,
    split_line,
    step_shares,
    time_ratio,
)
from simulator.published.compare import kernel_group
from simulator.published.mapping import scenario_data
from simulator.published.rows import COLUMNS, read_rows
from simulator.spec.load import scenario_from_dict
from simulator.system.costs import COMPUTE_CLASSES

ROOT = Path(__file__).resolve().parent.parent
DEV_SET = ROOT / "docs" / "validation" / "published" / "llm-foundry.csv"


def _table(shares: np.ndarray, factors: np.ndarray, units: list[str],
           gpus: list[str] | None = None) -> pd.DataFrame:
    """Rows whose measured step is Σ f_c · share_c times the simulated one, exactly."""
    scale = shares @ factors
    simulated = np.linspace(100.0, 900.0, len(shares))
    measured = [s / k if u == "tokens/s/GPU" else s * k
                for s, k, u in zip(simulated, scale, units, strict=True)]
    table = pd.DataFrame({"name": [f"r{i}" for i in range(len(shares))],
                          "gpu": gpus or ["H100-80GB"] * len(shares), "unit": units,
                          "measured": measured, "simulated": simulated})
    table["error"] = table["simulated"] / table["measured"] - 1
    for i, column in enumerate(SHARE_COLUMNS):
        table[column] = shares[:, i]
    return table


def _shares(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.dirichlet(np.ones(len(CLASSES)), size=n)


def test_rows_made_from_known_factors_give_them_back() -> None:
    rng = np.random.default_rng(7)
    factors = np.array([1.1, 0.8, 2.0, 1.5, 3.0])
    units = ["tokens/s/GPU", "s/step"] * 15
    fits = fit_classes(_table(_shares(rng, 30), factors, units))
    assert list(fits.columns) == list(FIT_COLUMNS)
    assert list(fits["class"]) == list(CLASSES) and set(fits["group"]) == {"all"}
    assert np.allclose(fits["factor"], factors, atol=1e-9)
    assert np.allclose(fits["std_error"], 0.0, atol=1e-7)
    assert fits["mean_abs_error_after"].max() < 1e-9
    assert (fits["mean_abs_error"] > 0.1).all() and (fits["condition"] >= 1).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.2, 5.0), min_size=5, max_size=5),
       st.integers(6, 40), st.integers(0, 2**31 - 1))
def test_exact_rows_are_fitted_exactly_whatever_the_factors(
        factors: list[float], n: int, seed: int) -> None:
    f = np.array(factors)
    fits = fit_classes(_table(_shares(np.random.default_rng(seed), n), f,
                              ["tokens/s/GPU"] * n))
    assert np.allclose(fits["factor"], f, rtol=1e-6, atol=1e-6)
    assert fits["mean_abs_error_after"].iloc[0] < 1e-6


def test_noise_shows_in_the_standard_errors_and_each_gpu_has_its_fit() -> None:
    rng = np.random.default_rng(3)
    n = 60
    table = _table(_shares(rng, n), np.ones(5), ["tokens/s/GPU"] * n,
                   ["A100-SXM 40GB (RoCE)", "H100-80GB", "B200"] * 20)
    table["measured"] *= 1 + rng.normal(0, 0.05, n)
    table["error"] = table["simulated"] / table["measured"] - 1
    fits = fit_classes(table, lambda r: str(r["gpu"]).split(" (")[0])
    assert list(dict.fromkeys(fits["group"])) == ["all", "A100-SXM 40GB", "B200", "H100-80GB"]
    whole = fits[fits["group"] == "all"]
    assert (whole["std_error"] > 0.01).all()
    # the truth (all 1) within four standard errors
    assert (abs(whole["factor"] - 1) < 4 * whole["std_error"]).all()


def test_the_split_gives_back_each_kernels_factor_and_the_rests() -> None:
    """Rows whose attention took 0.8x its simulated time on one kernel and head dimension
    and 1.0x on another, the rest 1.2x everywhere: each kernel group's split says so
    exactly; the GPU's group, mixing the two, cannot."""
    rng = np.random.default_rng(11)
    n = 24
    attention = rng.uniform(0.05, 0.9, n)
    shares = np.zeros((n, len(CLASSES)))
    shares[:, CLASSES.index("attention")] = attention
    shares[:, CLASSES.index("gemm")] = 1 - attention
    head_dim = np.array([128, 64] * (n // 2))
    table = _table(shares, np.ones(len(CLASSES)), ["tokens/s/GPU"] * n)
    scale = 1.2 * (1 - attention) + np.where(head_dim == 128, 0.8, 1.0) * attention
    table["measured"] = table["simulated"] / scale
    table["error"] = table["simulated"] / table["measured"] - 1
    table["attention"], table["head_dim"] = "flash2", head_dim
    split = fit_split(table, (lambda r: str(r["gpu"]), kernel_group)).set_index("group")
    assert list(split.columns) == list(SPLIT_COLUMNS)[1:]
    for group, attn in (("H100-80GB · flash2 · head dim 128", 0.8),
                        ("H100-80GB · flash2 · head dim 64", 1.0)):
        assert split.loc[group, "factor_attention"] == pytest.approx(attn, abs=1e-9)
        assert split.loc[group, "factor_rest"] == pytest.approx(1.2, abs=1e-9)
        assert split.loc[group, "mean_abs_error_after"] < 1e-9
    assert split.loc["H100-80GB", "mean_abs_error_after"] > 1e-3
    assert split.loc["all", "attention_share_min"] == pytest.approx(attention.min())
    line = split_line(split.reset_index())
    assert line is not None and line.startswith(
        f"attention kernels against the rest (least squares, {n} rows)")


def test_too_few_rows_or_no_shares_fit_nothing() -> None:
    rng = np.random.default_rng(1)
    few = _table(_shares(rng, 5), np.ones(5), ["tokens/s/GPU"] * 5)
    assert fit_classes(few).empty  # five classes need more than five rows
    assert fit_classes(few.drop(columns=list(SHARE_COLUMNS))).empty
    memory = _table(_shares(rng, 8), np.ones(5), ["peak_memory_GB"] * 8)
    assert fit_classes(memory).empty  # a memory figure is not a step's time
    assert fit_split(few.iloc[:2]).empty  # two factors need more than two rows
    same = few.copy()  # one attention share for every row: nothing to tell apart
    same[list(SHARE_COLUMNS)] = 0.0
    same["share_attention"], same["share_gemm"] = 0.3, 0.7
    split = fit_split(same).iloc[0]
    assert math.isnan(split["factor_rest"]) and math.isnan(split["factor_attention"])
    assert split["mean_abs_error_after"] == pytest.approx(split["mean_abs_error"])
    assert fit_split(few.drop(columns=list(SHARE_COLUMNS))).empty


@pytest.mark.parametrize(("unit", "measured", "simulated", "ratio"), [
    ("tokens/s/GPU", 100.0, 125.0, 1.25),  # simulated faster: the run took 1.25x as long
    ("seq/s", 2.0, 1.0, 0.5),
    ("MFU", 0.40, 0.50, 1.25),
    ("s/step", 3.0, 2.0, 1.5),
    ("step_time_s", 1.0, 2.0, 0.5),
])
def test_the_time_ratio_reads_each_unit_the_right_way_up(
        unit: str, measured: float, simulated: float, ratio: float) -> None:
    assert time_ratio(unit, measured, simulated) == pytest.approx(ratio)


@pytest.mark.parametrize(("unit", "measured", "simulated"), [
    ("peak_memory_GB", 50.0, 40.0), ("tokens/s/GPU", 0.0, 10.0),
    ("tokens/s/GPU", 10.0, math.nan)])
def test_no_time_ratio_without_a_time(unit: str, measured: float, simulated: float) -> None:
    assert math.isnan(time_ratio(unit, measured, simulated))


def test_a_share_is_the_elasticity_what_if_reports() -> None:
    [row] = [r for r in read_rows(DEV_SET)
             if r.name == "llmfoundry_h100_bf16_mpt1b_seq8192_8gpu_mbs3_ga4"]
    s = scenario_from_dict(scenario_data(row))
    results, _ = simulate_scenario(s, "analytic")
    step = results["step_time_s"]
    shares = step_shares(s, "analytic", step)
    classes = what_if(s, step, "analytic", None)["classes"]
    for name in COMPUTE_CLASSES:
        assert shares[f"share_{name}"] == pytest.approx(classes[name]["elasticity"], abs=1e-12)
    links = sum(classes[link]["elasticity"] for link in s.hardware.link_classes)
    assert shares["share_communication"] == pytest.approx(links, abs=1e-12)
    assert shares["share_communication"] > 0  # FSDP over the node's NVLink
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(-1e-9 <= v <= 1 for v in shares.values())
    assert shares["share_gemm"] > shares["share_memory"] > 0


def test_the_command_writes_the_class_fit(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rows = [r for r in csv.DictReader(io.StringIO(DEV_SET.read_text()))
            if "mpt125m" in r["name"] and r["gpus"] == "8"][:6]
    table = tmp_path / "runs.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    out = tmp_path / "out"
    assert main(["validate-runs", str(table), "--out", str(out), "--workers", "1",
                 "--no-plots", "--by-class"]) == 0
    printed = capsys.readouterr().out
    assert "by cost class, measured over simulated time (least squares, 6 rows)" in printed
    assert "attention kernels against the rest (least squares, 6 rows)" in printed
    runs = pd.read_csv(out / "runs.csv")
    assert np.allclose(runs[list(SHARE_COLUMNS)].sum(axis=1), 1.0)
    fits = pd.read_csv(out / "classes.csv")
    assert list(fits.columns) == list(FIT_COLUMNS) and fits["group"].iloc[0] == "all"
    assert "## By cost class" in (out / "runs.md").read_text()
    assert "## Attention against the rest" in (out / "runs.md").read_text()
    split = pd.read_csv(out / "split.csv")
    gpu = str(runs["gpu"].iloc[0]).split(" (")[0]  # one GPU's 125M rows, head dim 64
    assert list(split["group"]) == ["all", gpu, f"{gpu} · flash_triton · head dim 64"]
    assert set(runs["attention"]) == {"flash_triton"} and set(runs["head_dim"]) == {64}
    # without the flag: no shares, no classes.csv
    plain = tmp_path / "plain"
    assert main(["validate-runs", str(table), "--out", str(plain), "--workers", "1",
                 "--no-plots"]) == 0
    assert not (plain / "classes.csv").exists() and not (plain / "split.csv").exists()
    assert "share_gemm" not in pd.read_csv(plain / "runs.csv").columns
