"""Reading a real job's profiler traces: the files of a directory, bounded, each with its rank.

A job's PyTorch profiler (Kineto) writes one Chrome trace-event JSON per rank and
profiling window (``*.json``, ``*.pt.trace.json``, gzipped as ``*.json.gz``). The
rank is the trace's own ``distributedInfo.rank`` (written when torch.distributed is
initialised), else the ``rank<N>`` in the file's name; several files may hold one
rank (several windows): their steps add up.

These files come from elsewhere, so each is read as untrusted input
(:mod:`simulator.loading`): regular files only, at most :data:`TRACE_LIMIT_BYTES` on
disk and, gzipped, at most that much once decompressed (read no further: a gzip bomb
stops there), UTF-8 JSON with finite numbers. Then the shape the analysis relies on is
checked, event by event: ``traceEvents`` a list of objects, a complete event's
(``ph: X``) ``ts`` and ``dur`` finite numbers (``dur`` ≥ 0), its ``name`` and ``cat``
text and its ``args`` an object. Anything else is a one-line error naming the file,
the field and the fix.
"""

from __future__ import annotations

import gzip
import io
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.errors import Problem, UserError
from simulator.loading import decode_text, parse_json, read_bytes

TRACE_LIMIT_BYTES = 1 << 30  # one rank's trace of a few profiled steps is 10-500 MB
WHAT = "trace"
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class TraceFile:
    """One rank's trace: its complete events and where they came from."""

    path: Path
    rank: int
    events: list[dict[str, Any]]  # complete events (ph X), checked


def _bad(path: Path, field: str, fix: str) -> UserError:
    """``PATH: FIELD fix`` on one line (control characters in the path escaped)."""
    return UserError([Problem("", None, f"{path}: {field} {fix}".replace(":  ", ": "))])


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def trace_files(directory: Path) -> list[Path]:
    """The trace files of ``directory`` (not its subdirectories), sorted by name; of
    its ``traces/`` where it has one (the run directory ``clustersim measure`` writes,
    its metadata beside the traces)."""
    if not directory.is_dir():
        raise _bad(directory, "(DIR)", "is not a directory; give the directory holding "
                   "every rank's profiler traces")
    if (directory / "traces").is_dir():
        directory = directory / "traces"
    found = sorted(p for p in directory.iterdir()
                   if p.name.endswith((".json", ".json.gz")) and not p.name.startswith("."))
    if not found:
        raise _bad(directory, "(DIR)", "holds no *.json or *.json.gz trace; point it at "
                   "the profiler's output directory")
    return found


def _gunzip(path: Path, data: bytes) -> bytes:
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            out = f.read(TRACE_LIMIT_BYTES + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise _bad(path, "gzip", f"cannot be decompressed ({exc}); is it cut short?") \
            from None
    if len(out) > TRACE_LIMIT_BYTES:
        raise _bad(path, "gzip", f"decompresses to more than {TRACE_LIMIT_BYTES:,} bytes; "
                   "profile fewer steps per file")
    return out


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float, or None: not a number, a boolean, infinite, or an
    integer too large for a float (JSON integers have no bound)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _number(path: Path, event: dict[str, Any], key: str, i: int) -> float:
    value = event.get(key)
    number = finite_number(value)
    if number is None or (key == "dur" and number < 0):
        raise _bad(path, f"traceEvents[{i}].{key}", f"is {_show(value)}; a complete event needs "
                   f"a finite {'non-negative ' if key == 'dur' else ''}number of "
                   "microseconds")
    return number


def _events(path: Path, doc: Any) -> list[dict[str, Any]]:
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise _bad(path, "traceEvents", "is missing or not a list; is this a PyTorch "
                   "profiler (Chrome trace-event) file?")
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise _bad(path, f"traceEvents[{i}]", f"is {type(e).__name__}, not an object")
        if e.get("ph") != "X":
            continue
        if not math.isfinite(_number(path, e, "ts", i) + _number(path, e, "dur", i)):
            raise _bad(path, f"traceEvents[{i}]", "ends past the largest time a float "
                       "holds; is ts in microseconds?")
        for key, kind in (("name", str), ("cat", str), ("args", dict)):
            if key in e and not isinstance(e[key], kind):
                raise _bad(path, f"traceEvents[{i}].{key}", f"is {_show(e[key])}; expected "
                           f"{'an object' if kind is dict else 'text'}")
        out.append(e)
    return out


def _rank(path: Path, doc: Any) -> int:
    info = doc.get("distributedInfo") if isinstance(doc, dict) else None
    if isinstance(info, dict) and "rank" in info:
        rank = info["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise _bad(path, "distributedInfo.rank", f"is {_show(rank)}; expected a rank >= 0")
        return rank
    match = _RANK_IN_NAME.search(path.name)
    if match is None:
        raise _bad(path, "distributedInfo.rank", "is missing and the file's name has no "
                   "rank<N>; rename it (e.g. trace_rank3.json)")
    return int(match.group(1))


def read_trace(path: Path) -> TraceFile:
    """One trace file, bounded and checked (see the module notes)."""
    if path.exists() and not path.is_file():
        raise _bad(path, "file", "is not a regular file; give the trace files themselves")
    try:  # the loader's problems, with the whole path in front (a long one stays whole)
        data = read_bytes(path, WHAT, TRACE_LIMIT_BYTES)
        if path.name.endswith(".gz"):
            data = _gunzip(path, data)
        doc = parse_json(decode_text(data, WHAT, str(path)), WHAT, str(path))
    except UserError as exc:
        if all(isinstance(p, Problem) and p.field == WHAT for p in exc.problems):
            raise _bad(path, "", "; ".join(p.fix for p in exc.problems
                                          if isinstance(p, Problem))) from None
        raise
    return TraceFile(path, _rank(path, doc), _events(path, doc))


def read_traces(directory: Path) -> dict[int, list[TraceFile]]:
    """Every trace of ``directory`` by rank, ranks ascending."""
    by_rank: dict[int, list[TraceFile]] = {}
    for path in trace_files(directory):
        t = read_trace(path)
        by_rank.setdefault(t.rank, []).append(t)
    return dict(sorted(by_rank.items()))
