"""Split one profiled training step into compute and communication time.

Input is the Chrome trace-event JSON that ``torch.profiler`` exports (the
``trace.json`` of a measured run); output is wall-clock seconds, so it stays
comparable with the simulator's per-rank figures.  Pure Python, no torch.

What counts (names compared case-insensitively):

* **communication** - complete events (``ph == "X"``) whose name contains
  ``allreduce``/``all_reduce``, ``allgather``/``all_gather``,
  ``reduce_scatter``/``reducescatter``, ``alltoall``/``all_to_all``,
  ``send``, ``recv``, ``broadcast`` or ``wait_tensor`` (the functional-
  collective wait DTensor uses): the c10d ops (``c10d::allreduce_``),
  functional collectives (``_c10d_functional::all_gather_into_tensor``),
  backend spans (``gloo:all_reduce``) and NCCL kernels
  (``ncclDevKernel_AllReduce...``).  ``aten::`` operators never count (so
  ``aten::broadcast_tensors`` stays compute).
* **compute** (forward + backward) - on CUDA, every other GPU kernel
  (category ``kernel``); on CPU, every ``aten::`` operator (category
  ``cpu_op``) not nested in a communication operator (``c10d::``,
  ``_c10d_functional::``) of its own thread.  Time inside the
  ``Optimizer.step``/``Optimizer.zero_grad`` annotations is reported apart as
  ``optimizer_s``.

Each class is the *union* of its intervals, so nested and concurrent events
count once.  On CPU a communication span is the whole life of the gloo work
(``gloo:send`` runs from enqueue to completion, on whichever thread), so
``comm_s`` includes time spent waiting for the peer: a pipeline stage's bubble
shows up as receive time.  ``exposed_comm_s`` is the communication time not
overlapped by compute - the simulator's exposed communication plus, under
pipelining, its bubble.  FSDP's ``FSDP::all_gather`` annotations count as
communication; the copy-in/copy-out ops inside them count as compute too.
"""

from __future__ import annotations

from typing import Any

from simulator.traces.classes import COMM_PATTERN
from simulator.traces.intervals import Interval, length, subtract, union

__all__ = ["COMM_PATTERN", "Interval", "breakdown_from_trace", "is_comm", "length",
           "subtract", "trace_intervals", "union"]


def is_comm(name: str) -> bool:
    """Whether a trace event of this name is communication (see module docstring)."""
    return not name.startswith("aten::") and COMM_PATTERN.search(name) is not None


def _spans(trace: dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def _interval(e: dict[str, Any]) -> Interval:
    start = float(e["ts"])
    return start, start + float(e["dur"])


def trace_intervals(
    trace: dict[str, Any] | list[Any], device_type: str = "cpu"
) -> dict[str, list[Interval]]:
    """Disjoint µs intervals of one trace: ``compute`` (forward + backward), ``comm``,
    ``optimizer`` and ``work`` (everything computed, optimizer included)."""
    spans = _spans(trace)
    gpu = device_type == "cuda"
    comm_cats = ("kernel",) if gpu else ("cpu_op", "user_annotation")
    comm: list[Interval] = []
    blocking_by_thread: dict[Any, list[Interval]] = {}
    compute_by_thread: dict[Any, list[Interval]] = {}
    optimizer: list[Interval] = []
    for e in spans:
        name, cat = str(e.get("name", "")), e.get("cat")
        thread = (e.get("pid"), e.get("tid"))
        if cat in comm_cats and is_comm(name):
            comm.append(_interval(e))
            if cat == "cpu_op":
                blocking_by_thread.setdefault(thread, []).append(_interval(e))
        elif cat == ("kernel" if gpu else "cpu_op") and (gpu or name.startswith("aten::")):
            compute_by_thread.setdefault(thread, []).append(_interval(e))
        # On GPUs kernels run after their launch: use the GPU-side copy of the annotation.
        if cat == ("gpu_user_annotation" if gpu else "user_annotation") and name.startswith(
            "Optimizer."
        ):
            optimizer.append(_interval(e))
    # An aten op inside a c10d/functional-collective op of its own thread (a
    # copy into the send buffer) is part of that collective.
    work = union(
        iv
        for thread, ivs in compute_by_thread.items()
        for iv in subtract(union(ivs), union(blocking_by_thread.get(thread, [])))
    )
    opt = union(optimizer)
    return {"compute": subtract(work, opt), "comm": union(comm),
            "optimizer": subtract(work, subtract(work, opt)), "work": work,
            "traced": union(_interval(e) for e in spans)}


def breakdown_from_trace(
    trace: dict[str, Any] | list[Any], device_type: str = "cpu"
) -> dict[str, float]:
    """``compute_s``, ``comm_s``, ``exposed_comm_s``, ``optimizer_s`` and ``traced_s`` of one trace.

    ``compute_s`` is forward + backward only: time inside the optimizer's
    ``Optimizer.step``/``zero_grad`` annotations is ``optimizer_s``.
    """
    iv = trace_intervals(trace, device_type)
    traced = iv["traced"]
    total = (traced[-1][1] - traced[0][0]) if traced else 0.0
    us = 1e-6
    return {
        "compute_s": length(iv["compute"]) * us,
        "comm_s": length(iv["comm"]) * us,
        "exposed_comm_s": length(subtract(iv["comm"], iv["work"])) * us,
        "optimizer_s": length(iv["optimizer"]) * us,
        "traced_s": total * us,
    }
