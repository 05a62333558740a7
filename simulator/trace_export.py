"""Span tables on disk: ``timeline.csv`` and Chrome trace-event JSON.

The engine's trace is a flat table, one row per span, with the columns of
:data:`SPAN_COLUMNS` (times in seconds, ``bytes`` 0 for compute, ``-1`` for "no
micro-batch / layer"). This module only converts that table; it never sees a
simulation object, so ``clustersim plot DIR`` and Perfetto work from files alone.

Chrome trace (the JSON Object Format that Perfetto and chrome://tracing load):
one process per rank (``pid = rank``), one thread per stream with a fixed ``tid``
for the known streams so that every rank lists compute, pp, dp, host in the
same order, and one complete event (``"ph": "X"``) per span with ``ts``/``dur``
in microseconds, as the format requires. ``name`` is the op, ``cat`` the kind.

Every writer is atomic: it writes a temporary file in the destination's
directory and renames it over the target, so a reader (or a crashed sweep)
never sees half a file.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

#: Column name → dtype of a span table, in file order.
SPAN_COLUMNS: Mapping[str, Any] = {
    "rank": "int64",
    "stage": "int64",
    "tp": "int64",
    "dp": "int64",
    "stream": "str",
    "op": "str",
    "kind": "str",
    "name": "str",
    "microbatch": "int64",
    "layer": "int64",
    "chunk": "int64",
    "start": "float64",
    "comm_start": "float64",  # a collective: when its transfer began (the rest was peer-wait)
    "end": "float64",
    "bytes": "float64",
}

#: Columns a span table must have; the others get the defaults below.
REQUIRED_COLUMNS = ("rank", "stream", "op", "start", "end")
_DEFAULTS: Mapping[str, Any] = {
    "stage": 0, "tp": 0, "dp": 0, "kind": "", "name": "",
    "microbatch": -1, "layer": -1, "chunk": 0, "bytes": 0.0, "comm_start": np.nan,
}

#: Fixed thread ids; any other stream gets the next free id, in name order.
STREAM_TIDS: Mapping[str, int] = {"compute": 0, "pp": 1, "dp": 2, "host": 3}

_US_PER_S = 1e6


def normalize_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """Return a copy with every column of :data:`SPAN_COLUMNS`, in order and dtype.

    Missing optional columns, and missing values in them, get their "none" value
    (``microbatch = -1``, ...); a missing required column is an error that names it.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in spans.columns]
    if missing:
        raise ValueError(
            f"span table lacks column(s) {missing}; it has {list(spans.columns)}"
        )
    columns: dict[str, pd.Series] = {}
    for column, dtype in SPAN_COLUMNS.items():
        if column in spans.columns:
            values = pd.Series(spans[column].to_numpy())
            if column in _DEFAULTS:  # records built from dicts leave NaN where a key was absent
                values = values.where(values.notna(), _DEFAULTS[column])
        else:
            values = pd.Series(np.full(len(spans), _DEFAULTS[column]))
        columns[column] = values.astype(dtype)
    if "comm_start" not in spans.columns:  # tables from before comm_start: no waits known
        columns["comm_start"] = columns["start"]
    columns["comm_start"] = columns["comm_start"].fillna(columns["start"])
    return pd.DataFrame(columns)


def _stream_tids(streams: Iterable[str]) -> dict[str, int]:
    tids = dict(STREAM_TIDS)
    for stream in sorted(set(streams) - set(tids)):
        tids[stream] = max(tids.values()) + 1
    return tids


def _metadata_events(spans: pd.DataFrame, tids: Mapping[str, int]) -> list[dict[str, Any]]:
    """Process and thread names (and sort order) for every rank and its streams."""
    events: list[dict[str, Any]] = []
    ranks = spans.drop_duplicates("rank").sort_values("rank")
    for rank, stage, tp, dp in ranks[["rank", "stage", "tp", "dp"]].itertuples(index=False):
        label = f"rank {rank} (stage {stage}, tp {tp}, dp {dp})"
        events.append({"ph": "M", "pid": int(rank), "tid": 0, "name": "process_name",
                       "args": {"name": label}})
        events.append({"ph": "M", "pid": int(rank), "tid": 0, "name": "process_sort_index",
                       "args": {"sort_index": int(rank)}})
    threads = spans[["rank", "stream"]].drop_duplicates()
    threads = threads.assign(tid=threads["stream"].map(tids)).sort_values(["rank", "tid"])
    for rank, stream, tid in threads.itertuples(index=False):
        events.append({"ph": "M", "pid": int(rank), "tid": int(tid), "name": "thread_name",
                       "args": {"name": stream}})
        events.append({"ph": "M", "pid": int(rank), "tid": int(tid),
                       "name": "thread_sort_index", "args": {"sort_index": int(tid)}})
    return events


def _span_events(spans: pd.DataFrame, tids: Mapping[str, int]) -> list[dict[str, Any]]:
    """One complete event per span; times rounded to the nanosecond (3 decimals of µs)."""
    ts = np.round(spans["start"].to_numpy() * _US_PER_S, 3)
    dur = np.round(np.maximum(spans["end"].to_numpy() - spans["start"].to_numpy(), 0.0)
                   * _US_PER_S, 3)
    tid = spans["stream"].map(tids).to_numpy()
    columns = zip(
        spans["rank"].tolist(), tid.tolist(), ts.tolist(), dur.tolist(),
        spans["op"].tolist(), spans["kind"].tolist(), spans["microbatch"].tolist(),
        spans["layer"].tolist(), spans["chunk"].tolist(), spans["bytes"].tolist(),
        spans["name"].tolist(), strict=True,
    )
    return [
        {"ph": "X", "pid": pid, "tid": t, "ts": s, "dur": d, "name": op, "cat": kind,
         "args": {"microbatch": mb, "layer": layer, "chunk": chunk, "bytes": nbytes,
                  "name": text}}
        for pid, t, s, d, op, kind, mb, layer, chunk, nbytes, text in columns
    ]


def _other_data(results: Mapping[str, Any] | None) -> dict[str, Any]:
    """The headline scalars of ``results`` (and the scenario's name), for the trace's header."""
    if not results:
        return {}
    other: dict[str, Any] = {k: v for k, v in results.items()
             if isinstance(v, (int, float, str, bool)) and not isinstance(v, np.generic)}
    scenario = results.get("scenario")
    if isinstance(scenario, Mapping):
        other["scenario"] = str(scenario.get("name", ""))
        parallel = scenario.get("parallel")
        if isinstance(parallel, Mapping):
            other["parallel"] = {k: v for k, v in parallel.items()
                                 if isinstance(v, (int, float, str, bool))}
    return other


def to_chrome_trace(spans: pd.DataFrame, results: Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Chrome trace-event JSON object for a span table (see the module notes)."""
    table = normalize_spans(spans)
    tids = _stream_tids(table["stream"].tolist())
    events = _metadata_events(table, tids) + _span_events(table, tids)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "clustersim", "time_unit": "us", **_other_data(results)},
    }


@contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it over ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # a fresh unique name, not mkstemp: mkstemp's file is mode 0600, and the output
    # should get the usual permissions (umask) like any other file the user writes
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def write_chrome_trace(path: str | os.PathLike[str], spans: pd.DataFrame,
                       results: Mapping[str, Any] | None = None) -> Path:
    """Write :func:`to_chrome_trace` as JSON to ``path`` (atomically); return the path."""
    trace = to_chrome_trace(spans, results)
    # dumps, not dump: json.dump streams through the pure-Python encoder (3x slower)
    text = json.dumps(trace, separators=(",", ":"), allow_nan=False)
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_timeline_csv(path: str | os.PathLike[str], spans: pd.DataFrame) -> Path:
    """Write the span table as CSV (floats round-trip exactly), atomically; return the path."""
    table = normalize_spans(spans)
    with atomic_output(path) as tmp:
        table.to_csv(tmp, index=False, float_format=None)
    return Path(path)


def read_timeline_csv(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read a ``timeline.csv`` back with the dtypes of :data:`SPAN_COLUMNS`."""
    dtypes = {c: (object if d == "str" else d) for c, d in SPAN_COLUMNS.items()}
    # keep_default_na=False keeps an empty name "" (and an op called "NA") as text.
    table = pd.read_csv(path, dtype=dtypes, keep_default_na=False)
    return normalize_spans(table)
