"""The functional collective's cost after compute: what DTensor's redistribution costs
beyond a plain c10d collective of the same bytes (``gpu.funcol_sync_us``).

Tensor parallelism as DTensor (``parallelize_module``, as our measured TP runs use it)
does not call ``dist.all_reduce``: a ``Partial`` output becomes ``Replicate`` through
``DTensor.redistribute``, which issues a functional collective
(``torch.distributed._functional_collectives``: an out-of-place ``all_reduce`` whose
result is an ``AsyncCollectiveTensor``, its work registered and waited on at first use
by ``wait_tensor``; ``torch/distributed/tensor/_redistribute.py`` and
``torch/distributed/_functional_collectives.py``). On one rank that costs some tens of
microseconds of host time more than the plain call (``gpu.funcol_overhead_us``,
:mod:`calibration.measured.host_cost`). Between two ranks after compute it costs far more:
on the project's 2-core VM the same 64 KiB-1 MiB all-reduce after a 1 ms GEMM burst took
0.8-1.5 ms longer through ``redistribute`` than through ``dist.all_reduce`` (median of 7
rounds; the rounds scatter from 0 to 2.9 ms), and an all-gather from ``Shard(0)`` about
1 ms longer than ``all_gather_into_tensor``; the TP rows of the CPU validation read 12-21%
short without it, the DDP and pipeline rows, which issue plain collectives, within a few
percent.

Measured in the collective benchmark's torchrun launch, on its group of two ranks, with
the collective sync cost's burst (:func:`calibration.microbench.collective_sync.make_burst`,
square GEMMs, the same count on both ranks). For each message size S (the collective
sync's sizes), in rounds, both ranks:

1. ``plain``: K iterations of the burst, each followed by ``dist.all_reduce`` of S bytes,
   their mean;
2. ``dtensor``: K iterations of the same burst, each followed by a ``Partial`` DTensor of
   S bytes redistributed to ``Replicate`` and its local tensor waited on, their mean.

The order of the two alternates between rounds. A round's excess at S is the ranks'
mean of ``dtensor − plain`` (the collective ends both ranks' iterations together), a
size's the median over rounds, and the figure the median over the sizes, at least 0
(:func:`sync_seconds`): everything the DTensor path adds after compute, its host time
included, so where the profile has it the simulator charges it instead of the one-rank
figure (:meth:`simulator.costs.CostModel.funcol_s`). One node holds one link class,
``intra_node``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from calibration.microbench import collective_sync as cs
from calibration.microbench.collectives_worker import _human

ITERATIONS = cs.ITERATIONS
ROUNDS = cs.ROUNDS
KIND = "funcol_sync"


# ---------------------------------------------------------------- the figure (no torch)


def round_excess(row: dict[str, Any]) -> float:
    """Seconds per collective the DTensor path adds at one size in one round: the ranks'
    mean of ``dtensor − plain``."""
    return statistics.fmean(d - p for p, d in zip(row["plain_s"], row["dtensor_s"],
                                                  strict=True))


def excess_by_size(rec: dict[str, Any]) -> dict[int, float]:
    """Each size's median excess over the rounds, seconds, by bytes."""
    return cs.excess_by_size(rec, round_excess)


def sync_seconds(rec: dict[str, Any]) -> float:
    """The figure: the median over sizes of :func:`excess_by_size`, at least 0."""
    return cs.sync_seconds(rec, round_excess)


def round_figures(rec: dict[str, Any]) -> list[float]:
    """Each round's median excess over its sizes: the samples of the figure's spread."""
    return cs.round_figures(rec, round_excess)


# ---------------------------------------------------------------- measuring


def sync_key(device: str, threads: int) -> str:
    return f"{device}/t{threads}/funcol_sync/intra_node/all_reduce/n2"


def summary(rec: dict[str, Any]) -> str:
    sizes = ", ".join(f"{_human(s)} {t * 1e6:.0f} us" for s, t in excess_by_size(rec).items())
    return (f"[funcol sync] burst {rec['burst_s'] * 1e3:.2f} ms; DTensor redistribution "
            f"beyond dist.all_reduce after compute {sizes}: {sync_seconds(rec) * 1e6:.0f} us")


def rounds(device: str, group: Any, dev: str) -> dict[str, Any]:
    """The record's measurements, on ranks 0 and 1 of ``group`` (each runs this)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = DeviceMesh.from_group(group, device)
    burst, meta = cs.make_burst(device, group, dev, cs.BURST_S)

    def plain(buf: Any) -> Callable[[], None]:
        def call() -> None:
            burst()
            dist.all_reduce(buf, group=group)
        return call

    def dtensor(buf: Any) -> Callable[[], None]:
        def call() -> None:
            burst()
            out = DTensor.from_local(buf, mesh, [Partial()], run_check=False)
            funcol.wait_tensor(out.redistribute(mesh, [Replicate()]).to_local())
        return call

    sizes = cs.SIZES[device]
    # zeros: a sum repeated hundreds of times stays finite
    bufs = {s: torch.zeros(s // 4, device=dev) for s in sizes}
    loops = {s: (cs._loop(plain(bufs[s]), group, dev), cs._loop(dtensor(bufs[s]), group, dev))
             for s in sizes}
    for pair in loops.values():  # warm-up: the communicator, DTensor's caches, each size
        for loop in pair:
            loop(2)
    out = []
    for r in range(ROUNDS):
        rows = []
        for s in sizes:
            first, second = loops[s] if r % 2 == 0 else loops[s][::-1]
            a, b = statistics.fmean(first(ITERATIONS)), statistics.fmean(second(ITERATIONS))
            times = [a, b] if r % 2 == 0 else [b, a]
            rows.append({"bytes": s, **dict(zip(("plain_s", "dtensor_s"),
                                                cs._gather(times, group, dev), strict=True))})
        out.append(rows)
    return {**meta, "iterations": ITERATIONS, "sizes": list(sizes), "rounds": out}
