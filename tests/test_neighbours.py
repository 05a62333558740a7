"""Busy neighbours (calibration/microbench/neighbours.py): forked copies run the timed
job's runner for exactly the block's duration, and none outlives it."""

from __future__ import annotations

import os
import sys
import time

import pytest

from calibration.microbench.neighbours import busy_neighbours

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux",
                                reason="fork")


def test_neighbours_run_the_job_during_the_block_and_are_reaped() -> None:
    read, write = os.pipe()
    os.set_blocking(read, False)

    def runner() -> None:  # each call in a neighbour leaves a byte in the pipe
        os.write(write, b"x")
        time.sleep(0.002)

    with busy_neighbours(runner, 2):
        time.sleep(0.3)
    os.close(write)
    time.sleep(0.05)
    got = b""
    while True:
        try:
            chunk = os.read(read, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        got += chunk
    os.close(read)
    assert len(got) > 20  # two neighbours, ~150 calls each in 0.3 s
    with pytest.raises(ChildProcessError):  # every neighbour was killed and waited for
        os.waitpid(-1, os.WNOHANG)


def test_no_neighbours_runs_nothing() -> None:
    calls: list[int] = []
    with busy_neighbours(lambda: calls.append(1), 0):
        pass
    assert calls == []
