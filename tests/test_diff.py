"""clustersim diff: two run directories side by side, on real engine and analytic output."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from simulator.analysis.accounting.vocabulary import CATEGORIES
from simulator.api import simulate_scenario, write_outputs
from simulator.cli.main import main
from simulator.errors import UserError
from simulator.outputs.diff import diff_lines, load_run, run_diff, waterfall
from simulator.outputs.plots.diff import waterfall_figure
from simulator.spec.load import load_scenario

REL = 1e-9
SMALL = """\
name: {name}
model: {{preset: tiny-gpt}}
cluster: {{system: dgx-a100-80gb, nodes: 1, gpus_per_node: 8}}
parallel: {parallel}
training: {{global_batch: 16, micro_batch: 1, dtype: bf16}}
"""
SCENARIOS = {
    "tp2pp2dp2": "{tp: 2, pp: 2, dp: 2, schedule: 1f1b}",
    "pp4-gpipe": "{tp: 1, pp: 4, dp: 2, schedule: gpipe}",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Run directories: two scenarios by the engine, the first also by the analytic method."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, parallel in SCENARIOS.items():
        path = root / f"{name}.yaml"
        path.write_text(SMALL.format(name=name, parallel=parallel))
        for method in ("engine", "analytic"):
            results, spans = simulate_scenario(load_scenario(path), method)
            out[f"{name}-{method}"] = root / f"{name}-{method}"
            write_outputs(out[f"{name}-{method}"], results, spans, plots=False)
    return out


def read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.mark.parametrize(("a", "b"), [("tp2pp2dp2-engine", "pp4-gpipe-engine"),
                                      ("pp4-gpipe-engine", "tp2pp2dp2-engine"),
                                      ("tp2pp2dp2-engine", "tp2pp2dp2-analytic"),
                                      ("pp4-gpipe-analytic", "tp2pp2dp2-engine")])
def test_diff_adds_up_on_real_runs(runs: dict[str, Path], tmp_path: Path, a: str, b: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    assert main(["diff", str(runs[a]), str(runs[b]), "--out", str(out)]) == 0
    diff = read(out / "diff.json")
    ra, rb = read(runs[a] / "results.json"), read(runs[b] / "results.json")
    assert diff["step_time_s"] == {"a": ra["step_time_s"], "b": rb["step_time_s"],
                                   "delta": rb["step_time_s"] - ra["step_time_s"]}
    assert diff["memory_peak_bytes"]["delta"] == rb["memory_peak_bytes"] - ra["memory_peak_bytes"]
    assert list(diff["categories"])[:len(CATEGORIES)] == list(CATEGORIES)
    for name, row in diff["categories"].items():
        assert row["a"] == ra["step_breakdown_s"].get(name, 0.0)
        assert row["b"] == rb["step_breakdown_s"].get(name, 0.0)
    bars = waterfall(diff)
    assert bars[0].end == ra["step_time_s"] and bars[-1].end == rb["step_time_s"]
    for before, after in itertools.pairwise(bars[:-1]):
        assert after.start == before.end  # each change starts where the last one ended
    assert bars[-2].end == pytest.approx(rb["step_time_s"], rel=REL)  # the waterfall lands on B
    assert (out / "diff.png").stat().st_size > 10_000
    # the drawn bars are those bars: each change's rectangle spans its delta, and the
    # last one ends on B's step (in the axis' unit)
    rects = waterfall_figure(diff, bars).axes[0].patches
    assert len(rects) == len(bars)
    scale = rects[-1].get_width() / rb["step_time_s"]
    for rect, bar in zip(rects, bars, strict=True):
        assert rect.get_width() == pytest.approx(abs(bar.end - bar.start) * scale, rel=REL)
        assert rect.get_x() == pytest.approx(min(bar.start, bar.end) * scale, rel=REL)
    printed = capsys.readouterr().out
    assert "step time" in printed and "peak memory per GPU" in printed


def test_table_shows_the_categories_either_run_spends_time_in(runs: dict[str, Path]) -> None:
    a = load_run(runs["tp2pp2dp2-engine"], "RUN_A")
    b = load_run(runs["pp4-gpipe-engine"], "RUN_B")
    diff = run_diff(a, b, runs["tp2pp2dp2-engine"], runs["pp4-gpipe-engine"])
    text = "\n".join(diff_lines(diff))
    used = [n for n, r in diff["categories"].items() if r["a"] or r["b"]]
    assert "forward" in used and "tp_transfer" in used  # B has no TP, A does
    assert diff["categories"]["tp_transfer"]["b"] == 0.0
    assert "tp transfer" in text
    unused = len(diff["categories"]) - len(used)
    assert f"({unused} categories are zero in both runs" in text


def test_a_category_only_one_run_has_counts_as_zero_in_the_other() -> None:
    a = {"step_time_s": 3.0, "step_breakdown_s": {"forward": 1.0, "backward_input": 2.0}}
    b = {"step_time_s": 4.0, "step_breakdown_s": {"forward": 1.5, "new_kind_wait": 2.5}}
    diff = run_diff(a, b)
    assert diff["categories"]["new_kind_wait"] == {"a": 0.0, "b": 2.5, "delta": 2.5}
    assert diff["categories"]["backward_input"] == {"a": 2.0, "b": 0.0, "delta": -2.0}
    assert list(diff["categories"])[-1] == "new_kind_wait"
    assert [bar.label for bar in waterfall(diff)] == ["A", "forward", "backward input",
                                                      "new kind wait", "B"]
    assert waterfall(diff)[-2].end == 4.0


def _corrupt(root: Path) -> dict[str, tuple[Path, str]]:
    """Broken run directories and the words their error must contain."""
    cases = {"missing": (root / "nope", "is not a directory"),
             "empty": (root / "empty", "has no results.json")}
    (root / "empty").mkdir()
    for name, text, words in (("truncated", '{"step_time_s": 1.', "not valid JSON"),
                              ("list", "[1, 2]", "has no step_time_s"),
                              ("nan", '{"step_time_s": NaN}', "not a number JSON allows"),
                              ("old", '{"step_time_s": 1.0}', "has no step_breakdown_s")):
        (root / name).mkdir()
        (root / name / "results.json").write_text(text)
        cases[name] = (root / name, words)
    return cases


def test_broken_run_directories_are_one_line_errors(runs: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    good = str(runs["tp2pp2dp2-engine"])
    for path, words in _corrupt(tmp_path).values():
        for argv, which in (([str(path), good], "RUN_A"), ([good, str(path)], "RUN_B")):
            assert main(["diff", *argv, "--out", str(tmp_path / "o")]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"error: {which} = ")
            assert words in err[0]
    assert not (tmp_path / "o").exists()
    with pytest.raises(UserError):
        load_run(tmp_path / "old", "RUN_A")


def test_broken_run_exits_2_without_traceback(runs: dict[str, Path], tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "simulator.cli", "diff",
                           str(runs["tp2pp2dp2-engine"]), str(tmp_path / "nope")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
