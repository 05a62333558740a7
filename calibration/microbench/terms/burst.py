"""The compute the two-rank terms run between their collectives: a square GEMM, bursts
of it sized to a length of time, and the rounds that time a burst alone, followed by a
collective, and the collective back to back.

The interference factor times the GEMM (:mod:`calibration.microbench.terms.interference`);
the collective and send sync costs and the rank spread time bursts of it, the same count
of GEMMs on every rank (about the asked length on the slowest), so that both ranks do the
same work. :func:`sweep` is the sync costs' measurement: per size, each rank's median
``alone``, mean ``with`` and median ``b2b`` in every round, every rank's figures gathered
(:func:`calibration.microbench.dist.gather`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from calibration.microbench.dist import gather, rank_max, timed_loop

#: the square GEMM's size by device (the interference benchmark's and the bursts' default)
GEMM_SIZE = {"cpu": 256, "cuda": 4096}
#: Per size: the loops that time ``alone``, ``with`` and ``b2b``.
Loops = Mapping[int, Sequence[Callable[[int], list[float]]]]


def square_gemm(device: str, dev: str, size: int | None = None) -> Callable[[], object]:
    """One call of the square GEMM (``size``, default ``GEMM_SIZE``, bf16 on a GPU, fp32
    on a CPU) on random operands."""
    import torch

    n = size or GEMM_SIZE[device]
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.empty((n, n), dtype=dt, device=dev).uniform_(-1, 1) for _ in range(2))
    c = torch.empty((n, n), dtype=dt, device=dev)
    return lambda: torch.mm(a, b, out=c)


def make_burst(device: str, group: Any, dev: str, burst_s: float,
               size: int | None = None) -> tuple[Callable[[], None], dict[str, Any]]:
    """The compute burst (square GEMMs of ``size``, default the interference benchmark's,
    the same count on every rank, about ``burst_s`` on the slowest) and what the record
    says of it."""
    mm = square_gemm(device, dev, size)
    gemm = timed_loop(mm, group, dev)
    gemm(2)  # warm-up: allocator, kernels
    per_gemm = rank_max(min(gemm(3)), group, dev)
    gemms = max(1, math.ceil(burst_s / per_gemm))

    def burst() -> None:
        for _ in range(gemms):
            mm()
    return burst, {"burst_s": per_gemm * gemms, "gemms": gemms,
                   "gemm_size": size or GEMM_SIZE[device]}


def sweep(loops: Loops, group: Any, dev: str, n_rounds: int,
          iterations: int) -> list[list[dict[str, Any]]]:
    """Warm every loop up, then ``n_rounds`` rounds over the sizes (direction
    alternating), each row every rank's median ``alone``, mean ``with`` and median
    ``b2b`` (one entry per rank)."""
    for trio in loops.values():  # warm-up: the communicator, each size
        for loop in trio:
            loop(2)
    sizes = list(loops)
    out = []
    for r in range(n_rounds):
        rows: dict[int, dict[str, Any]] = {}
        for s in sizes if r % 2 == 0 else reversed(sizes):
            alone, with_, b2b = (loop(iterations) for loop in loops[s])
            times = [statistics.median(alone), statistics.fmean(with_), statistics.median(b2b)]
            rows[s] = {"bytes": s, **dict(zip(("alone_s", "with_s", "b2b_s"),
                                              gather(times, group, dev), strict=True))}
        out.append([rows[s] for s in sizes])
    return out
