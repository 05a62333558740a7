"""The interference factor: how much slower a GEMM runs while a collective overlaps it.

Measured inside the collective benchmark's torchrun launch
(:mod:`calibration.microbench.collectives_worker`), on its group of two ranks, so
no extra processes start. Both ranks time the same square GEMM, in rounds:

1. alone: samples of back-to-back GEMMs between group barriers;
2. overlapped: the ranks issue a train of asynchronous all-reduces (gloo's worker
   threads on a CPU, NCCL's stream on a GPU), sized to outlast the GEMM samples
   twice over, then time the same GEMM samples while the train runs, then wait
   for it.

A round's ratio is the overlapped median over the alone median; the factor is
the median ratio over three rounds, the slowest rank's (compute is done when the
last rank is), clamped to [1, 10] as the profile's schema requires. Whether the
train was still running when the last GEMM sample ended is recorded
(``covered``): a train that ended early would understate the slowdown. GEMM
samples on a GPU are timed with events on the compute stream, which the NCCL
stream does not join. One node holds one link class, ``intra_node``; the
inter-node factor stays the preset's (none).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from calibration.microbench.bench_results import link_of
from calibration.microbench.dist import rank_max, sync
from calibration.microbench.spread import mean_rel_se
from calibration.microbench.terms.burst import GEMM_SIZE, square_gemm

COMM_BYTES = {"cpu": 4 << 20, "cuda": 256 << 20}
ROUNDS = 3
SAMPLES = 7
MAX_FACTOR = 10.0
KIND = "interference"
OP = "all_reduce"
FLAG = "--interference"
HELP = "also time a GEMM alone and under all-reduces (ranks 0 and 1)"
#: what the profile's ``provenance.fit`` keeps of the record
FIT_FIELDS: tuple[str, ...] = ("factor", "round_ratios", "alone_s", "overlapped_s", "covered",
                               "bytes")


def key(device: str, threads: int) -> str:
    return f"{device}/t{threads}/interference/intra_node/all_reduce/n2/{COMM_BYTES[device]}"


interference_key = key  # its name before the registry (tests key records by it)


def summary(rec: dict[str, Any]) -> str:
    return (f"[interference] GEMM {GEMM_SIZE[rec['device']]}^3 alone "
            f"{rec['alone_s'] * 1e3:.3f} ms, with all-reduce {rec['overlapped_s'] * 1e3:.3f} ms: "
            f"factor {rec['factor']:.3f}")


def rounds(device: str, group: Any, dev: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    buf = torch.empty(COMM_BYTES[device] // 4, device=dev).uniform_(-1, 1)
    gemm = _timer(square_gemm(device, dev), dev)
    for _ in range(2):  # warm-up: allocator, kernels, the communicator
        gemm(1)
        dist.all_reduce(buf, group=group)
    per_call = min(gemm(1) for _ in range(3))
    k = max(1, math.ceil((2e-3 if device == "cpu" else 1e-3) / per_call))
    dist.barrier(group=group)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(buf, group=group)
    sync(dev)
    comm = rank_max((time.perf_counter() - t0) / 3, group, dev)
    window = rank_max(SAMPLES * k * per_call, group, dev)
    trains = min(1000, max(2, math.ceil(2 * window / comm)))
    ratios, alone, over, covered = [], [], [], True
    for _ in range(ROUNDS):
        dist.barrier(group=group)
        alone.append(statistics.median(gemm(k) for _ in range(SAMPLES)))
        dist.barrier(group=group)
        works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(trains)]
        over.append(statistics.median(gemm(k) for _ in range(SAMPLES)))
        covered = covered and not works[-1].is_completed()
        for w in works:
            w.wait()
        sync(dev)
        ratios.append(over[-1] / alone[-1])
    worst = [rank_max(r, group, dev) for r in ratios]
    factor = min(max(statistics.median(worst), 1.0), MAX_FACTOR)
    return {"bytes": COMM_BYTES[device], "factor": factor,
            "round_ratios": [round(r, 4) for r in worst],
            "alone_s": statistics.median(alone) / k, "overlapped_s": statistics.median(over) / k,
            "calls": k, "trains": trains, "comm_call_s": comm, "covered": bool(covered)}


def _timer(call: Callable[[], object], dev: str) -> Callable[[int], float]:
    """Seconds for ``k`` back-to-back calls, timed on the compute stream only."""
    import torch

    def run(k: int) -> float:
        if dev.startswith("cuda"):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(k):
                call()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        t0 = time.perf_counter()
        for _ in range(k):
            call()
        return time.perf_counter() - t0
    return run


# ---------------------------------------------------------------- the fit (no torch)


def fit(records: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any] | None]:
    """The factor per link class, from the latest successful record (and that record)."""
    ok = [r for r in records if r.get("ok") and "factor" in r]
    if not ok:
        return {}, None
    rec = ok[-1]
    return {link_of(rec): float(rec["factor"])}, rec


def uncertainty(rec: dict[str, Any] | None) -> float | None:
    """The standard error of the mean round ratio, relative to it."""
    return mean_rel_se([float(x) for x in (rec or {}).get("round_ratios", [])])


def provenance(rec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Samples (rounds) and what ``provenance.terms`` says of the record."""
    return len(rec.get("round_ratios", [])), {"link": rec.get("link", "intra_node"),
                                              "covered": rec.get("covered")}
