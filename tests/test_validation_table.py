"""The validation table's writer: rows in, markdown and CSV out, atomically; and its
one calibration."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pytest

from calibration.measured.validation import _profile, set_aside
from calibration.measured.validation_configs import CPU_CONFIGS, configs_for
from calibration.measured.validation_table import markdown, write_table
from simulator.errors import UserError

HEADER = {"device": "cpu", "device_name": "test cpu", "threads": 1, "torch": "x",
          "profile": "p.yaml", "date": "2026-11-29", "micro_batches": 4,
          "micro_batch_size": 2, "steps": 8, "model": "small-gpt"}
ROWS = [
    {"config": "dp2-ddp", "tp": 1, "pp": 1, "dp": 2, "schedule": "1f1b", "zero": 0, "note": "",
     "measured_ms": 100.0, "simulated_ms": 90.0, "step_error": -0.1, "compute_error": 0.05,
     "idle_measured": 0.2, "idle_simulated": 0.1, "runs": 2, "repeat": 0.04},
    {"config": "tp2", "tp": 2, "pp": 1, "dp": 1, "schedule": "1f1b", "zero": 0,
     "note": "failed: boom"},
]


def test_configs_cover_the_issue_list() -> None:
    names = [c.name for c in CPU_CONFIGS]
    assert names == ["dp2-ddp", "dp2-powersgd", "pp2-gpipe", "pp2-1f1b", "tp2", "tp2-sp",
                     "fsdp2",
                     "ep2-moe", "cp2-allgather", "dp2-slow1x2", "pp2-1f1b-slow1x2"]
    sp = next(c for c in CPU_CONFIGS if c.name == "tp2-sp")
    assert (sp.tp, sp.sequence_parallel) == (2, True)
    assert not any(c.sequence_parallel for c in CPU_CONFIGS if c is not sp)
    assert len(configs_for("cuda", 8)) > len(configs_for("cuda", 2)) == len(CPU_CONFIGS)


def test_table_markdown_and_csv(tmp_path: Path) -> None:
    md = markdown(ROWS, HEADER)
    assert "| dp2-ddp | 100.0 | 90.0 | -10.0% | 2 | 4% | +5.0% | 20% | 10% | – |  |" in md
    assert "| tp2 | – | – | – | – | – | – | – | – | – | failed: boom |" in md
    assert "model small-gpt, 4 micro-batches of 2, median of 8 steps." in md  # no repeats
    two = markdown(ROWS, {**HEADER, "repeats": 2, "min_seconds": 20.0})
    assert ("4 micro-batches of 2, 2 runs back to back, the median of their pooled steps; "
            "each of 8 steps or more, spanning at least 20 s.") in two
    paths = write_table(tmp_path, ROWS, HEADER)
    assert [p.name for p in paths] == ["validation.csv", "validation.md"]
    rows = list(csv.DictReader((tmp_path / "validation.csv").open()))
    assert rows[0]["config"] == "dp2-ddp" and float(rows[0]["step_error"]) == -0.1
    assert (rows[0]["runs"], rows[0]["repeat"]) == ("2", "0.04")
    assert rows[1]["note"] == "failed: boom"
    assert not list(tmp_path.glob(".*tmp"))


def test_calibrating_once_goes_through_calibrate_and_keeps_its_problems(tmp_path: Path) -> None:
    """Without --profile the table calibrates with `calibrate`'s own flags and defaults
    (no detour through the CLI); calibrate's own one-line problems come first."""
    args = argparse.Namespace(profile=None, device="cpu", threads=0, tiny=True)
    with pytest.raises(UserError) as exc:
        _profile(args, tmp_path)
    lines = exc.value.lines()
    assert lines[0] == "--threads = 0: use 1 or more"
    assert "calibration failed" in lines[-1] and "--profile" in lines[-1]
    assert not (tmp_path / "profile-cpu.yaml").exists()


def test_two_models_get_one_table_each_with_their_mean_and_largest_error() -> None:
    from calibration.measured.validation_table import repeatability_sentence, summary

    small = [{**ROWS[0], "model": "small-gpt"},
             {**ROWS[0], "model": "small-gpt", "config": "tp2", "step_error": 0.02}]
    tiny = [{**ROWS[0], "model": "tiny-gpt", "step_error": -0.3}, {**ROWS[1], "model": "tiny-gpt"}]
    md = markdown(small + tiny, {**HEADER, "steps": {"small-gpt": 8, "tiny-gpt": 30},
                                 "min_seconds": 20.0})
    first, second = md.split("\n\nValidation on ")
    assert "model small-gpt" in first and "median of 8 steps or more, spanning at least 20 s" \
        in first
    assert "model tiny-gpt" in second and "median of 30 steps or more, spanning" in second
    assert "median of 8 steps." in markdown(small, {**HEADER, "steps": 8, "min_seconds": 0.0})
    assert "Mean |step error| 6.0% over 2 rows (target 5%: missed); largest 10.0% " \
        "(dp2-ddp); 0 row(s) over 10%. The runs of a row lay 4.0% apart" in first
    assert summary(tiny) == ("Mean |step error| 30.0% over 1 rows (target 5%: missed); "
                             "largest 30.0% (dp2-ddp); 1 row(s) over 10%."
                             + repeatability_sentence(tiny))
    assert summary([ROWS[1]]) == "No configuration ran."


def test_bad_model_or_profile_fail_before_any_run(tmp_path: Path) -> None:
    from calibration.measured.validation import check_profile
    from calibration.measured.validation_configs import models

    assert models("tiny-gpt, small-gpt,tiny-gpt") == ("tiny-gpt", "small-gpt")
    with pytest.raises(UserError) as exc:
        models("small-gpt,huge")
    assert exc.value.lines()[0].startswith("--model = 'small-gpt,huge': unknown model(s) ['huge']")
    with pytest.raises(UserError) as exc:
        check_profile(str(tmp_path / "nope.yaml"))
    line = exc.value.lines()[0]
    assert line.startswith("--profile = ") and "nor an existing profile" in line
    assert "drop --profile" in line
    check_profile(None)
    check_profile("cpu-1thread")


def test_step_spread_and_how_a_rows_runs_are_pooled(tmp_path: Path) -> None:
    from calibration.measured.validation_runs import Run, pool, pool_note, step_spread

    assert step_spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    # quartiles 2.0 and 3.0 (inclusive method) over the median 2.5
    assert step_spread([1.0, 2.0, 3.0, 4.0, 2.0, 3.0, 2.5]) == pytest.approx(0.4)
    a = Run(tmp_path / "a", (1.0, 1.0, 1.0, 1.0), 0.0)
    b = Run(tmp_path / "b", (1.2, 1.2, 1.2, 1.2), None)
    stolen = Run(tmp_path / "s", (2.0, 2.0), 0.35)
    both = pool([a, stolen, b])
    assert both.runs == (a, b) and both.set_aside == (stolen,)
    assert both.step_s == pytest.approx(1.1)  # the median of the eight pooled steps
    assert both.repeat == pytest.approx(0.2 / 1.1)  # the medians' gap over the pooled one
    assert both.spread == pytest.approx(0.2 / 1.1)  # quartiles 1.0 and 1.2
    assert both.steal == 0.0  # the pooled runs' largest; the stolen run is not one
    assert pool_note(both) == "steps scattered 18% (a busy machine); 1 run(s) set aside " \
        "for steal (35%)"
    one = pool([a])
    assert (one.step_s, one.repeat, pool_note(one)) == (1.0, None, "")
    worse = Run(tmp_path / "w", (3.0,), 0.5)
    least = pool([worse, stolen])  # every run stolen: the least stolen one alone
    assert least.runs == (stolen,) and least.set_aside == (worse,)
    assert pool_note(least) == "1 run(s) set aside for steal (50%); every run stolen, " \
        "kept the least"


def _fake_runs(monkeypatch: pytest.MonkeyPatch, runs: list[dict[str, object]]
               ) -> tuple[list[str], list[object], list[tuple[str, float | None]]]:
    import calibration.measured.compare as cmp
    import calibration.measured.measure as msr

    it = iter(runs)
    launched: list[str] = []
    spans: list[object] = []
    compared: list[tuple[str, float | None]] = []

    def fake_measure(*_: object, out_dir: str, **kw: object) -> dict[str, object]:
        launched.append(Path(out_dir).name)
        spans.append(kw["min_seconds"])
        return next(it)

    def fake_compare(run_dir: Path, profile: str, step_time_s: float | None = None
                     ) -> dict[str, object]:
        compared.append((run_dir.name, step_time_s))
        meas = {"step_time_s": step_time_s, "compute_s": 2.0, "idle_fraction": 0.1}
        sim = {**meas, "step_time_s": 1.0}
        return {"measured": meas, "simulated": sim, "relative_error": {
            "step_time_s": (1.0 - step_time_s) / step_time_s, "compute_s": 0.0}}

    monkeypatch.setattr(msr, "run_measure", fake_measure)
    monkeypatch.setattr(cmp, "run_compare", fake_compare)
    return launched, spans, compared


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"retries": 1, "micro_batches": 4, "steps": None,
                               "warmup": None, "device": "cpu", "threads": 1,
                               "timeout": 60.0, "micro_batch_size": 2}
    return argparse.Namespace(**{**base, **kw})


def test_each_configuration_runs_twice_and_their_pooled_median_is_compared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from calibration.measured.validation_runs import run_one

    launched, spans, compared = _fake_runs(monkeypatch, [
        {"step_times_s": [1.0, 1.0, 1.0, 1.0], "cpu_steal": 0.0},
        {"step_times_s": [1.2, 1.2, 1.2, 1.2], "cpu_steal": 0.01}])
    row = run_one(CPU_CONFIGS[0], _args(), "p.yaml", tmp_path / "dp2-ddp", "small-gpt")
    assert launched == ["dp2-ddp", "dp2-ddp-run2"]  # REPEATS on cpu, none stolen: no third
    assert spans == [20.0, 20.0]  # MIN_SECONDS on cpu, --min-seconds not given
    assert compared == [("dp2-ddp", pytest.approx(1.1))]  # the first run's trace
    assert row["measured_ms"] == pytest.approx(1100.0)
    assert (row["runs"], row["repeat"]) == (2, pytest.approx(0.2 / 1.1))
    assert row["cpu_steal"] == 0.01
    assert row["note"] == "steps scattered 18% (a busy machine)"


def test_a_stolen_run_is_set_aside_and_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from calibration.measured.validation_runs import run_one

    launched, _, compared = _fake_runs(monkeypatch, [
        {"step_times_s": [2.0, 2.0], "cpu_steal": 0.35},
        {"step_times_s": [1.0, 1.0], "cpu_steal": 0.0},
        {"step_times_s": [1.0, 1.0], "cpu_steal": 0.0}])
    row = run_one(CPU_CONFIGS[0], _args(), "p.yaml", tmp_path / "dp2-ddp", "small-gpt")
    assert launched == ["dp2-ddp", "dp2-ddp-run2", "dp2-ddp-run3"]
    assert compared == [("dp2-ddp-run2", 1.0)]
    assert (row["runs"], row["repeat"], row["cpu_steal"]) == (2, 0.0, 0.0)
    assert row["note"] == "1 run(s) set aside for steal (35%)"
    # --repeats 1 --retries 0: one run, kept however stolen, and no repeat figure
    launched, _, compared = _fake_runs(monkeypatch, [
        {"step_times_s": [2.0, 2.0], "cpu_steal": 0.35}])
    row = run_one(CPU_CONFIGS[0], _args(retries=0, repeats=1), "p.yaml",
                  tmp_path / "x", "small-gpt")
    assert launched == ["x"] and compared == [("x", 2.0)]
    assert (row["runs"], row["repeat"], row["cpu_steal"]) == (1, None, 0.35)
    assert row["note"] == "the hypervisor took 35% of the CPU (steal) during the run"


def test_the_summary_says_what_the_repeatability_alone_costs() -> None:
    from calibration.measured.validation_table import repeatability_sentence, summary

    rows = [{"config": "a", "step_error": 0.05, "runs": 2, "repeat": 0.08},
            {"config": "b", "step_error": -0.02, "runs": 2, "repeat": 0.04},
            {"config": "c", "note": "failed: x", "runs": 2, "repeat": 0.5}]
    text = repeatability_sentence(rows)
    assert text == (" The runs of a row lay 6.0% apart on average (largest 8%): the "
                    "measurement's own repeatability; from it alone a simulator without "
                    "error would read a mean |step error| of about 3.0%, more with the "
                    "machine's drift since the calibration.")
    assert text in summary(rows)
    three = [{**rows[0], "runs": 3}]  # the half holds for two runs only
    assert repeatability_sentence(three).endswith("the measurement's own repeatability.")
    assert repeatability_sentence([{"config": "a", "step_error": 0.1, "repeat": None}]) == ""


def test_an_earlier_runs_results_are_set_aside_not_resumed(tmp_path: Path) -> None:
    """The calibration resumes from its results file: one left by an earlier validation
    in the same directory would give this run that run's measurements (found on
    2026-12-04: a run into an old directory skipped every GEMM as 'already in
    results' and simulated with a profile of five hours before)."""
    old = tmp_path / "profile-cpu.results.jsonl"
    old.write_text('{"key": "cpu/fp32/t1/gemm/8x32x32"}\n')
    (tmp_path / "recheck.results.jsonl").write_text("{}\n")
    moved = set_aside(tmp_path, ["profile-cpu.results.jsonl", "recheck.results.jsonl",
                                 "absent.jsonl"])
    assert not old.exists() and not (tmp_path / "recheck.results.jsonl").exists()
    assert [p.name.split(".")[0:2] for p in moved] == [["profile-cpu", "results"],
                                                       ["recheck", "results"]]
    assert all(p.name.endswith(".old") and p.exists() for p in moved)
    assert moved[0].read_text() == '{"key": "cpu/fp32/t1/gemm/8x32x32"}\n'
    assert set_aside(tmp_path, ["profile-cpu.results.jsonl"]) == []


def test_a_bad_min_seconds_or_repeats_fails_before_any_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--min-seconds`` below 0 or past the launch timeout, or ``--repeats`` outside
    1..5, is one line, exit 2, and nothing runs (no calibration, no directory)."""
    pytest.importorskip("torch")
    from simulator.cli.main import main

    out = tmp_path / "val"
    for bad in ("-1", "700"):
        assert main(["validation", "--device", "cpu", "--out", str(out), "--min-seconds",
                     bad, "--timeout", "600"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--min-seconds" in err[0] and bad in err[0]
    for bad in ("0", "6"):
        assert main(["validation", "--device", "cpu", "--out", str(out), "--repeats",
                     bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: --repeats = {bad}: use 1 to 5 runs per configuration"]
    assert not out.exists()
