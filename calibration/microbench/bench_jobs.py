"""The walk over a benchmark's jobs: skip what the results hold, time each job, append
its record at once, then recheck the slow ones.

The walk skips keys the results file already holds (a resumed run), times each kernel
through its job's runner and appends the record at once. An exception (out of memory,
an unsupported dtype, an injected failure) becomes a failure record and the walk goes
on.

Recheck passes. On a shared machine another process can take the core for
seconds, and every kernel timed in that window reads slow. After the walk, each
point whose rate (FLOP/s or bytes/s) is more than 15% below the median of its
neighbours by size (two on each side; the same kernel for memory-bound ones) is
timed again, later, in a second and third pass; the fitter keeps each key's fastest reading
(interference only ever adds time, and a genuinely slow shape stays slow). A
marker record per finished pass lets a resumed run skip it.

A busy-machine re-measure (``Budget.retry`` > 0) times every job again, whatever
the results already hold; the fitter keeps each key's fastest reading.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from calibration.microbench.bench_results import (
    ResultsStore,
    check_injected_failure,
    failure_record,
    progress,
)
from calibration.microbench.bench_timing import Budget, Device
from simulator.outputs.progress import progress_bar

RECHECK_SLOWER_THAN = 1.15
Runner = Callable[[], tuple[float, dict[str, Any]]]


@dataclass(frozen=True)
class Job:
    key: str
    kind: str  # gemm | attention | memory
    label: str
    size: float  # FLOPs or bytes
    group: str  # points expected on one smooth curve (the kernel, for memory-bound ones)
    meta: dict[str, Any]
    runner: Runner


def key_prefix(device: Device, dtype: str) -> str:
    return f"{device.kind}/{dtype}/t{device.threads}"


def run_jobs(stage: str, jobs: list[Job], store: ResultsStore, budget: Budget,
             unit: str) -> None:
    """Measure every job not yet in the results, then the recheck passes; on a
    busy-machine retry, every job once more."""
    done = store.done()
    if budget.retry:
        _retry(stage, jobs, store, unit, budget.retry, done)
        return
    with progress_bar(len(jobs), stage) as bar:  # a terminal's bar, after 2 s
        for i, job in enumerate(jobs, 1):
            if job.key in done:
                progress(stage, i, len(jobs), f"{job.label}: already in results, skipped")
            else:
                _measure(stage, i, len(jobs), job, store, unit, 0)
            bar.update()
    for p in range(1, budget.recheck_passes + 1):
        if not jobs:
            break
        m = jobs[0].meta
        marker = f"{m['device']}/{m['dtype']}/t{m['threads']}/{stage}#recheck{p}"
        if marker in done:
            continue
        slow = _slow_jobs(jobs, best_times(store.records()))
        for i, job in enumerate(slow, 1):
            _measure(f"{stage} recheck {p}", i, len(slow), job, store, unit, p)
        store.append({"key": marker, "kind": "pass", "ok": True, "rechecked": len(slow)})


def _retry(stage: str, jobs: list[Job], store: ResultsStore, unit: str, attempt: int,
           done: set[str]) -> None:
    """Re-time every job (a marker per finished attempt lets a resumed run skip it)."""
    if not jobs:
        return
    m = jobs[0].meta
    marker = f"{m['device']}/{m['dtype']}/t{m['threads']}/{stage}#retry{attempt}"
    if marker in done:
        return
    for i, job in enumerate(jobs, 1):
        _measure(f"{stage} retry {attempt}", i, len(jobs), job, store, unit, f"retry{attempt}")
    store.append({"key": marker, "kind": "pass", "ok": True, "retried": len(jobs)})


def _measure(stage: str, i: int, total: int, job: Job, store: ResultsStore, unit: str,
             recheck: int | str) -> None:
    try:
        check_injected_failure(job.key)
        time_s, extra = job.runner()
    except Exception as exc:  # OOM, unsupported kernel/dtype, injected: record, skip
        rec = failure_record(job.key, job.kind, exc, **job.meta)
        store.append(rec)
        progress(stage, i, total, f"{job.label}: FAILED ({rec['error']})")
        _free_cache()
        return
    store.append({"key": job.key, "kind": job.kind, "ok": True, "time_s": time_s,
                  "pass": recheck, **job.meta, **extra})
    rate = job.size / time_s
    text = (f"{rate / 1e12:.4g} TFLOP/s" if unit == "flops" else f"{rate / 1e9:.3g} GB/s")
    progress(stage, i, total, f"{job.label}: {_fmt_time(time_s)}, {text}")


def _fmt_time(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def best_times(records: list[dict[str, Any]]) -> dict[str, float]:
    """Fastest successful reading per key (what the fitter uses)."""
    best: dict[str, float] = {}
    for r in records:
        if r.get("ok") and "time_s" in r:
            best[r["key"]] = min(best.get(r["key"], math.inf), float(r["time_s"]))
    return best


def _slow_jobs(jobs: list[Job], best: dict[str, float]) -> list[Job]:
    """Jobs >15% slower than their neighbours (two on each side by size, same group) suggest."""
    import statistics

    out: list[Job] = []
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        if job.key in best:
            groups.setdefault(job.group, []).append(job)
    for members in groups.values():
        members.sort(key=lambda j: j.size)
        rate = [j.size / best[j.key] for j in members]
        for i, job in enumerate(members):
            near = sorted(range(len(members)), key=lambda k: abs(k - i))[1:5]
            near = [k for k in near if abs(k - i) <= 2] or near[:2]
            if len(near) >= 2 and rate[i] * RECHECK_SLOWER_THAN < statistics.median(
                    rate[k] for k in near):
                out.append(job)
    return sorted(out, key=lambda j: j.size)


def _free_cache() -> None:
    with contextlib.suppress(Exception):  # best effort: freeing the cache is optional
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
