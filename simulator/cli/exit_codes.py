"""The exit statuses of ``clustersim``, one table that ``--help`` and
``docs/cli-exit-codes.md`` both show (a test keeps them in step).

Status 3 is a verdict, not a failure: ``run``, ``memory`` and ``validate`` did their
work (``run`` wrote every output) but the layout does not fit in GPU memory by the
analytic memory model (:mod:`simulator.model.memory`, the same per-stage totals
``clustersim memory`` tabulates). A script that runs a scenario can thus tell "this
layout runs out of memory" from "this input is wrong" (2) without parsing text.
``--allow-oom`` keeps 0 for those who look at the figures anyway.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

OK = 0
USAGE = 2
DOES_NOT_FIT = 3
INTERRUPTED = 130
BROKEN_PIPE = 141
TERMINATED = 143

#: status -> what it means, in the order ``--help`` lists them.
EXIT_CODES: dict[int, str] = {
    OK: "done (for run, memory and validate: the layout fits in GPU memory)",
    1: "an internal error (a bug: the traceback says where; please report it)",
    USAGE: "bad input: one `error:` line per problem naming the field, the value and the "
           "fix; nothing simulated",
    DOES_NOT_FIT: "run, memory, validate: the layout does not fit in GPU memory (peak above "
                  "capacity on some stage); run still wrote its outputs; --allow-oom gives 0",
    INTERRUPTED: "interrupted (Ctrl-C); no half-written output is left; sweep and plan keep "
                 "every point they finished in the cache and say how to resume",
    BROKEN_PIPE: "the reader of stdout went away (`clustersim diff A B | head`)",
    TERMINATED: "terminated (SIGTERM, e.g. a batch system's time limit): as for Ctrl-C",
}


def epilog(width: int = 88) -> str:
    """The exit-status table as ``--help`` prints it (wrapped, the code hanging)."""
    rows = (textwrap.fill(text.replace("`", ""), width, initial_indent=f"  {code:>3}  ",
                          subsequent_indent=" " * 7) for code, text in EXIT_CODES.items())
    return "exit status:\n" + "\n".join(rows)


@dataclass(frozen=True)
class MemoryVerdict:
    """The worst stage against its GPU's capacity (bytes)."""

    fits: bool
    stage: int
    peak: float
    capacity: float

    def line(self) -> str:
        state = "fits" if self.fits else "DOES NOT FIT"
        return (f"memory: peak {self.peak / 1e9:.1f} GB (stage {self.stage}) of "
                f"{self.capacity / 1e9:.0f} GB per GPU: {state}")


def memory_verdict(stages: Iterable[Mapping[str, float]]) -> MemoryVerdict:
    """The verdict of per-stage rows ``{"stage", "total", "capacity"}``: the stage
    furthest over (or nearest to) its capacity; a fit only when every stage fits."""
    rows = list(stages)
    worst = max(rows, key=lambda m: m["total"] / m["capacity"])
    return MemoryVerdict(all(m["total"] <= m["capacity"] for m in rows), int(worst["stage"]),
                         float(worst["total"]), float(worst["capacity"]))


def fit_status(verdict: MemoryVerdict, allow_oom: bool, written: bool = False) -> int:
    """0, or :data:`DOES_NOT_FIT` with one line on stderr saying so (and what to do)."""
    if verdict.fits:
        return OK
    done = "outputs written; " if written else ""
    if allow_oom:
        print(f"warning: {verdict.line()} ({done}--allow-oom: exit status 0)", file=sys.stderr)
        return OK
    print(f"error: {verdict.line()} ({done}exit status {DOES_NOT_FIT}; `clustersim memory` "
          "shows what fills it: ZeRO, recompute, a smaller micro-batch or more pipeline "
          "stages lower it; --allow-oom to exit 0)", file=sys.stderr)
    return DOES_NOT_FIT


def allow_oom_arg(q: argparse.ArgumentParser) -> None:
    """The ``--allow-oom`` flag of the commands that give a memory verdict."""
    q.add_argument("--allow-oom", action="store_true",
                   help=f"exit 0 even when the layout does not fit in GPU memory (default: "
                   f"exit status {DOES_NOT_FIT})")
