"""Launching the collective benchmark under torchrun, with a timeout on each launch.

One torchrun launch measures every collective (all ranks of this node; group
sizes 2..N inside it): starting torch in N+1 processes costs seconds, once.
A launch that hangs past its timeout or dies is killed (its whole process
group: torchrun and its workers), the measurement it was running (rank 0 names
each one on stdout before starting it) is recorded as failed with the reason,
and the launch is retried for the rest — so one deadlocked message size costs
one timeout, not the calibration. After three failed launches the remaining
measurements are recorded as failed.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
from pathlib import Path

from calibration.host import kill_process_group, worker_pythonpath
from calibration.microbench.bench_results import ResultsStore, failure_record
from calibration.microbench.bench_timing import Budget, Device
from calibration.microbench.collectives_worker import collective_key
from calibration.microbench.terms.registry import TERMS

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_to_all")
MAX_LAUNCHES = 3


def message_sizes(budget: Budget) -> list[int]:
    """1 KiB up to the budget's maximum (64 MiB on CPU or quick, 1 GiB on GPUs).

    Steps of √2 rather than nccl-tests' 2: twice the sizes for little more time,
    which is what makes the held-out error (a median over every 4th size) stable.
    """
    out: list[int] = []
    i = 0
    while (s := 1024 * 2 ** (i / budget.coll_steps_per_octave)) <= budget.coll_max_bytes * 1.0001:
        out.append(int(round(s / 256) * 256))
        i += 1
    return out


def group_sizes(nproc: int) -> list[int]:
    return list(range(2, nproc + 1))


def run_collectives(device: Device, nproc: int, budget: Budget, store: ResultsStore,
                    timeout_s: float, ops: tuple[str, ...] = OPS,
                    terms: bool = True) -> None:
    """Measure every (op, group size, message size) not yet in the results file, and
    (``terms``) in the same launch the two-rank terms not yet in it
    (:data:`calibration.microbench.terms.registry.TERMS`: the GEMM slowdown under
    all-reduces, the collective and send sync costs, the rank spread and the host time of
    DTensor's redistributions)."""
    sizes = message_sizes(budget)
    groups = group_sizes(nproc)
    planned = [(op, n, s) for op in ops for n in groups for s in sizes]
    term_flags = {term.key(device.kind, device.threads): term.FLAG for term in TERMS.values()}

    def missing() -> list[tuple[str, int, int]]:
        done = store.done()
        return [x for x in planned if collective_key(device.kind, device.threads, *x) not in done]

    for launch in range(1, MAX_LAUNCHES + 1):
        todo = missing()
        flags = [f for key, f in term_flags.items() if terms and key not in store.done()]
        if not todo and not flags:
            return
        todo_ops = tuple(op for op in ops if any(x[0] == op for x in todo))
        rc, tail, timed_out, running = _launch(device, nproc, budget, store.path, todo_ops, sizes,
                                               groups, timeout_s, flags)
        still = missing()
        if rc == 0 and not still:
            return
        reason = (f"launch timed out after {timeout_s:.0f} s" if timed_out
                  else f"launch exited with status {rc}")
        last = next((ln for ln in reversed(tail) if ln.strip()), "")
        blamed = next((x for x in still
                       if collective_key(device.kind, device.threads, *x) == running),
                      still[0] if still else None)
        if blamed:
            _record_failed(store, device, *blamed, f"{reason}: {last}")
        print(f"[collectives] {reason} (launch {launch}/{MAX_LAUNCHES}); output tail:\n  "
              + "\n  ".join(tail[-8:]), file=sys.stderr, flush=True)
    for x in missing():
        _record_failed(store, device, *x, f"not measured: {MAX_LAUNCHES} launches failed")


def _record_failed(store: ResultsStore, device: Device, op: str, n: int, size: int,
                   why: str) -> None:
    key = collective_key(device.kind, device.threads, op, n, size)
    store.append(failure_record(key, "collective", why, op=op, nranks=n, bytes=size,
                                link="intra_node", device=device.kind, threads=device.threads))


def _launch(device: Device, nproc: int, budget: Budget, results: Path, ops: tuple[str, ...],
            sizes: list[int], groups: list[int], timeout_s: float,
            flags: list[str] | None = None) -> tuple[int, list[str], bool, str | None]:
    """Run one torchrun; returns (status, output tail, timed out, last key it started)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "calibration.microbench.collectives_worker",
           *(a for op in ops for a in ("--op", op)), "--sizes", ",".join(map(str, sizes)),
           "--groups", ",".join(map(str, groups)),
           "--results", str(results), "--device", device.kind, "--threads", str(device.threads),
           "--target-s", str(budget.target_s), "--min-reps", str(budget.min_reps),
           "--max-reps", str(budget.max_reps), "--min-batch-s", str(budget.min_batch_s),
           "--rounds", str(budget.rounds), "--op-timeout-s", str(max(30.0, timeout_s / 2)),
           *(flags or [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(device.threads), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": worker_pythonpath(),
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    running: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            if line.startswith("@@running "):
                running[:] = [line.split(" ", 1)[1]]
                continue
            tail.append(line)
            if line.startswith("["):  # rank 0's progress lines (the terms' too)
                print(line, file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        rc = kill_process_group(proc, grace_s=10.0)
    except BaseException:  # Ctrl-C: take the workers down with us
        kill_process_group(proc, grace_s=10.0)
        raise
    reader.join(timeout=5)
    return rc, list(tail), timed_out, (running[0] if running else None)


