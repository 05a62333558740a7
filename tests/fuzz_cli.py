"""Run CLI invocations in-process, each under a deadline, and report what each did.

Used by ``tests/test_fuzz.py`` in a subprocess with an address-space limit, so
that a runaway allocation or a hang in one invocation is a failed case, not a
stuck test run. Reads a JSON list of argv lists on stdin; writes one JSON object
per invocation on stdout: ``{"argv", "rc", "stderr", "seconds"}`` (``rc`` is
``"timeout"``, ``"MemoryError"`` or an exception's name when ``main`` did not
return), and finally ``{"maxrss_bytes": ...}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

DEADLINE_S = 30  # a hang guard, far above the few seconds any case takes


class Deadline(Exception):
    """A case ran past DEADLINE_S."""


def _alarm(signum: int, frame: Any) -> None:
    raise Deadline


def run_one(argv: list[str]) -> dict[str, Any]:
    from simulator.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(DEADLINE_S)
    rc: Any
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse
                rc = exc.code
    except Deadline:
        rc = "timeout"
    except BaseException as exc:
        rc = type(exc).__name__
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
    return {"argv": argv, "rc": rc, "stderr": err.getvalue(),
            "seconds": time.perf_counter() - start}


def main() -> None:
    cases = json.load(sys.stdin)
    for argv in cases:
        print(json.dumps(run_one(argv)), flush=True)
    print(json.dumps({"maxrss_bytes": peak_rss_bytes()}), flush=True)


def peak_rss_bytes() -> int:
    """This process's own peak resident memory since it started this program.

    ``VmHWM`` belongs to the memory map that ``exec`` made fresh. ``ru_maxrss`` does
    not: Linux carries the forked parent's peak across ``exec`` (a ``preexec_fn`` makes
    ``subprocess`` fork), so under a long pytest run it read the test runner's own
    1.1 GB, not the invocations'.
    """
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    main()
