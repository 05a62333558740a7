"""An interrupted calibration keeps what it measured; a busy machine between phases is said.

- Ctrl-C or SIGTERM: the measurements already taken stay in the results file, the one
  line says how many and how to resume, the exit status is 130 / 143; the same command
  run again says how many it reuses and measures each of the rest once. In process
  (a job signals its own process; fast) and through a real ``clustersim calibrate`` on
  CPU (slow: torch starts, then real kernels): in the GEMM phase, and in the two-rank
  terms measured after the collectives under torchrun.
- The reference GEMM timed before the first phase and after each: a reading more than
  15% from the first is a WARNING line naming the phase, and every reading goes to the
  profile's ``provenance.busy_guard``. With a deterministic timer (quiet and drifting;
  fast), and the readings of a real calibration (slow).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("torch")

from calibration.microbench import bench_terms
from calibration.microbench import calibrate as cal
from calibration.microbench.bench_jobs import Job, run_jobs
from calibration.microbench.bench_results import PARTIAL_KINDS, ResultsStore, read_records
from calibration.microbench.busy_guard import DRIFT_LIMIT, judge, read_between
from calibration.microbench.terms.registry import TERMS
from simulator.cli.main import main

#: ``clustersim`` in a process that takes Ctrl-C even where the tests run with SIGINT
#: ignored (a background job inherits that, and Python then installs no handler)
CLI = (sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
       "signal.default_int_handler); from simulator.cli.main import main; sys.exit(main())")
GEMM_ONLY = ("--skip", "attention", "--skip", "memory", "--skip", "collectives")


def _first_pass(path: Path) -> list[str]:
    """Keys of whole measurements as first taken (a recheck's or re-measure's left out)."""
    return [r["key"] for r in read_records(path)
            if r.get("kind") not in PARTIAL_KINDS and r.get("pass", 0) == 0]


def _whole(path: Path) -> set[str]:
    return {r["key"] for r in read_records(path) if r.get("kind") not in PARTIAL_KINDS}


# ---------------------------------------------------------------- the reference between phases


def _timer(ms: dict[str, float]) -> Any:
    """A deterministic reference: ``ms`` by phase (1 ms where not named)."""
    def reference(phase: str) -> dict[str, Any]:
        return {"kind": "reference", "phase": phase, "time_s": ms.get(phase, 1.0) * 1e-3,
                "spread": 0.01}
    return reference


def _phases(store: ResultsStore, names: tuple[str, ...], idle: tuple[str, ...] = ()) -> list[
        tuple[str, Any]]:
    """Phases that each append one record (those in ``idle``: none, as a resumed one)."""
    def run(name: str) -> Any:
        return lambda: None if name in idle else store.append({"key": name, "kind": "gemm",
                                                               "ok": True, "time_s": 1.0})
    return [(name, run(name)) for name in names]


def test_a_quiet_machine_reads_the_reference_after_each_phase_and_warns_not(
        tmp_path: Path) -> None:
    store = ResultsStore(tmp_path / "r.jsonl")
    said: list[str] = []
    readings = read_between(_phases(store, ("gemm", "attention", "memory"), idle=("attention",)),
                            _timer({"after gemm": 1.08, "after memory": 0.95}),
                            lambda: len(store.records()), said.append)
    # a phase that measured nothing (resumed whole) takes no reading
    assert [r["phase"] for r in readings] == ["start", "after gemm", "after memory"]
    assert said == []
    verdict = judge(readings, store.records())
    assert not verdict.busy and verdict.warning() is None
    assert verdict.drift == pytest.approx(0.08)  # the farthest reading from the first
    assert verdict.as_dict()["reference_ms"] == {"start": 1.0, "after gemm": 1.08,
                                                 "after memory": 0.95}


def test_a_reference_that_drifts_during_a_phase_is_said_at_once_naming_it(
        tmp_path: Path) -> None:
    store = ResultsStore(tmp_path / "r.jsonl")
    said: list[str] = []
    readings = read_between(_phases(store, ("gemm", "attention", "memory", "collectives")),
                            _timer({"after gemm": 1.05, "after memory": 1.3}),
                            lambda: len(store.records()), said.append)
    [line] = said  # at the reading after memory, not after the quiet collectives
    assert line.startswith("WARNING: the machine's speed changed by the end of memory")
    assert "1.000 ms at the start and 1.300 ms after memory (30% apart, limit 15%" in line
    assert "readings: start 1.000, after gemm 1.050, after attention 1.000, after memory " \
        "1.300 ms" in line and "\n" not in line
    verdict = judge(readings, store.records())
    assert verdict.busy and verdict.drift == pytest.approx(0.3) and DRIFT_LIMIT < 0.3
    warning = verdict.warning() or ""
    assert "after memory (30% apart" in warning and "after collectives 1.000" in warning
    assert verdict.as_dict()["reference_ms"]["after memory"] == 1.3


def test_nothing_measured_still_reads_the_reference_at_the_end(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path / "r.jsonl")
    readings = read_between(_phases(store, ("gemm",), idle=("gemm",)), _timer({"end": 2.0}),
                            lambda: len(store.records()), print)
    assert [r["phase"] for r in readings] == ["start", "end"]
    assert judge(readings, []).drift == pytest.approx(1.0)


# ---------------------------------------------------------------- interrupted, in process


def _cheap_jobs(kill_at: int | None) -> list[Job]:
    """Six GEMM jobs timed by a fixed clock; job ``kill_at`` sends this process SIGINT."""
    def runner(i: int) -> Any:
        def run() -> tuple[float, dict[str, Any]]:
            if i == kill_at:
                os.kill(os.getpid(), signal.SIGINT)
            return 1e-3 * (i + 1), {"spread": 0.01}
        return run
    meta = {"device": "cpu", "dtype": "fp32", "threads": 1}
    return [Job(f"cpu/fp32/t1/gemm/job{i}", "gemm", f"job {i}", 1e6 * (i + 1), "gemm", meta,
                runner(i)) for i in range(6)]


def test_ctrl_c_in_process_keeps_the_measurements_and_the_rerun_reuses_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], collector_paused: None) -> None:
    """The real signal, the real walk over jobs and results file; the jobs' kernels and the
    fit are stand-ins (the slow tests below run the real ones)."""
    kill_at: list[int | None] = [3]
    monkeypatch.setattr(bench_terms, "time_reference", lambda d, dt, b, phase: _timer({})(phase))
    monkeypatch.setattr(cal, "phases", lambda o, d, budget, store, n: [("gemm", lambda: run_jobs(
        "gemm", _cheap_jobs(kill_at[0]), store, budget, "flops"))])
    fitted: list[set[str]] = []
    monkeypatch.setattr(cal, "_fit_and_write", lambda o, b, store, *a: fitted.append(
        store.measured()) or o.out)
    out, results = tmp_path / "p.yaml", tmp_path / "p.results.jsonl"  # the default
    argv = ["calibrate", "--device", "cpu", "--tiny", "--out", str(out)]
    assert main(argv) == 130
    err = capsys.readouterr().err
    kept = _whole(results)
    assert kept == {f"cpu/fp32/t1/gemm/job{i}" for i in range(len(kept))} and len(kept) >= 3
    assert (f"interrupted (SIGINT): {len(kept)} measurements kept in {results} "
            f"({len(kept)} taken by this run), no profile written; run the same command "
            "again to measure only the rest") in err
    assert fitted == [] and not out.exists()
    kill_at[0] = None
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"resuming: {len(kept)} measurements already in {results} are reused" in err
    assert f"measured {6 - len(kept)} this run, reused {len(kept)}" in err
    assert Counter(_first_pass(results)) == Counter({f"cpu/fp32/t1/gemm/job{i}": 1
                                                     for i in range(6)})
    assert fitted == [{f"cpu/fp32/t1/gemm/job{i}" for i in range(6)}]


def test_what_a_resumed_run_reuses_counts_whole_measurements_it_skips(tmp_path: Path) -> None:
    """Rounds and recheck markers are parts, not measurements; a failure is reused unless
    --retry-failed measures it again."""
    path = tmp_path / "r.jsonl"
    store = ResultsStore(path)
    for rec in ({"key": "g1", "kind": "gemm", "ok": True}, {"key": "g2", "kind": "gemm",
                "ok": False, "error": "OOM"}, {"key": "c/round0", "kind": "collective_round",
                "ok": True}, {"key": "gemm#recheck1", "kind": "pass", "ok": True},
                {"key": "t", "kind": "send_sync", "ok": True}):
        store.append(rec)
    assert store.measured() == {"g1", "g2", "t"}
    assert ResultsStore(path, retry_failed=True).measured() == {"g1", "t"}


# ---------------------------------------------------------------- interrupted, a real process


def _calibrate(out: Path, *extra: str) -> subprocess.Popen[str]:
    """A real ``clustersim calibrate``; its stderr goes to ``out``'s ``.err`` file (a pipe
    nobody reads while it runs would fill and stall it)."""
    with out.with_suffix(".err").open("w") as err:
        return subprocess.Popen([*CLI, "calibrate", "--device", "cpu", "--tiny", "--nproc",
                                 "2", "--out", str(out), *extra],
                                stdout=subprocess.DEVNULL, stderr=err, text=True)


def _finish(proc: subprocess.Popen[str], out: Path, timeout_s: float) -> str:
    proc.wait(timeout=timeout_s)
    return out.with_suffix(".err").read_text()


def _signal_when(proc: subprocess.Popen[str], out: Path, sig: int, ready: Any) -> str:
    """Send ``sig`` once ``ready(records)`` holds; the process's stderr."""
    results = out.with_suffix(".results.jsonl")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if ready(read_records(results)):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the calibration ended before the signal"
    proc.send_signal(sig)
    return _finish(proc, out, 120)


def _check_interrupted(err: str, rc: int, status: int, sig: int, results: Path) -> set[str]:
    name = "SIGINT" if sig == signal.SIGINT else "SIGTERM"
    assert rc == status, err
    assert "Traceback" not in err
    kept = _whole(results)
    assert (f"interrupted ({name}): {len(kept)} measurements kept in {results} "
            f"({len(kept)} taken by this run), no profile written; run the same command "
            "again to measure only the rest") in err
    return kept


def _check_resumed(err: str, kept: set[str], results: Path) -> None:
    assert f"resuming: {len(kept)} measurements already in {results} are reused" in err
    first = Counter(_first_pass(results))
    assert max(first.values()) == 1  # nothing kept measured again, nothing twice
    assert kept <= _whole(results)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signalled_calibration_keeps_its_gemms_and_measures_only_the_rest(
        tmp_path: Path, sig: int, status: int) -> None:
    out = tmp_path / "p.yaml"
    results = out.with_suffix(".results.jsonl")
    proc = _calibrate(out, *GEMM_ONLY)
    err = _signal_when(proc, out, sig, lambda recs: len(recs) >= 5)
    kept = _check_interrupted(err, proc.returncode, status, sig, results)
    assert len(kept) >= 5 and not out.exists()
    rerun = _calibrate(out, *GEMM_ONLY)
    err = _finish(rerun, out, 600)
    assert rerun.returncode == 0, err
    _check_resumed(err, kept, results)
    new = len(_whole(results)) - len(kept)
    assert new > 0 and f"measured {new} this run, reused {len(kept)}" in err
    prov = yaml.safe_load(out.read_text())["provenance"]
    assert prov["samples"]["gemm"] > 0 and prov["samples"]["gemm_layout"] > 0


@pytest.mark.slow
def test_a_calibration_terminated_in_its_terms_resumes_every_kind(tmp_path: Path) -> None:
    """SIGTERM once the first two-rank term is in the results (GEMM, attention, memory and
    every collective before it): the rerun measures none of those again, only the terms
    left, and the profile has every kind."""
    out = tmp_path / "p.yaml"
    results = out.with_suffix(".results.jsonl")
    proc = _calibrate(out)
    err = _signal_when(proc, out, signal.SIGTERM,
                       lambda recs: any(r.get("kind") in TERMS for r in recs))
    kept = _check_interrupted(err, proc.returncode, 143, signal.SIGTERM, results)
    kinds = {r["kind"] for r in read_records(results) if r["key"] in kept}
    assert {"gemm", "gemm_layout", "attention", "attention_bwd", "memory", "overhead",
            "collective"} <= kinds
    rerun = _calibrate(out)
    err = _finish(rerun, out, 900)
    assert rerun.returncode == 0, err
    _check_resumed(err, kept, results)
    taken = [r for r in read_records(results) if r.get("kind") not in PARTIAL_KINDS
             and r["key"] not in kept]
    assert taken and {r["kind"] for r in taken} <= set(TERMS)  # only terms were left
    samples = yaml.safe_load(out.read_text())["provenance"]["samples"]
    assert all(samples[kind] > 0 for kind in TERMS), samples


# ---------------------------------------------------------------- a real calibration's readings


@pytest.mark.slow
def test_a_real_calibration_reads_the_reference_after_each_phase(tmp_path: Path) -> None:
    """Every reading goes to the profile and the summary, named by its phase. (Whether a
    real machine drifts is not asserted: the readings are medians over repeats, which a
    process sharing the core by time slices does not move here, pinned to one core even
    at nice -20; the timer tests above hold the warning.)"""
    out = tmp_path / "p.yaml"
    proc = _calibrate(out, "--skip", "collectives")
    err = _finish(proc, out, 600)
    assert proc.returncode == 0, err
    guard = yaml.safe_load(out.read_text())["provenance"]["busy_guard"]
    ms = guard["reference_ms"]
    assert list(ms) == ["start", "after gemm", "after attention", "after memory"]
    assert all(t > 0 for t in ms.values())
    assert guard["reference_start_ms"] == ms["start"]
    assert guard["reference_end_ms"] == ms["after memory"]
    assert guard["drift"] == pytest.approx(max(abs(t - ms["start"]) / min(t, ms["start"])
                                               for t in ms.values()), abs=1e-3)
    summary = next(line for line in err.splitlines() if "reference GEMM: start" in line)
    assert all(f"{phase} {t} ms" in summary for phase, t in ms.items())
