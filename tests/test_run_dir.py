"""Run directories: checked before simulating, replaced as a set, never mixed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from small_scenario import SMALL

from simulator import api
from simulator.cli.main import main
from simulator.errors import UserError
from simulator.outputs.run_dir import MANIFEST, check_run_dir, default_out_dir, staged_run


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


def _strays(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.rglob("*")
                  if ".staging-" in p.name or p.name.endswith(".tmp") or "probe" in p.name)


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    return line


def test_bad_out_is_refused_before_simulating(small: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("simulated despite a bad --out")

    monkeypatch.setattr(api, "simulate_scenario", never)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, words in ((afile, "is an existing file"), (afile / "sub" / "out", "which is a file"),
                       (Path("/proc/clustersim-test/out"), "cannot be written")):
        assert main(["run", str(small), "--out", str(out)]) == 2
        assert words in _one_error(capsys)
    assert afile.read_text() == "x"


def test_second_run_replaces_the_first_as_a_set(small: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["run", str(small), "--out", str(out)]) == 0
    first = json.loads((out / MANIFEST).read_text())
    assert {"results.json", "trace.json", "timeline.png", "memory.png"} <= set(first["files"])
    check_run_dir(out)
    (out / "notes.txt").write_text("mine")  # a user's own file is left alone
    assert main(["run", str(small), "--out", str(out), "--method", "analytic",
                 "--no-plots"]) == 0
    second = json.loads((out / MANIFEST).read_text())
    assert set(second["files"]) == {"results.json", "report.html"}
    assert second["run_id"] != first["run_id"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "notes.txt",
                                                      "report.html", "results.json"]
    assert main(["plot", str(out)]) == 0  # draws breakdown and memory, adds them
    assert set(json.loads((out / MANIFEST).read_text())["files"]) == {
        "results.json", "breakdown.png", "memory.png", "report.html"}
    check_run_dir(out)
    assert _strays(tmp_path) == []


def test_plot_refuses_a_mixed_or_incomplete_directory(small: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    full, analytic = tmp_path / "full", tmp_path / "analytic"
    assert main(["run", str(small), "--out", str(full)]) == 0
    assert main(["run", str(small), "--out", str(analytic), "--method", "analytic",
                 "--no-plots"]) == 0
    capsys.readouterr()
    shutil.copy(full / "trace.json", analytic / "trace.json")  # a stale file of another run
    assert main(["plot", str(analytic)]) == 2
    assert "not part of the run" in _one_error(capsys)
    results = full / "results.json"
    results.write_text(results.read_text()[:-10])  # cut short
    assert main(["plot", str(full)]) == 2
    assert "differs from what manifest.json recorded" in _one_error(capsys)
    (full / MANIFEST).unlink()
    assert main(["plot", str(full)]) == 2
    assert "no manifest.json" in _one_error(capsys)


def test_interrupt_inside_the_writer_keeps_the_previous_run(
        small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    assert main(["run", str(small), "--out", str(out), "--no-plots"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "write_chrome_trace", interrupted)
    assert main(["run", str(small), "--out", str(out), "--no-plots"]) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    check_run_dir(out)
    assert _strays(tmp_path) == []
    fresh = tmp_path / "fresh"
    assert main(["run", str(small), "--out", str(fresh), "--no-plots"]) == 130
    assert not fresh.exists() and _strays(tmp_path) == []


def test_a_killed_runs_staging_directory_is_removed_by_the_next(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f".run.staging-{dead}-abc123"
    stale.mkdir()
    (stale / "timeline.csv").write_text("half")
    mine = tmp_path / f".run.staging-{os.getpid()}-def456"  # alive: not touched
    mine.mkdir()
    with staged_run(tmp_path / "run") as staging:
        (staging / "results.json").write_text("{}")
    assert not stale.exists() and mine.exists()
    assert json.loads((tmp_path / "run" / MANIFEST).read_text())["files"].keys() == {
        "results.json"}


@pytest.mark.parametrize(("name", "expected"), [
    ("gpt3-175b", "gpt3-175b"), ("../../somewhere", "somewhere"), ("/etc/passwd", "etc-passwd"),
    ("a b\tc", "a-b-c"), ("..", "run"), ("x" * 300, "x" * 100),
])
def test_default_out_dir_stays_under_out(name: str, expected: str) -> None:
    path = default_out_dir(name)
    assert path == Path("out") / expected and len(path.parts) == 2


def test_default_out_dir_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SMALL.replace("name: small", "name: ../../escaped"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["run", str(scenario), "--method", "analytic", "--no-plots"]) == 0
    assert (work / "out" / "escaped" / "results.json").is_file()
    assert not (tmp_path / "escaped").exists()


def test_run_dir_errors_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError):
        check_run_dir(tmp_path / "missing")
    (tmp_path / MANIFEST).write_text("[]")
    with pytest.raises(UserError):
        check_run_dir(tmp_path)
