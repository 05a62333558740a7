"""trace.json: Chrome trace-event structure, units, rank selection, flows, counters,
atomic writes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.outputs.timeline_files import write_timeline_csv
from simulator.outputs.trace_export import (
    LINK_MAX_POINTS,
    STREAM_TIDS,
    atomic_output,
    mean_bins,
    to_chrome_trace,
    write_chrome_trace,
)
from simulator.outputs.trace_links import TraceLinks

MS = 1e-3


def gpipe_spans() -> pd.DataFrame:
    """2-stage GPipe, 2 micro-batches (F = 1 ms, B = 2 ms, p2p 0.1 ms), DP sync and optimizer."""
    rows: list[dict[str, Any]] = []

    def span(stage: int, stream: str, op: str, kind: str, mb: int, start: float, end: float,
             nbytes: float = 0.0, name: str | None = None) -> None:
        rows.append({"rank": stage, "stage": stage, "tp": 0, "dp": 0, "stream": stream,
                     "op": op, "kind": kind, "name": f"{op} mb{mb}" if name is None else name,
                     "microbatch": mb, "layer": -1, "chunk": 0, "start": start * MS,
                     "end": end * MS, "bytes": nbytes})

    for mb in range(2):
        span(0, "compute", "F", "forward", mb, mb, mb + 1)
        span(0, "pp", "pp.send", "pp", mb, mb + 1, mb + 1.1, 4e6)
        span(1, "pp", "pp.recv", "pp", mb, mb + 1, mb + 1.1, 4e6)
        span(1, "compute", "F", "forward", mb, mb + 1.1, mb + 2.1)
    for mb in range(2):
        span(1, "compute", "B", "backward", mb, 3.1 + 2 * mb, 5.1 + 2 * mb)
        span(1, "pp", "pp.send", "pp", mb, 5.1 + 2 * mb, 5.2 + 2 * mb, 4e6)
        span(0, "compute", "B", "backward", mb, 5.2 + 2 * mb, 7.2 + 2 * mb)
    for stage in range(2):
        span(stage, "dp", "dp.all_reduce", "dp", -1, 8.0, 9.5, 2e9, name='grads, "bucket" 0')
        span(stage, "compute", "optimizer", "optimizer", -1, 9.5, 10.0, name="")
    return pd.DataFrame(rows)


RESULTS = {
    "step_time_s": 10.0 * MS,
    "bubble_fraction": 1 / 3,
    "bubble_fraction_per_stage": [1 / 3, 1 / 3],
    "scenario": {"name": "toy-gpipe", "parallel": {"tp": 1, "pp": 2, "dp": 1,
                                                   "schedule": "gpipe"}},
}


def check_trace_structure(trace: dict[str, Any]) -> None:
    """What Perfetto and chrome://tracing need from the JSON Object Format."""
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["otherData"]["time_unit"] == "us"
    assert trace["displayTimeUnit"] in ("ms", "ns")
    events = trace["traceEvents"]
    process_names = {e["pid"]: e["args"]["name"] for e in events
                     if e["ph"] == "M" and e["name"] == "process_name"}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                    if e["ph"] == "M" and e["name"] == "thread_name"}
    for event in events:
        assert event["ph"] in ("X", "M", "s", "f", "C")
        assert type(event["pid"]) is int and type(event["tid"]) is int
        if event["ph"] in ("s", "f", "C"):
            assert isinstance(event["ts"], float) and event["ts"] >= 0
            assert event["pid"] in process_names
        if event["ph"] == "X":
            assert isinstance(event["ts"], float) and isinstance(event["dur"], float)
            assert event["dur"] >= 0 and event["ts"] >= 0
            assert isinstance(event["name"], str) and isinstance(event["cat"], str)
            assert event["pid"] in process_names
            assert (event["pid"], event["tid"]) in thread_names
    assert json.loads(json.dumps(trace)) == trace


def test_trace_has_one_process_per_rank_and_one_thread_per_stream() -> None:
    trace = to_chrome_trace(gpipe_spans(), RESULTS)
    check_trace_structure(trace)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (stage 0, tp 0, dp 0)", 1: "rank 1 (stage 1, tp 0, dp 0)"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert sort == {0: 0, 1: 1}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in events
               if e["name"] == "thread_name"}
    assert threads == {(r, STREAM_TIDS[s], s) for r in (0, 1) for s in ("compute", "pp", "dp")}


def test_complete_events_carry_op_kind_and_args() -> None:
    spans = gpipe_spans()
    spans_x = [e for e in to_chrome_trace(spans)["traceEvents"] if e["ph"] == "X"]
    assert len(spans_x) == len(spans)
    first = spans_x[0]
    assert (first["name"], first["cat"], first["pid"], first["tid"]) == ("F", "forward", 0, 0)
    # what the op, layer and micro-batch already say is not repeated: no chunk outside an
    # interleaved schedule, no bytes for compute, no name that is "F mb0" again
    assert first["args"] == {"microbatch": 0, "layer": -1}
    assert spans_x[1]["args"] == {"microbatch": 0, "layer": -1, "bytes": 4000000}
    dp = next(e for e in spans_x if e["name"] == "dp.all_reduce")
    assert dp["args"] == {"microbatch": -1, "layer": -1, "bytes": 2000000000,
                          "name": 'grads, "bucket" 0'}
    assert {e["cat"] for e in spans_x} == {"forward", "backward", "pp", "dp", "optimizer"}


@pytest.mark.parametrize("name", ["F", "F mb0", "fwd.attn L3 mb0", "fwd.attn L3",
                                  "tp.all_reduce L3 mb0", "head mb0 L3", "x L3 mb07", ""])
def test_span_names_are_recoverable_from_the_event(name: str) -> None:
    """The event's name (the op) or args.name, then " L<layer>" and " mb<microbatch>"
    as the span had them, give the span's name back: nothing is lost."""
    spans = gpipe_spans().iloc[:1].assign(name=name, layer=3)
    (event,) = [e for e in to_chrome_trace(spans)["traceEvents"] if e["ph"] == "X"]
    base, args = event["args"].get("name", event["name"]), event["args"]
    assert name in {base, f"{base} mb{args['microbatch']}", f"{base} L{args['layer']}",
                    f"{base} L{args['layer']} mb{args['microbatch']}"}
    assert len(base) <= len(name) or base == event["name"]


def test_an_interleaved_schedule_shows_every_spans_chunk() -> None:
    spans = gpipe_spans()
    spans.loc[3, "chunk"] = 1
    events = [e for e in to_chrome_trace(spans)["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["chunk"] for e in events] == spans["chunk"].tolist()


def test_timestamps_are_microseconds() -> None:
    spans = gpipe_spans()
    events = [e for e in to_chrome_trace(spans)["traceEvents"] if e["ph"] == "X"]
    for event, start, end in zip(events, spans["start"], spans["end"], strict=True):
        assert event["ts"] == pytest.approx(start * 1e6, abs=1e-3)
        assert event["dur"] == pytest.approx((end - start) * 1e6, abs=1e-3)
    # the 1 ms forward of micro-batch 1 starts at 1000 µs and lasts 1000 µs
    assert (events[4]["ts"], events[4]["dur"]) == (1000.0, 1000.0)


def test_negative_durations_are_clamped_and_unknown_streams_get_new_tids() -> None:
    spans = gpipe_spans().iloc[:2].copy()
    spans["end"] = [spans["end"].iloc[0], spans["start"].iloc[1] - 1e-9]
    spans["stream"] = ["compute", "offload"]
    trace = to_chrome_trace(spans)
    check_trace_structure(trace)
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert x[1]["dur"] == 0.0
    assert x[1]["tid"] == max(STREAM_TIDS.values()) + 1


def test_other_data_echoes_headline_results() -> None:
    other = to_chrome_trace(gpipe_spans(), RESULTS)["otherData"]
    assert other["step_time_s"] == RESULTS["step_time_s"]
    assert other["scenario"] == "toy-gpipe"
    assert other["parallel"]["schedule"] == "gpipe"
    assert "bubble_fraction_per_stage" not in other  # only scalars travel in the header
    assert to_chrome_trace(gpipe_spans())["otherData"]["time_unit"] == "us"


def test_empty_table_gives_a_valid_empty_trace() -> None:
    trace = to_chrome_trace(gpipe_spans().iloc[:0])
    check_trace_structure(trace)
    assert trace["traceEvents"] == []


def test_write_chrome_trace_round_trips_and_leaves_no_temporaries(tmp_path: Path) -> None:
    path = write_chrome_trace(tmp_path / "out" / "trace.json", gpipe_spans(), RESULTS)
    assert json.loads(path.read_text()) == to_chrome_trace(gpipe_spans(), RESULTS)
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]


def test_atomic_writes_get_ordinary_permissions(tmp_path: Path) -> None:
    reference = tmp_path / "reference.txt"
    reference.write_text("x")  # created under the process umask, as any user file
    path = write_timeline_csv(tmp_path / "timeline.csv", gpipe_spans())
    assert path.stat().st_mode & 0o777 == reference.stat().st_mode & 0o777


def test_atomic_output_keeps_the_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "trace.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def _area(points: list[tuple[float, float]]) -> float:
    return sum(v * (t1 - t0) for (t0, v), (t1, _) in itertools.pairwise(points))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e3), st.floats(0, 10)), min_size=2, max_size=300),
       st.integers(4, 60))
def test_mean_bins_keeps_the_area_and_bounds_the_points(raw: list[tuple[float, float]],
                                                        n: int) -> None:
    points = sorted(raw, key=lambda p: p[0])
    out = mean_bins(points, n)
    assert len(out) <= n
    assert out[0][0] == points[0][0] and out[-1] == points[-1]
    assert _area(out) == pytest.approx(_area(points), rel=1e-9, abs=1e-9)
    low, high = min(v for _, v in points), max(v for _, v in points)
    assert all(low - 1e-9 <= v <= high + 1e-9 for _, v in out)
    if len(points) <= n:
        assert out == points


def test_mean_bins_of_one_instant_keeps_its_last_value() -> None:
    assert mean_bins([(2.0, 1.0)] * 9 + [(2.0, 0.5)], 4) == [(2.0, 0.5)]


def test_counters_are_bounded_rounded_and_change_only() -> None:
    """A link busy 5,000 times a step is drawn in LINK_MAX_POINTS points at most; the
    memory counter is in GB to the kB and repeats no value."""
    t = np.arange(10_000) * 1e-6
    links = pd.DataFrame({"rank": 0, "link": "intra_node", "t": t,
                          "value": np.tile([0.8719415654395233, 0.0], 5_000)})
    memory = [{"rank": 0, "stage": 0,
               "points": [[0.0, 1e9], [1e-3, 1e9 + 1], [2e-3, 2.5e9 + 123_456_789]]}]
    trace = to_chrome_trace(gpipe_spans(), links=TraceLinks([0, 1], links=links,
                                                            memory=memory))
    check_trace_structure(trace)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    link = [e["args"]["intra_node"] for e in counters if e["name"] == "link"]
    assert len(link) <= LINK_MAX_POINTS
    assert sum(link[:-1]) / (len(link) - 1) == pytest.approx(0.8719415654395233 / 2, rel=1e-3)
    assert [e["args"]["allocated_GB"] for e in counters if e["name"] == "memory"] == \
        [1.0, 2.623457]


def test_a_gzipped_trace_holds_the_same_trace(tmp_path: Path) -> None:
    """``--trace-format json.gz``: trace.json.gz alone, the same JSON once unzipped,
    listed in the manifest and linked from report.html."""
    import gzip

    from small_scenario import SMALL

    from simulator.cli.main import main
    from simulator.outputs.run_dir import check_run_dir

    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL)
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    assert main(["run", str(scenario), "--out", str(plain), "--no-plots"]) == 0
    assert main(["run", str(scenario), "--out", str(packed), "--no-plots",
                 "--trace-format", "json.gz"]) == 0
    assert not (packed / "trace.json").exists()
    raw = (packed / "trace.json.gz").read_bytes()
    trace, reference = json.loads(gzip.decompress(raw)), json.loads(
        (plain / "trace.json").read_text())
    check_trace_structure(trace)
    assert trace["traceEvents"] == reference["traceEvents"]
    assert len(raw) < (plain / "trace.json").stat().st_size / 4
    assert "trace.json.gz" in check_run_dir(packed)["files"]
    assert 'href="trace.json.gz"' in (packed / "report.html").read_text()
