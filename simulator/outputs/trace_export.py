"""Chrome trace-event JSON (``trace.json``) of a span table, for a selection of ranks.

The JSON Object Format that Perfetto (https://ui.perfetto.dev) and
chrome://tracing load: one process per rank (``pid = rank``), one thread per
stream with a fixed ``tid`` for the known streams so that every rank lists
compute, pp, dp, host in the same order, and one complete event (``"ph": "X"``)
per span with ``ts``/``dur`` in microseconds, as the format requires, rounded
to the nanosecond (three decimals; more digits are float noise). ``name`` is the
op, ``cat`` the kind; ``args`` hold ``microbatch`` and ``layer``, and only what
else the span has: ``chunk`` only when a traced span has a chunk other than 0 (an
interleaved schedule), ``bytes`` only when the span moves bytes (an integer), and
``name`` only what the span's name says beyond the op, layer and micro-batch (the
name less its `` L<layer>`` and `` mb<microbatch>`` suffixes, absent when that is
the op): ``tp.all_reduce L3 mb0`` needs no ``args.name``, ``fwd.attn L3 mb0``
keeps ``fwd.attn``. Only the selected ranks are written: by default
one per pipeline stage (``--trace-ranks stages``), since a 1,024-GPU
full-fidelity step has ten million spans, a file no viewer opens.

With :class:`~simulator.outputs.trace_links.TraceLinks` for the selection, the trace
also has

- flow events (``"ph": "s"`` then ``"f"``, with ``"bp": "e"``; the pair shares
  ``id``, ``cat`` and ``name``): each endpoint sits at the middle of its span,
  on the span's own thread, so both bind to that span as the enclosing slice;
  a collective's flows all sit at one instant inside every member's span (the
  middle of the interval they have in common);
- counter events (``"ph": "C"``) per rank, one at each change of the rounded
  value: ``memory`` (allocated GB over the step, to the kB) and ``link`` (its
  utilisation, one series per link class, to 0.01 %). A link that changes more
  than :data:`LINK_MAX_POINTS` times in the step (a TP group's intra-node link
  pulses with every collective: 14,000 times a rank in GPT-3 175B on 1,024 GPUs)
  is drawn as its mean over as many equal-time bins (:func:`mean_bins`; the bytes
  on the wire, the curve's area, are kept; the spans show each transfer).

At GPT-3 175B on 1,024 GPUs (16 ranks traced, folded) these rules take the file
from 68 MB to 40 MB with the same spans, times, flows and memory curve.

Without them (or for memory, from ``results["memory_timeline"]``) the trace
has the spans and whatever curves the results carry.

This module only converts tables; it never sees a simulation object. The JSON
text is assembled from pre-escaped pieces (category values escaped once), not
through a dict per event: a dict per event and ``json.dumps`` cost seconds per
hundred thousand spans. Every writer is atomic: it writes a temporary file in
the destination's directory and renames it over the target, so a reader (or a
crashed sweep) never sees half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from simulator.outputs.span_table import normalize_spans, stage_representatives
from simulator.outputs.writing import atomic_output

if TYPE_CHECKING:
    from simulator.outputs.trace_links import TraceLinks

#: Fixed thread ids; any other stream gets the next free id, in name order.
STREAM_TIDS: Mapping[str, int] = {"compute": 0, "pp": 1, "dp": 2, "host": 3}

_US_PER_S = 1e6
_GB = 1e9
#: ``--trace-format``: the file each format writes.
TRACE_FILES: Mapping[str, str] = {"json": "trace.json", "json.gz": "trace.json.gz"}
#: A link counter's points per rank and link class at most (:func:`mean_bins`).
LINK_MAX_POINTS = 2000


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


def _literals(column: pd.Series) -> list[str]:
    """A categorical column as JSON string literals, row by row (each value escaped once)."""
    cat = column.cat
    literals = np.array([json.dumps(str(c)) for c in cat.categories] + ['""'], dtype=object)
    return list(literals[cat.codes.to_numpy()])  # code -1 (missing) takes the last: ""


def _thread_ids(spans: pd.DataFrame, tids: Mapping[str, int]) -> np.ndarray:
    cat = spans["stream"].cat
    by_code = np.array([tids[str(c)] for c in cat.categories] + [0], dtype=np.int64)
    return by_code[cat.codes.to_numpy()]


def _detail(name: str, op: str, layer: int, microbatch: int) -> str | None:
    """What a span's name says beyond its op, layer and micro-batch: the name less its
    `` L<layer>`` and `` mb<microbatch>`` suffixes; None when that is the op itself."""
    for suffix in (f" mb{microbatch}", f" L{layer}"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return None if name == op else name


def _number(x: float) -> str:
    """A JSON number, an integral float as an integer (bytes: ``50331648``, not ``.0``)."""
    return str(int(x)) if x.is_integer() and abs(x) < 2**53 else repr(x)


def _span_args(spans: pd.DataFrame) -> list[str]:
    """Each span's ``args`` object (see the module notes for what is left out)."""
    chunks = bool((spans["chunk"] != 0).any())  # an interleaved schedule: chunk shown
    literal: dict[str, str] = {}
    out = []
    for op, name, mb, layer, chunk, nbytes in zip(
            spans["op"].astype(str).tolist(), spans["name"].astype(str).tolist(),
            spans["microbatch"].tolist(), spans["layer"].tolist(), spans["chunk"].tolist(),
            spans["bytes"].tolist(), strict=True):
        text = f'"microbatch":{mb},"layer":{layer}'
        if chunks:
            text += f',"chunk":{chunk}'
        if nbytes:
            text += f',"bytes":{_number(float(nbytes))}'
        detail = _detail(name, op, layer, mb)
        if detail is not None:
            if detail not in literal:
                literal[detail] = json.dumps(detail)
            text += f',"name":{literal[detail]}'
        out.append(text)
    return out


def _span_lines(spans: pd.DataFrame, tids: Mapping[str, int]) -> list[str]:
    """One complete event per span; times rounded to the nanosecond (3 decimals of µs)."""
    start, end = spans["start"].to_numpy(), spans["end"].to_numpy()
    ts = np.round(start * _US_PER_S, 3)
    dur = np.round(np.maximum(end - start, 0.0) * _US_PER_S, 3)
    columns = zip(
        spans["rank"].tolist(), _thread_ids(spans, tids).tolist(), ts.tolist(), dur.tolist(),
        _literals(spans["op"]), _literals(spans["kind"]), _span_args(spans), strict=True,
    )
    return [
        f'{{"ph":"X","pid":{pid},"tid":{tid},"ts":{t!r},"dur":{d!r},"name":{op},"cat":{kind},'
        f'"args":{{{args}}}}}'
        for pid, tid, t, d, op, kind, args in columns
    ]


def _flow_lines(spans: pd.DataFrame, flows: pd.DataFrame, tids: Mapping[str, int]) -> list[str]:
    """Flow start/finish events, each bound to its span (see the module notes)."""
    if flows.empty:
        return []
    row_of = {task: i for i, task in enumerate(spans["task"].tolist())}
    known = flows[flows["task"].map(row_of.__contains__)]
    complete = known.groupby("flow")["phase"].transform("size") == 2  # both ends shown
    pairs = known[complete].sort_values(["flow", "phase"], ascending=[True, False])
    rows = pairs["task"].map(row_of).to_numpy()
    pid = spans["rank"].to_numpy()[rows]
    tid = _thread_ids(spans, tids)[rows]
    start, end = spans["start"].to_numpy()[rows], spans["end"].to_numpy()[rows]
    # pairs are (s, f) rows: where the two spans overlap both ends sit in the middle of
    # the overlap (a collective), else each in the middle of its own span (a send)
    lo = np.maximum(start[0::2], start[1::2])
    hi = np.minimum(end[0::2], end[1::2])
    ts = np.where(np.repeat(hi > lo, 2), np.repeat((lo + hi) / 2, 2), (start + end) / 2)
    ts = np.round(ts * _US_PER_S, 3)
    cats = [json.dumps(str(c)) for c in pairs["cat"].tolist()]
    columns = zip(pairs["flow"].tolist(), pairs["phase"].tolist(), cats, pid.tolist(),
                  tid.tolist(), ts.tolist(), strict=True)
    bind = {"s": "", "f": ',"bp":"e"'}  # a finish binds to its enclosing slice, not the next
    return [
        f'{{"ph":"{ph}","id":{flow},"pid":{p},"tid":{t},"ts":{x!r},"cat":"flow",'
        f'"name":{cat}{bind[ph]}}}'
        for flow, ph, cat, p, t, x in columns
    ]


def mean_bins(points: Sequence[Sequence[float]], max_points: int) -> list[tuple[float, float]]:
    """A step function (each value holds until the next point) in at most ``max_points``
    points: equal-time bins from the first point to the last, each at its mean over the
    bin (the area, bytes on the wire for a link, is kept), then the last point."""
    if len(points) <= max_points:
        return [(float(t), float(v)) for t, v in points]
    times, values = np.asarray(points, dtype=float).T
    if times[-1] <= times[0]:  # every point at one instant: the last value stands
        return [(float(times[0]), float(values[-1]))]
    area = np.concatenate([[0.0], np.cumsum(values[:-1] * np.diff(times))])
    edges = np.linspace(times[0], times[-1], max_points)  # max_points - 1 bins
    means = np.diff(np.interp(edges, times, area)) / np.diff(edges)
    return [*zip(edges[:-1].tolist(), means.tolist(), strict=True),
            (float(times[-1]), float(values[-1]))]


def _counter_lines(name: str, series: str, pid: int, points: Iterable[Sequence[float]],
                   scale: float = 1.0, digits: int = 6) -> list[str]:
    """One counter event per change of the value rounded to ``digits`` decimals."""
    lines, last = [], None
    for t, v in points:
        value = round(float(v) * scale, digits)
        if value != last:
            lines.append(f'{{"ph":"C","pid":{pid},"tid":0,"ts":{round(t * _US_PER_S, 3)!r},'
                         f'"name":"{name}","args":{{"{series}":{value!r}}}}}')
            last = value
    return lines


def _counters(ranks: Sequence[int], memory: Iterable[Mapping[str, Any]],
              links: pd.DataFrame | None) -> list[str]:
    """``memory`` (allocated GB, to the kB) and ``link`` (utilisation per link class, to
    0.01 %, at most :data:`LINK_MAX_POINTS` a rank and class) counters."""
    wanted = set(ranks)
    lines: list[str] = []
    for curve in memory:
        if int(curve["rank"]) in wanted:
            lines += _counter_lines("memory", "allocated_GB", int(curve["rank"]),
                                    curve["points"], 1 / _GB)
    if links is not None and not links.empty:
        for (rank, link), group in links.groupby(["rank", "link"], sort=True):
            if int(rank) in wanted:
                points = np.column_stack([group["t"].to_numpy(), group["value"].to_numpy()])
                lines += _counter_lines("link", str(link), int(rank),
                                        mean_bins(points.tolist(), LINK_MAX_POINTS), digits=4)
    return lines


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


def chrome_trace_json(spans: pd.DataFrame, results: Mapping[str, Any] | None = None,
                      links: TraceLinks | None = None,
                      ranks: Sequence[int] | None = None) -> str:
    """The Chrome trace of ``spans`` as JSON text (see the module notes).

    Ranks shown: ``links.ranks`` when given, else ``ranks``, else one per pipeline
    stage (its lowest rank). Memory counters come from ``links`` or, without them,
    from ``results["memory_timeline"]``.
    """
    if links is not None:
        ranks = links.ranks
    table = spans if "stage" in spans.columns else normalize_spans(spans)
    if ranks is None:
        ranks = stage_representatives(table)
    table = normalize_spans(table[table["rank"].isin(list(ranks))])
    tids = _stream_tids(str(c) for c in table["stream"].cat.categories)
    lines = [json.dumps(e, separators=(",", ":")) for e in _metadata_events(table, tids)]
    lines += _span_lines(table, tids)
    if links is not None:
        lines += _flow_lines(table, links.flows, tids)
        lines += _counters(ranks, links.memory, links.links)
    else:
        lines += _counters(ranks, (results or {}).get("memory_timeline") or [], None)
    head = json.dumps({"displayTimeUnit": "ms", "otherData": {
        "generator": "clustersim", "time_unit": "us", **_other_data(results),
        "ranks": [int(r) for r in ranks]}}, separators=(",", ":"), allow_nan=False)
    return '{"traceEvents":[\n' + ",\n".join(lines) + "\n]," + head[1:] + "\n"


def to_chrome_trace(spans: pd.DataFrame, results: Mapping[str, Any] | None = None,
                    links: TraceLinks | None = None,
                    ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """:func:`chrome_trace_json` parsed: the trace as a dict (for tests and notebooks)."""
    trace: dict[str, Any] = json.loads(chrome_trace_json(spans, results, links, ranks))
    return trace



def write_chrome_trace(path: str | os.PathLike[str], spans: pd.DataFrame,
                       results: Mapping[str, Any] | None = None,
                       links: TraceLinks | None = None,
                       ranks: Sequence[int] | None = None) -> Path:
    """Write :func:`chrome_trace_json` to ``path`` (atomically), gzipped when the name
    ends in ``.gz`` (Perfetto opens it as it is); return the path."""
    import gzip

    text = chrome_trace_json(spans, results, links, ranks)
    with atomic_output(path) as tmp:
        if str(path).endswith(".gz"):
            with tmp.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                      compresslevel=6) as gz:
                gz.write(text.encode("utf-8"))
        else:
            tmp.write_text(text, encoding="utf-8")
    return Path(path)
