"""Generated hostile arguments and files for every command that takes them (sweep, plan,
train, diff, plot, ops): each invocation ends in exit 0 or 2 within the deadline of
:mod:`fuzz_cli`, with no traceback, every problem on one printable line, and nothing
half-written (no temporary file left, no final file from a refused run).

A few examples a command run by default; ``-m slow`` runs many more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fuzz_cli import run_one
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from small_scenario import SMALL

_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture,
                                                         HealthCheck.too_slow]}
QUICK = settings(max_examples=6, **_SETTINGS)  # type: ignore[arg-type]
SLOW = settings(max_examples=150, **_SETTINGS)  # type: ignore[arg-type]

NUMBER_TEXT = st.one_of(
    st.sampled_from(["0", "1", "-1", "2", "8", "²", "١٢", "1e3", "1e999", "nan", "inf", "",
                     " 4 ", "4.5", "0x10", "1_000", "99999999999999999999", "2000000000"]),
    st.integers(-10, 10**12).map(str),
    st.text(alphabet="0123456789,-.e²_ ", max_size=12),
)
LIST_TEXT = st.one_of(NUMBER_TEXT, st.lists(NUMBER_TEXT, min_size=1, max_size=70).map(",".join))
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(
                                ["step_time_s", "step_breakdown_s", "scenario", "compute",
                                 "critical_path_s", "method", "mfu", "x"]), inner, max_size=5)),
    max_leaves=20)


def check(case: dict[str, Any], root: Path) -> None:
    """Exit 0 or 2, one printable line per problem, no traceback, no temporary file."""
    err = case["stderr"]
    assert case["rc"] in (0, 2), case
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error")]
    assert case["rc"] == 0 or errors, case
    assert all(ln.isprintable() for ln in err.splitlines()), err
    assert len(errors) <= 12, errors
    assert not list(root.rglob("*.tmp")), list(root.rglob("*"))


def _scenario(root: Path) -> Path:
    path = root / "small.yaml"
    path.write_text(SMALL)
    return path


def _sweep(root: Path, grid: list[str], options: list[tuple[str, str]]) -> None:
    argv = ["sweep", str(_scenario(root)), "--no-cache", "--no-plots", "--out",
            str(root / "sw"), "--workers", "1"]
    for spec in grid:
        argv += ["--grid", spec]
    for flag, value in options:
        argv += [flag, value]
    case = run_one(argv)
    check(case, root)
    if case["rc"] == 2:
        assert not (root / "sw" / "sweep.csv").exists()


def _plan(root: Path, options: list[tuple[str, str]]) -> None:
    argv = ["plan", "--model", "tiny-gpt", "--gpus", "8", "--system", "dgx-a100-80gb",
            "--global-batch", "16", "--top", "0", "--no-cache", "--no-plots", "--workers", "1",
            "--max-candidates", "2000", "--out", str(root / "pl")]
    for flag, value in options:
        argv += [flag, value]
    case = run_one(argv)
    check(case, root)
    if case["rc"] == 2:
        assert not (root / "pl" / "plan.csv").exists()


def _train(root: Path, options: list[tuple[str, str]]) -> None:
    argv = ["train", str(_scenario(root)), "--method", "analytic", "--seeds", "2", "--no-plot",
            "--out", str(root / "tr")]
    if not any(flag == "--tokens" for flag, _ in options):
        argv += ["--tokens", "1e9"]
    for flag, value in options:
        argv += [flag, value]
    case = run_one(argv)
    check(case, root)
    if case["rc"] == 2:
        assert not (root / "tr" / "train.json").exists()


def _diff(root: Path, content: Any) -> None:
    run_dir = root / "run"
    run_dir.mkdir(exist_ok=True)
    data = content if isinstance(content, bytes) else json.dumps(content).encode()
    (run_dir / "results.json").write_bytes(data)
    case = run_one(["diff", str(run_dir), str(run_dir), "--no-plots", "--out",
                    str(root / "d")])
    check(case, root)


def _plot(root: Path, name: str, text: str) -> None:
    (root / name).write_text(text)
    check(run_one(["plot", str(root)]), root)


GRID = st.lists(st.tuples(st.sampled_from(["parallel.tp", "parallel.pp", "parallel.dp",
                                           "training.micro_batch", "x", "", "parallel"]),
                          LIST_TEXT).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1,
                max_size=4)
SWEEP_OPTIONS = st.lists(st.tuples(st.sampled_from(["--max-points", "--workers", "--dask"]),
                                   st.one_of(NUMBER_TEXT, st.sampled_from(
                                       ["local:²", "local:0", "tcp://", "local:"]))),
                         max_size=2)
PLAN_OPTIONS = st.lists(st.tuples(st.sampled_from(
    ["--micro-batches", "--context-parallel", "--expert-parallel", "--gpus", "--global-batch",
     "--seq-len", "--max-candidates", "--top"]), LIST_TEXT), min_size=1, max_size=3)
TRAIN_OPTIONS = st.lists(st.one_of(
    st.tuples(st.just("--tokens"), st.one_of(NUMBER_TEXT, st.sampled_from(
        ["1e17", "1e12", "1e15", "1e18", "1e19"]))),
    st.tuples(st.just("--checkpoint-interval"), st.one_of(NUMBER_TEXT, st.sampled_from(
        ["0.001", "1e-9", "auto", "young", "daly"]))),
    st.tuples(st.just("--set"), st.sampled_from(["reliability.gpu_mtbf_h", "reliability.restart_s",
                                                 "checkpoint.storage_write_GBps"]).flatmap(
        lambda key: NUMBER_TEXT.map(lambda v: f"{key}={v}"))),
    st.tuples(st.just("--max-events"), NUMBER_TEXT),
), min_size=1, max_size=3)
DIFF_CONTENT = st.one_of(JSON_VALUES, st.binary(max_size=64),
                         st.sampled_from([b"[" * 5000 + b"]" * 5000, b"1e400", b"-0",
                                          b'{"step_time_s": 1, "step_breakdown_s": {"a": 1e308}}']))
PLOT_FILES = st.tuples(st.sampled_from(["plan.csv", "sweep.csv", "train.json"]),
                       st.one_of(st.text(max_size=80), st.sampled_from(
                           ["fits,pareto\n1,2\n", "error,step_time_s\n,1\n,x\n",
                            "error,step_time_s,parallel.tp\n,1,1\n,2,2\n", "{}", "[]"])))


@QUICK
@given(grid=GRID, options=SWEEP_OPTIONS)
def test_sweep_arguments(tmp_path_factory: pytest.TempPathFactory, grid: list[str],
                         options: list[tuple[str, str]]) -> None:
    _sweep(tmp_path_factory.mktemp("sweep"), grid, options)


@QUICK
@given(options=PLAN_OPTIONS)
def test_plan_arguments(tmp_path_factory: pytest.TempPathFactory,
                        options: list[tuple[str, str]]) -> None:
    _plan(tmp_path_factory.mktemp("plan"), options)


@QUICK
@given(options=TRAIN_OPTIONS)
def test_train_arguments(tmp_path_factory: pytest.TempPathFactory,
                         options: list[tuple[str, str]]) -> None:
    _train(tmp_path_factory.mktemp("train"), options)


@QUICK
@given(content=DIFF_CONTENT)
def test_diff_files(tmp_path_factory: pytest.TempPathFactory, content: Any) -> None:
    _diff(tmp_path_factory.mktemp("diff"), content)


@QUICK
@given(file=PLOT_FILES)
def test_plot_files(tmp_path_factory: pytest.TempPathFactory, file: tuple[str, str]) -> None:
    _plot(tmp_path_factory.mktemp("plot"), *file)


@pytest.mark.slow
@SLOW
@given(grid=GRID, options=SWEEP_OPTIONS)
def test_sweep_arguments_long(tmp_path_factory: pytest.TempPathFactory, grid: list[str],
                              options: list[tuple[str, str]]) -> None:
    _sweep(tmp_path_factory.mktemp("sweep"), grid, options)


@pytest.mark.slow
@SLOW
@given(options=PLAN_OPTIONS)
def test_plan_arguments_long(tmp_path_factory: pytest.TempPathFactory,
                             options: list[tuple[str, str]]) -> None:
    _plan(tmp_path_factory.mktemp("plan"), options)


@pytest.mark.slow
@SLOW
@given(options=TRAIN_OPTIONS)
def test_train_arguments_long(tmp_path_factory: pytest.TempPathFactory,
                              options: list[tuple[str, str]]) -> None:
    _train(tmp_path_factory.mktemp("train"), options)


@pytest.mark.slow
@SLOW
@given(content=DIFF_CONTENT)
def test_diff_files_long(tmp_path_factory: pytest.TempPathFactory, content: Any) -> None:
    _diff(tmp_path_factory.mktemp("diff"), content)


@pytest.mark.slow
@SLOW
@given(file=PLOT_FILES)
def test_plot_files_long(tmp_path_factory: pytest.TempPathFactory,
                         file: tuple[str, str]) -> None:
    _plot(tmp_path_factory.mktemp("plot"), *file)
