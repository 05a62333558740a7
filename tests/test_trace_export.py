"""trace.json: Chrome trace-event structure, units, rank selection, flows, counters,
atomic writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from simulator.outputs.timeline_files import write_timeline_csv
from simulator.outputs.trace_export import (
    STREAM_TIDS,
    atomic_output,
    to_chrome_trace,
    write_chrome_trace,
)

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
    assert first["args"] == {"microbatch": 0, "layer": -1, "chunk": 0, "bytes": 0.0,
                             "name": "F mb0"}
    assert {e["cat"] for e in spans_x} == {"forward", "backward", "pp", "dp", "optimizer"}


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
