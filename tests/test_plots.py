"""Figures from a run's files: valid PNGs, what the timeline shows, breakdown arithmetic."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import matplotlib.colors
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from simulator.api import simulate_scenario, write_outputs
from simulator.outputs.plots.breakdown import breakdown_figure, breakdown_segments, plot_breakdown
from simulator.outputs.plots.common import KIND_COLOURS, PATH_COLOUR, category_style
from simulator.outputs.plots.memory import memory_figure, plot_memory
from simulator.outputs.plots.run import plot_all
from simulator.outputs.plots.timeline import categorised, plot_timeline, timeline_figure
from simulator.outputs.timeline_files import read_timeline
from simulator.schedules.action import execute
from simulator.schedules.registry import build_schedule
from simulator.spec.load import scenario_from_dict

MS = 1e-3
GIB = 1e9  # plots use decimal GB, as the CLI
KIND = {"F": "forward", "B": "backward", "I": "backward", "W": "weight_grad"}


def schedule_run(name: str = "gpipe", p: int = 2, m: int = 2, v: int = 1
                 ) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Spans and results of a toy run: the schedule oracle's times (F = 1 ms, B = 2 ms)."""
    schedule = build_schedule(name, p, m, v)
    timed = execute(schedule, t_f=1.0, t_b=2.0, comm=0.1)
    rows = []
    for t in timed:
        a = t.action
        rows.append({"rank": t.rank, "stage": t.rank, "stream": "compute", "op": a.kind,
                     "kind": KIND[a.kind], "microbatch": a.microbatch,
                     "chunk": schedule.chunk_of(a.stage), "start": t.start * MS,
                     "end": t.end * MS})
        rows.append({"rank": t.rank, "stage": t.rank, "stream": "pp", "op": "pp.send",
                     "kind": "pp", "microbatch": a.microbatch, "start": t.end * MS,
                     "end": (t.end + 0.1) * MS, "bytes": 1e7})
    end = max(t.end for t in timed)
    for r in range(p):
        rows.append({"rank": r, "stage": r, "stream": "dp", "op": "dp.all_reduce", "kind": "dp",
                     "start": (end - 1) * MS, "end": (end + 0.5) * MS, "bytes": 1e9})
        rows.append({"rank": r, "stage": r, "stream": "compute", "op": "optimizer",
                     "kind": "optimizer", "start": (end + 0.5) * MS, "end": (end + 1) * MS})
    spans = pd.DataFrame(rows)
    busy = spans[spans["kind"].isin(KIND.values())]
    phase = [float(busy["start"].min()), float(busy["end"].max())]
    per_stage = [1 - float((g["end"] - g["start"]).sum()) / (phase[1] - phase[0])
                 for _, g in busy.groupby("stage")]
    results = {
        "step_time_s": (end + 1) * MS, "bubble_fraction": float(np.mean(per_stage)),
        "bubble_fraction_per_stage": per_stage, "pipeline_phase_s": phase,
        "compute_s": [float((g["end"] - g["start"]).sum()) for _, g in busy.groupby("stage")],
        "exposed_comm_s": {"tp": 0.0, "pp": 0.1 * MS, "dp": [0.5 * MS] * p, "zero": 0.0},
        "memory_peak_bytes": 60 * GIB, "fits_in_memory": True,
        "memory": [{"stage": s, "weights": 10 * GIB, "gradients": 10 * GIB,
                    "optimizer": 20 * GIB, "activations": (p - s) * 5 * GIB, "logits": 0,
                    "comm_buffers": GIB, "total": (41 + (p - s) * 5) * GIB,
                    "capacity": 80 * GIB} for s in range(p)],
        "method": "engine", "fidelity": "folded",
        "scenario": {"name": f"toy-{name}", "parallel": {"tp": 1, "pp": p, "dp": 1,
                                                         "schedule": name}},
    }
    return spans, results


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (asserting the file is a PNG)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def texts(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def legend_labels(fig: Figure) -> list[str]:
    legends = list(fig.legends) + [ax.legend_ for ax in fig.axes if ax.legend_ is not None]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def engine_run(out: Path, schedule: str = "1f1b", v: int = 1, p: int = 4, m: int = 8,
               method: str = "engine") -> dict[str, Any]:
    """A real (small) run's files in ``out``: results.json and, for the engine, the
    timeline, as ``clustersim run --no-plots`` writes them."""
    s = scenario_from_dict({
        "name": f"small-{schedule}", "model": {"preset": "tiny-gpt", "layers": 4 * v * p // 2},
        "cluster": {"system": "dgx-a100-80gb", "nodes": 1},
        "parallel": {"tp": 2, "pp": p, "dp": 1, "schedule": schedule, "virtual_stages": v},
        "training": {"global_batch": m, "micro_batch": 1},
    })
    results, spans = simulate_scenario(s, method=method)
    write_outputs(out, results, spans, plots=False)
    return results


@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_plot_all_writes_three_valid_pngs(tmp_path: Path, name: str, v: int) -> None:
    engine_run(tmp_path, name, v)
    before = {p.name for p in tmp_path.iterdir()}
    paths = plot_all(tmp_path)
    assert [p.name for p in paths] == ["timeline.png", "breakdown.png", "memory.png"]
    for path in paths:
        width, height = png_size(path)
        assert 400 <= width <= 4000 and 300 <= height <= 6000
        assert 10_000 < path.stat().st_size < 5_000_000
    assert {p.name for p in tmp_path.iterdir()} == before | {p.name for p in paths}
    assert plt.get_fignums() == []  # pyplot never saw these figures


def test_plot_all_without_a_timeline_draws_the_rest(tmp_path: Path) -> None:
    engine_run(tmp_path, method="analytic")
    assert [p.name for p in plot_all(tmp_path)] == ["breakdown.png", "memory.png"]
    with pytest.raises(FileNotFoundError, match=r"results\.json"):
        plot_all(tmp_path / "missing")
    spans, _ = schedule_run()
    path = plot_timeline(spans.iloc[:0], None, tmp_path / "timeline.png")
    png_size(path)


@pytest.mark.parametrize("method", ["engine", "analytic"])
@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                         ("zb-h1", 1)])
def test_breakdown_bars_add_up_to_the_step(tmp_path: Path, name: str, v: int,
                                           method: str) -> None:
    """On real output: every stage's bar is exactly the step time (a partition, no
    clamp), and its drawn rectangles stack to the same height."""
    results = engine_run(tmp_path, name, v, method=method)
    segments = breakdown_segments(results)
    total = sum(segments.values())
    np.testing.assert_allclose(total, [results["step_time_s"]] * 4, rtol=1e-9)
    fig = breakdown_figure(results)
    ax = fig.axes[0]
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    scale = {"s": 1.0, "ms": 1e3, "µs": 1e6}[ax.get_ylabel().split("(")[1].rstrip(")")]
    np.testing.assert_allclose(sorted(tops.values()), [results["step_time_s"] * scale] * 4,
                               rtol=1e-9)


def test_breakdown_needs_the_accounting() -> None:
    _, results = schedule_run()
    with pytest.raises(ValueError, match="time_breakdown_s"):
        breakdown_segments(results)


def test_breakdown_figure_labels_bubbles(tmp_path: Path) -> None:
    results = engine_run(tmp_path, "gpipe")
    fig = breakdown_figure(results)
    assert sum("bubble\n" in t for t in texts(fig)) == 4
    assert "pipeline bubble" in legend_labels(fig)
    assert "tp transfer" in legend_labels(fig)
    png_size(plot_breakdown(results, tmp_path / "breakdown.png"))


def test_timeline_draws_the_critical_path_and_peer_waits(tmp_path: Path) -> None:
    results = engine_run(tmp_path, "1f1b")
    spans = read_timeline(tmp_path)
    assert (spans["comm_start"] >= spans["start"]).all()
    fig = timeline_figure(spans, results)
    assert "critical path" in legend_labels(fig)
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_color() == PATH_COLOUR]
    xs = line.get_xdata()
    scale = {"s": 1.0, "ms": 1e3, "µs": 1e6}[fig.axes[0].get_xlabel().split("(")[1][:-1]]
    assert xs[0] == pytest.approx(0.0, abs=1e-9)
    assert xs[-1] == pytest.approx(results["step_time_s"] * scale, rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_timeline_bars_add_up_to_the_accounting(tmp_path: Path, schedule: str) -> None:
    """Each simulated rank's compute bars, by category, are the accounting's seconds: a
    fused backward's two parts (input, then its weight share) and zb-h1's split W."""
    results = engine_run(tmp_path, schedule)
    bars = categorised(read_timeline(tmp_path))
    seconds = (bars["end"] - bars["start"]).groupby([bars["rank"], bars["category"]]).sum()
    for entry in results["time_breakdown_s"]:
        for category in ("forward", "backward_input", "backward_weight", "recompute",
                         "optimizer"):
            drawn = seconds.get((entry["rank"], category), 0.0)
            assert drawn == pytest.approx(entry[category], rel=1e-9, abs=1e-12), category
    assert (bars["category"] == "backward_weight").any()
    fig = timeline_figure(read_timeline(tmp_path), results)
    colours = {matplotlib.colors.to_hex(np.asarray(c.get_facecolor())[0])
               for ax in fig.axes for c in ax.collections}
    assert {category_style(c)["color"].lower() for c in ("backward_input", "backward_weight")
            } <= colours


def test_timeline_zooms_into_the_steady_state(tmp_path: Path) -> None:
    results = engine_run(tmp_path, "1f1b", m=16)
    spans = read_timeline(tmp_path)
    fig = timeline_figure(spans, results)
    assert len(fig.axes) == 2 and "steady state" in fig.axes[1].get_title()
    lo, hi = results["pipeline_phase_s"]
    # four cycles of the phase's m + p - 1 slots, centred in it
    width = 4 * (hi - lo) / (16 + 4 - 1)
    scale = {"s": 1.0, "ms": 1e3, "µs": 1e6}[fig.axes[1].get_xlabel().split("(")[1][:-1]]
    x0, x1 = fig.axes[1].get_xlim()
    assert x0 / scale == pytest.approx((lo + hi) / 2 - width / 2, rel=1e-9)
    assert (x1 - x0) / scale == pytest.approx(1.005 * width, rel=1e-9)  # axes' 0.5% margin
    few = engine_run(tmp_path / "few", "1f1b", m=4)
    assert len(timeline_figure(read_timeline(tmp_path / "few"), few).axes) == 1


def test_timeline_rows_legend_and_title() -> None:
    spans, results = schedule_run("gpipe", p=2, m=2)
    fig = timeline_figure(spans, results)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    assert [t.get_text() for t in ax.get_yticklabels(minor=True)] == ["pp", "dp"] * 2
    labels = legend_labels(fig)
    # the accounting's categories, in its order: the breakdown's names and colours
    assert labels[:5] == ["forward", "backward input", "optimizer", "pp transfer",
                          "dp transfer"]
    assert "idle (bubble)" in labels and "pipeline phase" in labels
    title = ax.get_title()
    assert "toy-gpipe" in title and "gpipe" in title and "m=2" in title
    assert f"bubble {results['bubble_fraction']:.1%}" in title and "step 10.2 ms" in title


def test_timeline_labels_microbatches_only_when_few() -> None:
    spans, results = schedule_run("gpipe", p=2, m=2)
    # each stage runs F0 F1 B0 B1: eight labelled runs
    assert sorted(texts(timeline_figure(spans, results))) == ["0"] * 4 + ["1"] * 4
    many, many_results = schedule_run("1f1b", p=4, m=64)  # 512 runs: too many to label
    whole, zoom = timeline_figure(many, many_results).axes
    assert [t.get_text() for t in whole.texts] == []
    # the steady-state zoom shows four cycles: its micro-batches are labelled there
    numbers = {int(t.get_text()) for t in zoom.texts}
    assert 4 <= len(numbers) <= 12 and max(numbers) - min(numbers) <= 12


def test_timeline_all_ranks_draws_every_rank() -> None:
    spans, results = schedule_run("gpipe", p=2, m=2)
    replica = spans.assign(rank=spans["rank"] + 2, dp=1)
    both = pd.concat([spans.assign(dp=0), replica], ignore_index=True)
    stages = timeline_figure(both, results).axes[0].get_yticklabels()
    assert [t.get_text() for t in stages] == ["stage 0", "stage 1"]
    ranks = timeline_figure(both, results, all_ranks=True).axes[0].get_yticklabels()
    assert [t.get_text() for t in ranks] == [
        "rank 0 (stage 0)", "rank 2 (stage 0)", "rank 1 (stage 1)", "rank 3 (stage 1)"]


def test_short_comm_spans_stay_visible_and_compute_is_drawn_on_top() -> None:
    spans = pd.DataFrame({"rank": [0, 0, 0], "stream": ["compute", "compute", "pp"],
                          "op": ["F", "tp.all_reduce", "pp.send"],
                          "kind": ["forward", "tp", "pp"], "microbatch": [0, 0, 0],
                          "start": [0.0, 1.0, 1.0], "end": [1.0, 1.0 + 1e-9, 1.0 + 1e-9]})
    ax = timeline_figure(spans).axes[0]
    collections = {KIND_COLOURS[k]: k for k in ("forward", "tp", "pp")}
    widths, zorders = {}, {}
    for collection in ax.collections:
        colour = matplotlib.colors.to_hex(np.asarray(collection.get_facecolor())[0])
        kind = collections[colour.upper()]
        xs = np.asarray(collection.get_paths()[0].vertices)[:, 0]
        widths[kind], zorders[kind] = xs.max() - xs.min(), collection.get_zorder()
    assert widths["pp"] >= 1e3 / 1500  # ms on the axis: at least ~one pixel of a 1 s axis
    assert widths["tp"] < 1e-5  # compute-stream bars keep their true width
    assert zorders["forward"] > zorders["tp"]


def test_timeline_of_no_spans_still_draws(tmp_path: Path) -> None:
    spans, _ = schedule_run()
    path = plot_timeline(spans.iloc[:0], None, tmp_path / "timeline.png")
    png_size(path)


def test_memory_marks_oom_and_draws_the_timeline_panel(tmp_path: Path) -> None:
    _, results = schedule_run("gpipe", p=2, m=2)
    results["memory"][0]["activations"] = 50 * GIB
    results["memory"][0]["total"] = 91 * GIB
    results["fits_in_memory"] = False
    fig = memory_figure(results)
    assert len(fig.axes) == 1
    assert "91.0\nOOM" in texts(fig) and "DOES NOT FIT" in fig.axes[0].get_title()
    results["memory_timeline"] = [[[0.0, 40 * GIB], [1 * MS, 70 * GIB], [3 * MS, 45 * GIB]],
                                  [[0.0, 30 * GIB], [2 * MS, 50 * GIB]]]
    fig = memory_figure(results)
    assert len(fig.axes) == 2
    assert legend_labels(fig)[-3:] == ["rank 0", "rank 1", "capacity"]
    path = plot_memory(results, tmp_path / "memory.png")
    assert png_size(path)[1] > png_size(plot_memory(
        {**results, "memory_timeline": None}, tmp_path / "bars.png"))[1]


def test_memory_timeline_of_many_ranks_labels_a_line_per_class() -> None:
    _, results = schedule_run("gpipe", p=2, m=2)
    results["memory_timeline"] = [{"rank": 64 * s, "stage": s,
                                   "points": [[0.0, s * GIB], [1 * MS, 2 * s * GIB]]}
                                  for s in range(32)]
    fig = memory_figure(results)
    assert len(fig.axes) == 2  # bars and curves: no colour bar of rank numbers
    labels = legend_labels(fig)
    assert labels[-33:] == [f"stage {s} (rank {64 * s})" for s in range(32)] + ["capacity"]
    colours = {matplotlib.colors.to_hex(line.get_color()) for line in fig.axes[1].lines[:32]}
    assert len(colours) == 32


def big_spans(n: int = 250_000, p: int = 16) -> pd.DataFrame:
    """n spans over p stages: forward/backward/TP on compute, p2p and DP on their streams."""
    per = n // p
    stage = np.repeat(np.arange(p), per)
    index = np.tile(np.arange(per), p)
    start = (index + stage) * 1e-4
    kind = np.array(["forward", "backward", "tp", "pp", "dp"])[index % 5]
    stream = np.where(kind == "pp", "pp", np.where(kind == "dp", "dp", "compute"))
    return pd.DataFrame({"rank": stage, "stage": stage, "stream": stream, "op": kind,
                         "kind": kind, "microbatch": (index // 50) % 192,
                         "start": start, "end": start + 0.8e-4})


def test_quarter_million_span_timeline_draws_few_artists(tmp_path: Path) -> None:
    """250,000 spans render as one collection per kind (what keeps them fast; timing
    itself is measured in benchmarks/, never asserted here)."""
    spans = big_spans()
    fig = timeline_figure(spans, {"scenario": {"name": "big"}})
    collections = fig.axes[0].collections
    assert 0 < len(collections) <= 2 * len(set(spans["kind"]))
    assert sum(len(c.get_paths()) for c in collections) >= len(spans)
    png_size(plot_timeline(spans, {"scenario": {"name": "big"}}, tmp_path / "big.png"))
