"""CLI behaviour: exit codes, one-line errors, outputs, atomic writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from small_scenario import SMALL

from simulator import api
from simulator.cli.main import main

KEYS = {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu",
        "hfu", "bubble_fraction", "memory_peak_bytes", "fits_in_memory", "method", "scenario",
        "exposed_comm_s", "compute_s", "fidelity", "sim_wall_s", "sim_events"}


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


def test_validate_ok(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(small)]) == 0
    assert "ok" in capsys.readouterr().out


def test_validate_broken_one_line_per_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMALL.replace("tp: 2,", "tp: 3, tpp: 1,").replace("global_batch: 16",
                                                                     "global_batch: -4"))
    proc = subprocess.run([sys.executable, "-m", "simulator.cli", "validate", str(bad)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and all(x.startswith("error: ") for x in lines)
    assert "Traceback" not in proc.stderr
    assert any("parallel.tpp" in x and "did you mean 'tp'" in x for x in lines)
    assert any("training.global_batch = -4" in x for x in lines)


def test_not_yaml_and_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    assert main(["validate", str(bad)]) == 2
    assert "invalid YAML at line" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2


def test_run_writes_outputs(small: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["run", str(small), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results.keys() >= KEYS
    assert results["method"] == "engine" and results["scenario"]["parallel"]["tp"] == 2
    for name in ("timeline.parquet", "trace.json", "timeline.png", "breakdown.png",
                 "memory.png"):
        assert (out / name).stat().st_size > 0
    assert not (out / "timeline.csv").exists()  # CSV only on request
    trace = json.loads((out / "trace.json").read_text())
    assert trace["traceEvents"]
    assert trace["otherData"]["ranks"] == [0, 4]  # folded: the one simulated rank per stage
    assert "step time" in capsys.readouterr().out


def test_run_full_fidelity_outputs_agree(small: Path, tmp_path: Path) -> None:
    """A full run's timeline (both formats), trace and plots describe the same spans."""
    out = tmp_path / "out"
    assert main(["run", str(small), "--out", str(out), "--fidelity", "full",
                 "--timeline", "both", "--trace-ranks", "0,1,4"]) == 0
    from simulator.outputs.timeline_files import read_timeline

    parquet = read_timeline(out / "timeline.parquet")
    csv = read_timeline(out / "timeline.csv")
    assert sorted(set(parquet["rank"])) == list(range(8)) and len(parquet) == len(csv)
    assert (parquet["end"] == csv["end"]).all() and (parquet["task"] == csv["task"]).all()
    results = json.loads((out / "results.json").read_text())
    assert parquet["end"].max() == results["step_time_s"]
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    assert trace["otherData"]["ranks"] == [0, 1, 4]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 4}
    spans_x = sum(1 for e in events if e["ph"] == "X")
    assert spans_x == parquet["rank"].isin([0, 1, 4]).sum()
    assert {e["name"] for e in events if e["ph"] == "C"} == {"memory", "link"}
    assert {e["name"] for e in events if e["ph"] == "s"} >= {"pp", "tp"}
    assert main(["plot", str(out)]) == 0


def test_run_rejects_bad_trace_ranks(small: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    assert main(["run", str(small), "--out", str(out), "--trace-ranks", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: --trace-ranks = '1': rank(s) 1 not simulated; simulated ranks: 0, 4" in err
    assert main(["run", str(small), "--out", str(out), "--trace-ranks", "x,y"]) == 2
    assert "use all, stages, or ranks such as 0,5,17" in capsys.readouterr().err
    assert not out.exists()


def test_run_set_goes_through_validation(small: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    assert main(["run", str(small), "--set", "parallel.tp=3", "--out", str(out)]) == 2
    assert "parallel.tp = 3" in capsys.readouterr().err
    assert not out.exists()
    assert main(["run", str(small), "--set", "parallel.schedule=gpipe", "--method", "analytic",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["method"] == "analytic"
    assert results["scenario"]["parallel"]["schedule"] == "gpipe"


def test_interrupted_run_leaves_no_results(small: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "results.json").write_text('{"old": true}')

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(api.json, "dumps", boom)
    assert main(["run", str(small), "--out", str(out), "--no-plots"]) == 130
    assert json.loads((out / "results.json").read_text()) == {"old": True}
    assert not list(out.glob(".results.json*"))


def test_memory_presets_schema(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", str(small)]) == 0
    assert "optimizer" in capsys.readouterr().out
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "llama3-405b" in out and "dgx-h200" in out
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "parallel" in schema["properties"]


def test_plot_redraws(small: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert main(["run", str(small), "--out", str(out), "--no-plots"]) == 0
    assert not (out / "timeline.png").exists()
    assert main(["plot", str(out)]) == 0
    assert (out / "timeline.png").exists()
    assert main(["plot", str(tmp_path / "empty")]) == 2


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("run", "validate", "memory", "presets", "schema", "plot"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "example" in capsys.readouterr().out


def test_core_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import simulator.cli.main, simulator.api, simulator.engine.engine, calibration\n"
            "assert simulator.cli.main.main(['presets']) == 0\n"
            "assert simulator.cli.main.main(['validation', '--out', 'x']) == 2\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.stdout.strip().endswith("ok"), proc.stderr
    assert "needs PyTorch" in proc.stderr


def test_run_with_a_calibrated_profile_by_relative_path(tmp_path: Path) -> None:
    """A calibrated profile is a drop-in: `cluster.system: profile.yaml`, relative to the
    scenario file, and the run uses its numbers (its calibrated collective table)."""
    import shutil

    repo = Path(__file__).resolve().parent.parent
    shutil.copy(repo / "calibration/profiles/cpu-epyc-1thread.yaml", tmp_path / "cpu.yaml")
    scen = tmp_path / "s.yaml"
    scen.write_text(SMALL.replace("system: dgx-a100-80gb, nodes: 1, gpus_per_node: 8",
                                  "system: cpu.yaml, nodes: 4, gpus_per_node: 2")
                    .replace("dtype: bf16", "dtype: fp32"))
    out = tmp_path / "o"
    assert main(["run", str(scen), "--out", str(out), "--no-plots"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["hardware"]["name"] == "cpu-epyc-1thread"
    assert results["hardware"]["collectives"]["all_reduce"]["intra_node"]["busbw_GBps"] > 0


def test_a_closed_pipe_is_no_traceback() -> None:
    """``clustersim schema | head -1``: the reader leaves early; no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "simulator.cli", "schema"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the schema is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141)
    assert "Traceback" not in err, err
