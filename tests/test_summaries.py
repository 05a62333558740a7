"""Summaries a person reads: every category above 2% in one order on both lines, the
wall time by phase, percentage points in diff, and progress bars only on a terminal
and only for what takes a while."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from small_scenario import SMALL

from simulator.analysis.accounting.vocabulary import categories, label
from simulator.analysis.report import SHOWN_SHARE, shares_text
from simulator.cli.main import main
from simulator.outputs.diff import diff_lines
from simulator.outputs.progress import BAR_DELAY_S, progress_bar


def _named(text: str) -> list[str]:
    """The categories a summary line names, in its order."""
    names = {label(c): c for c in categories()}
    found = [(text.find(f"{n} "), c) for n, c in names.items() if f"{n} " in text]
    # a label inside a longer one ("tp transfer" in no other) would be found twice
    return [c for _, c in sorted(found)]


def test_every_category_at_or_above_the_threshold_in_vocabulary_order() -> None:
    step = 10.0
    seconds = {"tail": 0.3, "forward": 2.0, "tp_transfer": 1.5, "backward_input": 3.0,
               "pipeline_bubble": 0.25, "optimizer": 0.19, "dp_wait": 0.1, "recompute": 0.2,
               "backward_weight": 2.46}
    text = shares_text(seconds, step)
    shown = [c for c in categories() if seconds.get(c, 0) >= SHOWN_SHARE * step]
    assert _named(text) == shown  # six, not the four largest, and not by size
    assert len(shown) == 7 and text.endswith("(others 2.9%)")  # optimizer 1.9% + dp wait 1%
    assert f"{label('tail')} 3.0%" in text


def test_run_summary_lines_share_one_order(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    out = tmp_path / "o"
    assert main(["run", str(path), "--no-plots", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    step = results["step_time_s"]
    lines = text.splitlines()
    # a wrapped row continues on lines indented under its value
    rows: dict[str, str] = {}
    key = ""
    for line in lines:
        if line.startswith(" "):
            rows[key] += "  " + line.strip()
        else:
            key = line[:22].strip()
            rows[key] = line[22:]
    for row, source in (("where the step goes", "step_breakdown_s"),
                        ("critical path", "critical_path_s")):
        expected = [c for c in categories() if results[source].get(c, 0) >= SHOWN_SHARE * step]
        assert _named(rows[row]) == expected, row
    wall = rows["wall time"].split()
    assert wall[0::3][:3] == ["build", "simulate", "write"]
    assert sum(float(x) for x in wall[1:9:3]) == pytest.approx(float(wall[-2]), abs=0.02)


def test_diff_gives_percentage_points() -> None:
    diff = {"runs": {r: {"dir": r, "scenario": r, "method": "engine"} for r in "ab"},
            "step_time_s": {"a": 2.0, "b": 1.5, "delta": -0.5},
            "mfu": {"a": 0.4718, "b": 0.5455, "delta": 0.0737},
            "bubble_fraction": {"a": 0.2117, "b": 0.0933, "delta": -0.1184},
            "categories": {}}
    lines = diff_lines(diff)
    mfu = next(ln for ln in lines if ln.startswith("MFU"))
    bubble = next(ln for ln in lines if ln.startswith("bubble fraction"))
    assert mfu.split()[1:] == ["47.18%", "54.55%", "+7.37", "pp"]
    assert bubble.endswith("-11.84 pp")


def test_progress_bars_only_on_a_terminal_and_after_a_delay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    with progress_bar(10, "points") as bar:
        assert bar.disable  # not a terminal
        bar.update(10)
    assert pipe.getvalue() == ""
    assert BAR_DELAY_S == 2.0

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    monkeypatch.setattr("sys.stderr", tty)
    with progress_bar(10, "points") as bar:
        assert not bar.disable  # a terminal: a bar ...
        bar.update(10)  # ... but done at once, under the delay: never drawn
    assert tty.getvalue() == ""


@pytest.mark.parametrize(("system", "factor"), [("dgx-a100-80gb", 1.01538), ("dgx-h100", 1.0)])
def test_the_summary_says_how_much_the_slowest_rank_costs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], system: str, factor: float) -> None:
    """results.json carries the rank stretch every op was charged (the A100 presets'
    population curve at 8 GPUs, +1.538%) and its term; the summary names it where it is
    above 1 and says nothing where the profile has no spread."""
    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("dgx-a100-80gb", system))
    out = tmp_path / "o"
    assert main(["run", str(path), "--no-plots", "--out", str(out), "--method", "analytic"]) == 0
    text = capsys.readouterr().out
    stretch = json.loads((out / "results.json").read_text())["rank_stretch"]
    assert stretch["factor"] == pytest.approx(factor) and stretch["ranks"] == 8
    if factor > 1:
        assert stretch["term"] == "rank_excess"
        assert "slowest rank          every op 1.015× as long: the slowest of 8 GPUs " \
            "(gpu.rank_excess)" in text
    else:
        assert stretch["term"] is None and "slowest rank" not in text
