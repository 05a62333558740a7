"""The host time of DTensor's redistributions: what a functional collective costs the
issuing thread beyond a plain c10d collective of the same bytes, by kind
(``gpu.funcol_host``).

Tensor parallelism as DTensor (``parallelize_module``, as our measured TP runs use it)
does not call ``dist.all_reduce``: a ``Partial`` output becomes ``Replicate`` (an
all-reduce), a ``Shard`` input ``Replicate`` (an all-gather), a ``Partial`` output
``Shard`` (a reduce-scatter) through ``DTensor.redistribute``, which plans the
transform and issues a functional collective (``torch/distributed/tensor/_redistribute.py``;
``torch/distributed/_functional_collectives.py``: an out-of-place collective whose result
is an ``AsyncCollectiveTensor``, waited on by ``wait_tensor``; an all-gather or
reduce-scatter along a dimension other than 0 chunks and concatenates around the
collective, a copy of the whole message). In the profiler traces of our measured CPU TP
runs that costs the issuing thread 0.2-0.4 ms per all-reduce and 0.45-1.0 ms per
all-gather or reduce-scatter beyond the issue and the wait (more with more bytes). On
one rank none of it shows: a one-rank mesh issues no collective (checked with the
profiler), so :mod:`calibration.measured.host_cost` cannot see it.

Measured in the collective benchmark's torchrun launch, on its group of two ranks, as
the issuing thread's CPU time (``time.thread_time``): the collective's transfer and its
wait for the peer run on the backend's threads or the device and cost the issuing
thread none, so the figure is the host work alone, free of the ranks' skew and the
transfer's scatter that make a wall-clock difference of two collectives useless on a
shared VM (on this project's 2-core VM the wall time of the same 64 KiB all-reduce
ranges 0.5-2 ms; its thread time 65-115 µs). For each kind and each size S
(:data:`SIZES`, activations ``[2, S / 1 KiB, 128]`` in fp32, sharded on dimension 1,
the sequence, as sequence parallelism shards them), in rounds, both ranks:

1. ``plain``: K calls of the c10d collective (``all_reduce``, ``all_gather_into_tensor``,
   ``reduce_scatter_tensor``), each call's thread time, their median;
2. ``dtensor``: K redistributions of a DTensor made once beforehand (DTensor's
   parallel styles make theirs in the op that produces it, which the one-rank host
   cost already times), each waited on, each call's thread time, their median.

The order of the two alternates between rounds. A round's excess at S is the ranks'
mean of ``dtensor − plain``, a size's the median over rounds, and a kind's figure the
least-squares line through its sizes' excesses, ``a + b · bytes`` (both at least 0: a
negative slope is read as none and the intercept as the sizes' median, a negative
intercept as a line through the origin):
:func:`host_lines`. The simulator charges ``a + b · bytes`` on the compute stream
before each functional collective of a DTensor stack, by its kind and bytes
(:meth:`simulator.system.costs.CostModel.funcol_s`); the plain collective's own cost after
compute (``gpu.collective_sync_us``) is charged as for any collective.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, get_args

from calibration.microbench.bench_results import latest_rounds
from calibration.microbench.dist import gather, human, sync
from calibration.microbench.spread import rounds_spread
from simulator.system.units import FuncolKind

ITERATIONS = 24
ROUNDS = 5
KIND = "funcol_host"
OP = "redistribute"
FLAG = "--funcol-host"
HELP = ("also time the host thread of DTensor's redistributions against the plain c10d "
        "collectives, by kind (ranks 0, 1)")
#: what the profile's ``provenance.fit`` keeps of the record
FIT_FIELDS: tuple[str, ...] = ("iterations", "sizes", "hidden", "clock")
#: The redistributions timed, by the collective each issues.
KINDS: tuple[str, ...] = get_args(FuncolKind)
#: Message sizes (bytes of the whole activation): our tiny-gpt's TP activation (64 KiB)
#: to small-gpt's (1 MiB) on CPU, a wider span on CUDA.
SIZES = {"cpu": (64 << 10, 256 << 10, 1 << 20), "cuda": (64 << 10, 1 << 20, 16 << 20)}
HIDDEN = 128  # the activations' last dimension
MIB = float(1 << 20)


# ---------------------------------------------------------------- the figure (no torch)


def round_excess(row: dict[str, Any]) -> float:
    """Seconds per call the DTensor path adds at one kind and size in one round: the
    ranks' mean of ``dtensor − plain``."""
    return statistics.fmean(d - p for p, d in zip(row["plain_s"], row["dtensor_s"],
                                                  strict=True))


def excess_by_size(rec: dict[str, Any], kind: str) -> dict[int, float]:
    """A kind's median excess over the rounds at each size, seconds, by bytes."""
    by: dict[int, list[float]] = {}
    for rnd in rec["rounds"]:
        for row in rnd:
            if row["op"] == kind:
                by.setdefault(int(row["bytes"]), []).append(round_excess(row))
    return {s: statistics.median(v) for s, v in sorted(by.items())}


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """``(a, b)``, seconds and seconds per byte: the least-squares line through
    ``points`` (bytes -> seconds), both at least 0; with a negative slope (or one
    point), no slope and the points' median."""
    if not points:
        return 0.0, 0.0
    xs, ys = list(points), list(points.values())
    if len(xs) > 1:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if b >= 0 and my - b * mx >= 0:
            return my - b * mx, b
        if b >= 0:  # through the origin: the line's intercept would be negative
            return 0.0, max(sum(x * y for x, y in zip(xs, ys, strict=True))
                            / sum(x * x for x in xs), 0.0)
    return max(statistics.median(ys), 0.0), 0.0


def host_lines(rec: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Each measured kind's ``(a, b)`` (:func:`fit_line` of :func:`excess_by_size`)."""
    kinds = {row["op"] for rnd in rec["rounds"] for row in rnd}
    return {k: fit_line(excess_by_size(rec, k)) for k in KINDS if k in kinds}


def seconds_at(line: tuple[float, float], nbytes: float) -> float:
    return line[0] + line[1] * nbytes


def round_figures(rec: dict[str, Any]) -> list[float]:
    """Each round's mean excess over its kinds and sizes: the samples of the level's
    spread."""
    return [statistics.fmean(round_excess(row) for row in rnd) for rnd in rec["rounds"]]


def level_seconds(rec: dict[str, Any]) -> float:
    """The figures' level: the mean over kinds and sizes of the fitted lines."""
    lines = host_lines(rec)
    sizes = rec.get("sizes") or [0]
    vals = [seconds_at(line, s) for line in lines.values() for s in sizes]
    return statistics.fmean(vals) if vals else 0.0


# ---------------------------------------------------------------- measuring


def key(device: str, threads: int) -> str:
    return f"{device}/t{threads}/funcol_host/intra_node/redistribute/n2"


host_key = key  # its name before the registry (tests key records by it)


def summary(rec: dict[str, Any]) -> str:
    parts = []
    for kind, (a, b) in host_lines(rec).items():
        sizes = ", ".join(f"{human(s)} {t * 1e6:.0f}" for s, t in
                          excess_by_size(rec, kind).items())
        parts.append(f"{kind} {a * 1e6:.0f} us + {b * MIB * 1e6:.0f} us/MiB ({sizes} us)")
    return "[funcol host] DTensor redistribution's thread time beyond the c10d call: " \
        + "; ".join(parts)


def rounds(device: str, group: Any, dev: str) -> dict[str, Any]:
    """The record's measurements, on ranks 0 and 1 of ``group`` (each runs this)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, device)
    sizes = SIZES[device]
    loops = {(k, s): _loops(k, s, mesh, group, dev) for s in sizes for k in KINDS}
    for both in loops.values():  # warm-up: the communicator, DTensor's caches, each size
        for loop in both:
            loop(2)
    out = [_round(r, loops, group, dev) for r in range(ROUNDS)]
    return {"iterations": ITERATIONS, "sizes": list(sizes), "hidden": HIDDEN,
            "clock": "thread_time", "rounds": out}


#: A kind's two loops at one size: the plain collective's and the redistribution's.
Pair = tuple[Callable[[int], list[float]], Callable[[int], list[float]]]


def _round(r: int, loops: dict[tuple[str, int], Pair], group: Any,
           dev: str) -> list[dict[str, Any]]:
    """Round ``r``: per kind and size, every rank's median thread time of the plain call
    and of the redistribution (which goes first alternates between rounds)."""
    rows = []
    for (kind, s), (plain_loop, dt_loop) in loops.items():
        first, second = (plain_loop, dt_loop) if r % 2 == 0 else (dt_loop, plain_loop)
        a, b = statistics.median(first(ITERATIONS)), statistics.median(second(ITERATIONS))
        times = [a, b] if r % 2 == 0 else [b, a]
        rows.append({"op": kind, "bytes": s,
                     **dict(zip(("plain_s", "dtensor_s"), gather(times, group, dev),
                                strict=True))})
    return rows


def _thread_timed(call: Callable[[], object], group: Any,
                  dev: str) -> Callable[[int], list[float]]:
    """The issuing thread's seconds of each of ``k`` calls, after a group barrier."""
    import torch.distributed as dist

    def run(k: int) -> list[float]:
        dist.barrier(group=group)
        out = []
        for _ in range(k):
            sync(dev)
            t0 = time.thread_time()
            call()
            out.append(time.thread_time() - t0)
        sync(dev)
        return out
    return run


def _loops(kind: str, nbytes: int, mesh: Any, group: Any, dev: str) -> Pair:
    """The plain c10d collective of ``kind`` and the DTensor redistribution that issues
    it, on activations of ``nbytes`` sharded on the sequence, as thread-timed loops."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    n = dist.get_world_size(group)
    s = nbytes // (2 * HIDDEN * 4)
    full = torch.zeros(2, s, HIDDEN, device=dev)  # zeros: repeated sums stay finite
    part = torch.zeros(2, s // n, HIDDEN, device=dev)
    gathered = torch.empty(2 * n, s // n, HIDDEN, device=dev)
    scattered = torch.empty(2 // n, s, HIDDEN, device=dev)  # the group is two ranks
    src, dst, local = {"all_reduce": (Partial(), Replicate(), full),
                       "all_gather": (Shard(1), Replicate(), part),
                       "reduce_scatter": (Partial(), Shard(1), full)}[kind]
    dt = DTensor.from_local(local, mesh, [src], run_check=False)

    def plain() -> None:
        if kind == "all_reduce":
            dist.all_reduce(full, group=group)
        elif kind == "all_gather":
            dist.all_gather_into_tensor(gathered, part, group=group)
        else:
            dist.reduce_scatter_tensor(scattered, full, group=group)

    def redistribute() -> None:
        funcol.wait_tensor(dt.redistribute(mesh, [dst])._local_tensor)
    return _thread_timed(plain, group, dev), _thread_timed(redistribute, group, dev)


# ---------------------------------------------------------------- the fit (no torch)


def fit(records: list[dict[str, Any]]) -> tuple[dict[str, tuple[float, float]],
                                                dict[str, Any] | None]:
    """The host time of DTensor's redistributions beyond the plain collectives, per kind
    ``(seconds, seconds per byte)``, from the latest successful record (and that
    record)."""
    rec = latest_rounds(records)
    return ({}, None) if rec is None else (host_lines(rec), rec)


def uncertainty(rec: dict[str, Any] | None) -> float | None:
    """The standard error of the rounds' figures relative to the lines' level."""
    return rounds_spread(rec, level_seconds, round_figures)


def provenance(rec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Samples (rounds) and what ``provenance.terms`` says of the record: each fitted
    kind's excess by size."""
    return len(rec["rounds"]), {
        "link": rec.get("link", "intra_node"), "clock": rec.get("clock"),
        "by_size_us": {kind: {s: round(t * 1e6, 1) for s, t in excess_by_size(rec, kind).items()}
                       for kind in host_lines(rec)}}
