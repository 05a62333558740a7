"""A real job's trace cut into classes, per rank and per step.

Each class (:mod:`simulator.traces.classes`) is the union of its events' intervals,
so a class's kernels on two streams count once. Then, as HolisticTraceAnalysis does
for its communication/computation overlap (``hta/analyzers/communication_analysis.py``:
merged compute kernels against merged communication kernels) and its idle time
(``hta/analyzers/breakdown_analysis.py``: time no kernel runs):

- ``compute``: the union of the compute classes (the compute streams busy);
- ``comm``: the union of the collective classes (the communication streams busy);
- ``exposed_comm``: ``comm`` minus ``compute``, communication nothing overlaps;
- ``idle``: the step minus the union of everything (compute, comm, memcpy);
- ``step``: the profiled steps' time.

Steps are the profiler's ``ProfilerStep#N`` annotations (on a GPU trace their
device-side copies, ``gpu_user_annotation``, which span the kernels the step
launched); every figure counts only what falls inside them, and dividing by their
number gives a figure per step. A trace without them (one ``with profile():``
block, as ``clustersim measure`` writes) is one step from its first event to its
last.

A GPU trace (one with ``kernel``/``gpu_memcpy``/``gpu_memset`` events) is cut by its
device events only. A CPU trace is cut by its operators' own time: each instant of a
thread belongs to the innermost ``cpu_op`` running then, whose class is the first its
own name or an enclosing op's name says (:func:`simulator.traces.classes.cpu_op_class`),
``elementwise`` if none; communication is the c10d ops and gloo's work, on whichever
thread. On a CPU the profiler's own overhead stretches the operators.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from simulator.errors import Problem, UserError
from simulator.traces.classes import (
    CLASSES,
    COMM_CLASSES,
    COMPUTE_CLASSES,
    MEMCPY,
    SUMMARY,
    comm_kind,
    cpu_op_class,
    is_comm_name,
    kernel_class,
)
from simulator.traces.intervals import Interval, intersect, length, subtract, union
from simulator.traces.reader import TraceFile, finite_number

US = 1e-6  # trace times are microseconds
STEP_ANNOTATION = re.compile(r"^ProfilerStep#\d+$")
#: Device events by category, lower-cased: older Kineto wrote Kernel, Memcpy, Memset
#: (HolisticTraceAnalysis takes both: hta/analyzers/breakdown_analysis.py kernel_cats).
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
#: Bytes per element of the ``dtype`` argument of a collective's event.
ELEMENT_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "bfloat16": 2,
                 "half": 2, "float16": 2, "int": 4, "int32": 4, "long": 8, "int64": 8,
                 "byte": 1, "char": 1, "bool": 1, "uint8": 1, "int8": 1}
#: Per-rank figures: the classes, the summary, each collective kind's bytes, the steps.
FIGURES = (*CLASSES, *SUMMARY, *(f"bytes_{k}" for k in COMM_CLASSES))


def _interval(e: Mapping[str, Any]) -> Interval:
    start = float(e["ts"])
    return start, start + float(e["dur"])


def _cat(e: Mapping[str, Any]) -> str:
    """The event's category, lower-cased (see :data:`DEVICE_CATS`)."""
    return str(e.get("cat", "")).lower()


def is_device_trace(events: Iterable[Mapping[str, Any]]) -> bool:
    return any(_cat(e) in DEVICE_CATS for e in events)


def step_windows(events: list[dict[str, Any]], device: bool) -> list[Interval]:
    """The ``ProfilerStep#N`` spans (device-side first on a GPU trace), else the whole
    trace as one step; empty for a trace without events."""
    for cat in ("gpu_user_annotation", "user_annotation") if device else ("user_annotation",):
        steps = [_interval(e) for e in events
                 if e.get("cat") == cat and STEP_ANNOTATION.match(str(e.get("name", "")))]
        if steps:
            return steps
    spans = [_interval(e) for e in events if e.get("cat") != "Trace"]
    return [(min(s for s, _ in spans), max(e for _, e in spans))] if spans else []


def message_bytes(args: Mapping[str, Any]) -> float:
    """A collective's payload from its event's arguments (the larger of its input and
    output; 0 where the trace does not say)."""
    size = ELEMENT_BYTES.get(str(args.get("dtype", "")).lower(), 0)
    counts = (finite_number(args.get(k)) for k in ("In msg nelems", "Out msg nelems"))
    n = max((c for c in counts if c is not None and c >= 0), default=0.0)
    return n * size


def device_classes(events: list[dict[str, Any]]
                   ) -> tuple[dict[str, list[Interval]], list[tuple[float, str, float]]]:
    """Each class's kernel intervals, and each collective kernel's (start, kind, bytes)."""
    out: dict[str, list[Interval]] = defaultdict(list)
    calls = []
    for e in events:
        cat = _cat(e)
        if cat not in DEVICE_CATS:
            continue
        args = e.get("args", {})
        collective = args.get("Collective name")
        cls = MEMCPY if cat != "kernel" else kernel_class(
            str(e.get("name", "")), collective if isinstance(collective, str) else None)
        out[cls].append(_interval(e))
        if cls in COMM_CLASSES:
            calls.append((float(e["ts"]), cls, message_bytes(args)))
    return out, calls


def _self_time(ops: list[tuple[float, float, str | None]],
               out: dict[str, list[Interval]]) -> None:
    """Give each instant of one thread to its innermost op's class (see module notes)."""
    stack: list[tuple[float, str]] = []  # (end, class), innermost last
    t = -math.inf

    def close(now: float) -> None:
        nonlocal t
        while stack and stack[-1][0] <= now:
            end, cls = stack.pop()
            out[cls].append((t, end))
            t = end

    for start, stop, own in sorted(ops, key=lambda o: (o[0], -o[1])):
        close(start)
        end = stop
        if stack:
            out[stack[-1][1]].append((t, start))
            end = min(stop, stack[-1][0])  # a child the clock let outlive its parent
        stack.append((end, own or (stack[-1][1] if stack else "elementwise")))
        t = start
    close(math.inf)


def cpu_classes(events: list[dict[str, Any]]) -> dict[str, list[Interval]]:
    """Each class's intervals of a CPU trace: operators' own time by thread, and the
    communication annotations (gloo's work) whole."""
    out: dict[str, list[Interval]] = defaultdict(list)
    threads: dict[tuple[Any, Any], list[tuple[float, float, str | None]]] = defaultdict(list)
    for e in events:
        name, cat = str(e.get("name", "")), e.get("cat")
        if cat == "cpu_op":
            threads[(e.get("pid"), e.get("tid"))].append((*_interval(e), cpu_op_class(name)))
        elif cat == "user_annotation" and is_comm_name(name):
            out[comm_kind(name)].append(_interval(e))
    for ops in threads.values():
        _self_time(ops, out)
    return out


def figures(classes: Mapping[str, list[Interval]], windows: list[Interval],
            calls: Iterable[tuple[float, str, float]] = ()) -> dict[str, float]:
    """Seconds of each figure (:data:`FIGURES`) inside ``windows``, all steps together."""
    win = union(windows)
    per = {c: intersect(union(classes.get(c, [])), win) for c in CLASSES}
    compute = union(iv for c in COMPUTE_CLASSES for iv in per[c])
    comm = union(iv for c in COMM_CLASSES for iv in per[c])
    busy = union([*compute, *comm, *per[MEMCPY]])
    out = {c: length(per[c]) * US for c in CLASSES}
    out.update(compute=length(compute) * US, comm=length(comm) * US,
               exposed_comm=length(subtract(comm, compute)) * US,
               idle=(length(win) - length(busy)) * US, step=length(win) * US)
    for kind in COMM_CLASSES:
        out[f"bytes_{kind}"] = 0.0
    for start, kind, nbytes in calls:
        if any(a <= start < b for a, b in win):
            out[f"bytes_{kind}"] += nbytes
    return out


def trace_figures(t: TraceFile) -> tuple[dict[str, float], int]:
    """One file's figures, all its steps together, and how many steps it holds."""
    device = is_device_trace(t.events)
    windows = step_windows(t.events, device)
    if not windows:
        raise UserError([Problem("", None, f"{t.path}: traceEvents holds no complete event "
                                 "(ph X); was the profiler stopped before any step?")])
    if device:
        classes, calls = device_classes(t.events)
        return figures(classes, windows, calls), len(windows)
    return figures(cpu_classes(t.events), windows), len(windows)


def rank_figures(files: list[TraceFile]) -> dict[str, float]:
    """One rank's figures per step: its files' figures added up, over their steps."""
    total: dict[str, float] = dict.fromkeys(FIGURES, 0.0)
    steps = 0
    for t in files:
        fig, n = trace_figures(t)
        steps += n
        for k, v in fig.items():
            total[k] += v
    out = {k: v / steps for k, v in total.items()}
    out["steps"] = float(steps)
    return out
