"""Busy neighbours: the node's other CPU "devices" run the kernel being timed.

A CPU "device" is one process on one core, and the measured CPU runs put one rank on
each core of the node: the ranks share the last-level cache and the memory bus, and in
data or tensor parallelism they run the same kernels at the same time. A kernel timed
alone has the whole cache: on this project's 2-core VM (32 MiB L3) the cross-entropy's
backward over 8 MiB of logits takes 3.2 ms in one process and 14.9 ms while a second,
independent process trains the same model; the GEMMs of that model 4-10% longer. A
GPU has its own memory and nothing of this.

So a CPU calibration times each compute job with ``n`` neighbours (``calibrate
--neighbours``, default: the node's other cores, ``nproc - 1``) running the same job's
runner in a loop, from just before the timed process starts it until it is done:
forked copies of this process (the runner is a closure over its tensors, which the
copy-on-write fork shares), killed after. What the profile then describes is a device
whose neighbours are busy with work like its own, as in the runs it is used for; a
pipeline stage idle in its bubble leaves its neighbour the cache (the profile
overcharges that stage a little, the model has no co-location term).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def busy_neighbours(runner: Callable[[], Any], n: int) -> Iterator[None]:
    """Run ``runner`` in a loop in ``n`` forked processes for the duration of the block
    (none where ``n`` is 0 or the platform cannot fork)."""
    if n <= 0 or not hasattr(os, "fork"):
        yield
        return
    pids: list[int] = []
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:  # the neighbour: the same work until killed, never returning
                try:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    while True:
                        runner()
                finally:
                    os._exit(0)
            pids.append(pid)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
