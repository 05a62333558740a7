"""One torchrun worker of the collective benchmark (gloo on CPU, NCCL on CUDA).

Launched by :mod:`calibration.microbench.bench_collectives` as
``python -m torch.distributed.run --standalone --nproc-per-node N -m
calibration.microbench.collectives_worker --op all_reduce --sizes ... --groups 2,4 ...``.

Every rank reads the results file at start, so all ranks agree on what a resumed
run skips: a finished measurement is skipped whole, and each round of an
unfinished one is appended as a ``collective_round`` record the moment it is
taken (its round time, calls per sample and samples), so an interrupt loses at
most the round in progress and a resumed run measures exactly the rounds that
are missing, with the batch size the saved rounds used.

Group size n uses ranks 0..n−1 (one node: every group is intra-node); the other
ranks wait at a world barrier. Each size is warmed up, then timed in
samples of back-to-back calls between group barriers, each rank timing its own;
a sample's time is the slowest rank's (the collective is done when the last rank
is). All collectives and sizes of one group size are swept in interleaved rounds
(see ``_sweep``) and each keeps its quiet rounds' median. Rank 0 appends the
records and prints progress on stderr.

Sizes follow nccl-tests: S is the whole array (all-reduce buffer, all-gather
output, reduce-scatter input, the buffer each rank sends in send/recv), float32
elements, rounded down to a multiple of n elements.

After the sweep, ranks 0 and 1 measure the two-rank terms their flags ask for, in the
registry's order (:data:`calibration.microbench.terms.registry.TERMS`: each term's flag,
key, rounds and summary), and rank 0 appends each one's record.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

from calibration.microbench.bench_results import (
    ResultsStore,
    check_injected_failure,
    failure_record,
    measure_term,
)
from calibration.microbench.dist import human, make_call, quiet_time, rank_max, sync
from calibration.microbench.fit import Sample, busbw_factor, fit_alpha_beta
from calibration.microbench.terms.registry import TERMS


def collective_key(device: str, threads: int, op: str, n: int, size: int) -> str:
    return f"{device}/t{threads}/collective/{op}/n{n}/{size}"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--op", action="append", default=[])
    p.add_argument("--sizes", required=True, help="comma-separated bytes")
    p.add_argument("--groups", required=True, help="comma-separated group sizes")
    p.add_argument("--results", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target-s", type=float, default=0.1)
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=25)
    p.add_argument("--min-batch-s", type=float, default=2e-4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--op-timeout-s", type=float, default=120.0)
    for name, term in TERMS.items():  # the two-rank terms, each asked for by its flag
        p.add_argument(term.FLAG, action="store_true", dest=name, help=term.HELP)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import os

    import torch
    import torch.distributed as dist

    args = _parse(argv)
    torch.set_num_threads(args.threads)
    if args.device == "cpu":  # the measured CPU runs' allocator
        from calibration.host import keep_freed_memory

        keep_freed_memory()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = f"cuda:{local}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(local)
    backend = "nccl" if args.device == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=args.op_timeout_s)}
    if args.device == "cuda":
        kwargs["device_id"] = torch.device(dev)
    dist.init_process_group(backend, **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    store = ResultsStore(args.results)
    done = store.done()
    saved = saved_rounds(store.records())
    sizes = [int(s) for s in args.sizes.split(",")]
    groups = {n: dist.new_group(list(range(n))) for n in map(int, args.groups.split(","))
              if n <= world}
    for n, group in groups.items():
        todo = [(op, s) for op in args.op for s in sizes
                if collective_key(args.device, args.threads, op, n, s) not in done]
        if todo and rank < n:
            _sweep(args, store, n, todo, group, dev, rank, saved)
        dist.barrier()
    if 2 in groups:
        _pair_terms(args, store, done, groups[2], dev, rank)
    dist.destroy_process_group()
    return 0


def _pair_terms(args: argparse.Namespace, store: ResultsStore, done: set[str], group: Any,
                dev: str, rank: int) -> None:
    """The terms ranks 0 and 1 measure together after the sweep, each asked for by its
    flag and not yet in the results file: rank 0 records it (or its failure)."""
    import torch.distributed as dist

    meta = {"link": "intra_node", "nranks": 2, "device": args.device, "threads": args.threads}
    for name, term in TERMS.items():
        if not getattr(args, name):
            continue
        k = term.key(args.device, args.threads)
        if k not in done and rank < 2:
            rounds: Callable[[], dict[str, Any]] = partial(term.rounds, args.device, group, dev)
            measure_term(store, k, term.KIND, rank, rounds, term.summary, op=term.OP, **meta)
        dist.barrier()


@dataclass
class _Point:
    op: str
    size: int
    key: str
    nbytes: int = 0
    k: int = 0  # back-to-back calls per timed sample (0: not calibrated yet)
    reps: int = 5  # samples per round
    rounds: list[float] = field(default_factory=list)  # median seconds per call, per round
    failed: bool = False


def saved_rounds(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Round records of unfinished measurements, by measurement key, in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if rec.get("kind") == "collective_round" and rec.get("ok"):
            out.setdefault(str(rec.get("point")), []).append(rec)
    return out


def _resume(pt: _Point, rounds: list[dict[str, Any]]) -> None:
    """Start a point from its saved rounds (same calls per sample, same samples)."""
    if rounds:
        pt.k, pt.reps, pt.nbytes = (int(rounds[0][x]) for x in ("calls", "reps", "bytes"))
        pt.rounds = [float(rec["round_s"]) for rec in rounds]


def _sweep(args: argparse.Namespace, store: ResultsStore, n: int, todo: list[tuple[str, int]],
           group: Any, dev: str, rank: int,
           saved: dict[str, list[dict[str, Any]]] | None = None) -> None:
    """Measure every (op, size) of group size n in interleaved rounds.

    On a shared machine another process takes a core for a while, and whatever is
    measured inside that window reads slow. Each round sweeps all collectives and
    sizes (ops interleaved, direction alternating), so one measurement's rounds lie
    seconds apart and the best rounds are the machine without the intruder
    (interference only ever adds time). After the planned rounds, a point goes
    again (up to three times the planned rounds) while its two best rounds differ
    by more than 10% or it reads more than 30% slower than an α-β fit through its
    collective's other points. Buffers are made fresh for each round. The time kept
    is :func:`calibration.microbench.dist.quiet_time` of the rounds. Each round taken
    is appended at once (a ``collective_round`` record); a point resumed with saved
    rounds joins at the first round it lacks.
    """
    order = {op: i for i, op in enumerate(args.op)}
    points = [_Point(op, size, collective_key(args.device, args.threads, op, n, size))
              for op, size in sorted(todo, key=lambda x: (x[1], order[x[0]]))]
    for pt in points:
        _resume(pt, (saved or {}).get(pt.key, []))
    for r in range(args.rounds * 3):
        live = [pt for pt in points if not pt.failed]
        chosen = [pt for pt in live if len(pt.rounds) <= r
                  and (r < args.rounds or _needs_more(pt, live, n))]
        if not chosen and r >= args.rounds:
            break
        if rank == 0 and chosen:
            print(f"[collectives n={n} round {r + 1}] {len(chosen)} measurements",
                  file=sys.stderr, flush=True)
        for pt in chosen if r % 2 == 0 else reversed(chosen):
            if _measure_round(args, store, pt, n, group, dev, rank) and rank == 0:
                store.append({"key": f"{pt.key}/round{len(pt.rounds)}",
                              "kind": "collective_round", "ok": True, "point": pt.key,
                              "round_s": pt.rounds[-1], "calls": pt.k, "reps": pt.reps,
                              "bytes": pt.nbytes, **_meta(args, pt.op, n)})
    if rank != 0:
        return
    for op in args.op:
        mine = [pt for pt in points if pt.op == op and not pt.failed and pt.rounds]
        for i, pt in enumerate(mine, 1):
            t = quiet_time(pt.rounds)
            algbw = pt.nbytes / t / 1e9
            busbw = algbw * busbw_factor(op, n)
            store.append({"key": pt.key, "kind": "collective", "ok": True, "bytes": pt.nbytes,
                          "count": pt.nbytes // 4, "time_s": t, "algbw_GBps": algbw,
                          "busbw_GBps": busbw, "round_times_s": pt.rounds, "calls": pt.k,
                          "reps": pt.reps, **_meta(args, op, n)})
            print(f"[{op} n={n} {i}/{len(mine)}] {human(pt.nbytes)}: {t * 1e6:.1f} us, "
                  f"algbw {algbw:.3g} GB/s, busbw {busbw:.3g} GB/s", file=sys.stderr, flush=True)


def _meta(args: argparse.Namespace, op: str, n: int) -> dict[str, Any]:
    return {"op": op, "nranks": n, "link": "intra_node", "device": args.device,
            "threads": args.threads, "backend": "nccl" if args.device == "cuda" else "gloo"}


def _measure_round(args: argparse.Namespace, store: ResultsStore, pt: _Point, n: int,
                   group: Any, dev: str, rank: int) -> bool:
    """One round of one point: fresh buffers, (calibration on the first), samples.
    Returns whether the round was taken (a failure is recorded instead)."""
    if rank == 0:  # the launcher blames the last started key if the launch hangs
        print(f"@@running {pt.key}", flush=True)
    try:
        if not pt.rounds:
            check_injected_failure(pt.key, may_hang=rank == 0)
        call, nbuf, pt.nbytes = make_call(pt.op, n, pt.size, group, dev, rank)
        if pt.k == 0:
            _calibrate(pt, call, nbuf, group, dev, args)
        else:
            call(0)  # warm the fresh buffers
        pt.rounds.append(statistics.median(_round(pt, call, nbuf, group, dev)))
        return True
    except Exception as exc:  # unsupported op, OOM, timeout: recorded and skipped
        pt.failed = True
        if rank == 0:
            rec = failure_record(pt.key, "collective", exc, bytes=pt.size,
                                 **_meta(args, pt.op, n))
            store.append(rec)
            print(f"[{pt.op} n={n}] {human(pt.size)}: FAILED ({rec['error']})",
                  file=sys.stderr, flush=True)
        return False


def _needs_more(pt: _Point, live: list[_Point], n: int) -> bool:
    """Unsettled: two best rounds >10% apart, or >30% slower than its collective's fit.

    Every rank decides alike: round medians come from samples max-reduced over the group.
    """
    best = sorted(pt.rounds)[:2]
    if len(best) == 2 and best[1] > 1.10 * best[0]:
        return True
    same = [Sample(p.op, n, float(p.nbytes), quiet_time(p.rounds)) for p in live
            if p.op == pt.op and p.rounds]
    if len(same) < 4:
        return False
    fit = fit_alpha_beta(same, holdout=False)
    return best[0] > 1.3 * fit.predict(pt.op, n, float(pt.nbytes))


def _calibrate(pt: _Point, call: Callable[[int], object], nbuf: int, group: Any, dev: str,
               args: argparse.Namespace) -> None:
    """Warm up, estimate one call's time (slowest rank), choose batch size and repeats."""
    import torch.distributed as dist

    for i in range(2):
        call(i % nbuf)
    sync(dev)
    single = []
    for i in range(3):  # the fastest of three: an intruder must not shrink the sample count
        dist.barrier(group=group)
        t0 = time.perf_counter()
        call(i % nbuf)
        sync(dev)
        single.append(time.perf_counter() - t0)
    est = max(rank_max(min(single), group, dev), 1e-7)
    pt.k = max(1, math.ceil(args.min_batch_s / est))
    per_round = args.target_s / args.rounds
    lo = max(2, math.ceil(args.min_reps / args.rounds))
    pt.reps = max(lo, min(max(lo, args.max_reps // args.rounds), round(per_round / (pt.k * est))))


def _round(pt: _Point, call: Callable[[int], object], nbuf: int, group: Any,
           dev: str) -> list[float]:
    """Samples of the slowest rank's seconds per call."""
    import torch
    import torch.distributed as dist

    samples = []
    for r in range(pt.reps):
        dist.barrier(group=group)
        sync(dev)
        t0 = time.perf_counter()
        for j in range(pt.k):
            call((r * pt.k + j) % nbuf)
        sync(dev)
        samples.append((time.perf_counter() - t0) / pt.k)
    worst = torch.tensor(samples, dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return worst.tolist()


if __name__ == "__main__":
    raise SystemExit(main())
