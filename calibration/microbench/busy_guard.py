"""Is the machine busy? The reference kernel's drift and the repeat spread of a calibration.

Another job on the same cores slows whatever is timed while it runs. The recheck
passes and interleaved rounds catch short intrusions; a job that runs through the
whole calibration slows every kernel alike and leaves no outlier to catch, but
the machine's speed then differs between the start and the end (the intruder
came or went) or its timings scatter (it competes for the core in bursts). So:

- the same reference GEMM is timed at the start and after each phase (GEMM,
  attention, memory-bound kernels, collectives) that measured anything
  (:func:`read_between`, :func:`calibration.microbench.bench_terms.time_reference`);
  a reading more than :data:`DRIFT_LIMIT` (15%) from the first means the machine
  changed speed by then. It is said at once, in a WARNING line naming the phase and
  every reading so far, and the largest such drift is the run's. A reading is the
  median over at least nine repeats, so a process taking the core by time slices
  does not move it (here, pinned to the same core even at nice -20: it leaves at
  most scatter between repeats, which the spread check below looks at); what does is
  a sustained change in the kernel's own speed: the clock (a power or thermal limit,
  a turbo budget shared with busy neighbours), a co-runner on the SMT sibling or the
  shared cache and memory bus. Why 15%, the limit the start-to-end check has always
  had: the readings of one quiet run here agree within 3% (0.395–0.408 ms over
  five), so 15% is five times that, and a drift of 15% moves every kernel timed in
  the phase about as much, past the fits' held-out errors (3–8%); 10% would leave
  too little room on a shared VM, whose neighbours moved two quiet readings a minute
  apart by 19% once;
- each timing keeps the spread of its repeats ((p75 − p25) / median); the median
  spread over the run's compute measurements above :data:`SPREAD_LIMIT` (12%;
  about 2–6% on an idle machine here) means the timings are noisy throughout;
- on a virtual machine, the hypervisor's share of the CPU over the attempt
  (steal, from ``/proc/stat``: :class:`calibration.host.StealMeter`) above
  :data:`calibration.host.STEAL_LIMIT` (5%) means other guests ran on this
  machine's CPUs, whatever the timings' spread says: a steady steal slows every
  kernel alike and leaves neither drift nor spread.

Any finding is a WARNING in the CLI output, in the profile's provenance
(``busy_guard``) and in the report. With ``--retry-busy N`` the compute part is
measured again (up to N times; the fitter keeps each kernel's fastest reading),
with a fresh reference timing after each attempt, until the guard is quiet.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from calibration.host import STEAL_LIMIT

DRIFT_LIMIT = 0.15
SPREAD_LIMIT = 0.12
#: Record kinds whose repeat spread counts toward the run's spread.
TIMED_KINDS = ("gemm", "attention", "memory", "overhead", "gemm_layout", "attention_bwd")


#: A reference timing: ``phase`` (when: "start", "after memory", ...), ``time_s``, ``spread``.
Reading = dict[str, Any]


@dataclass(frozen=True)
class Verdict:
    start_s: float | None  # reference GEMM seconds at the start of the (last) attempt
    end_s: float | None  # ... and at its end
    drift: float | None  # the largest |reading − first| / min(reading, first)
    spread: float | None  # median repeat spread of the attempt's measurements
    samples: int  # measurements the spread is the median of
    steal: float | None = None  # the hypervisor's share of the CPU over the attempt
    readings: tuple[tuple[str, float], ...] = ()  # (phase, seconds) of every reading

    @property
    def busy(self) -> bool:
        return bool((self.drift or 0.0) > DRIFT_LIMIT or (self.spread or 0.0) > SPREAD_LIMIT
                    or (self.steal or 0.0) > STEAL_LIMIT)

    def warning(self, retried: int | None = 0) -> str | None:
        """One WARNING line naming the figures, or None when the machine looked quiet;
        its advice after ``retried`` re-measures (None: no advice, a re-measure follows)."""
        if not self.busy:
            return None
        why = []
        if (self.drift or 0.0) > DRIFT_LIMIT and len(self.readings) > 1:
            why.append(drift_text(self.readings))
        if (self.spread or 0.0) > SPREAD_LIMIT:
            why.append(f"the median repeat spread was {self.spread:.1%} over {self.samples} "
                       f"measurements (limit {SPREAD_LIMIT:.0%})")
        if (self.steal or 0.0) > STEAL_LIMIT:
            why.append(f"the hypervisor took {self.steal:.0%} of the CPU time (steal in "
                       f"/proc/stat, limit {STEAL_LIMIT:.0%}): other guests ran on its cores")
        advice = ("" if retried is None
                  else "; rerun on an idle machine or with --retry-busy N" if not retried
                  else f"; still busy after {retried} re-measure(s) of the compute part "
                       f"(--retry-busy {retried}): rerun on an idle machine")
        return ("WARNING: the machine looked busy during calibration: " + "; ".join(why)
                + f". Timings may read slow{advice}.")

    def as_dict(self) -> dict[str, Any]:
        return {"reference_start_ms": _ms(self.start_s), "reference_end_ms": _ms(self.end_s),
                "reference_ms": {phase: _ms(t) for phase, t in self.readings},
                "drift": _r(self.drift), "drift_limit": DRIFT_LIMIT,
                "median_repeat_spread": _r(self.spread), "spread_limit": SPREAD_LIMIT,
                "spread_samples": self.samples, "steal": _r(self.steal),
                "steal_limit": STEAL_LIMIT, "busy": self.busy}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 4)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def drift(start_s: float, end_s: float) -> float:
    """Relative difference of two timings of one kernel (symmetric, ≥ 0)."""
    return abs(end_s - start_s) / min(start_s, end_s)


def drift_text(readings: Sequence[tuple[str, float]], at: int | None = None) -> str:
    """Reading ``at`` (default: the farthest from the first) against the first, and every
    reading, in words."""
    (first_phase, first), *_ = readings
    phase, t = (readings[at] if at is not None
                else max(readings[1:], key=lambda r: drift(first, r[1])))
    every = ", ".join(f"{p} {x * 1e3:.3f}" for p, x in readings)
    return (f"the reference GEMM took {first * 1e3:.3f} ms at the {first_phase} and "
            f"{t * 1e3:.3f} ms {_when(phase)} ({drift(first, t):.0%} apart, limit "
            f"{DRIFT_LIMIT:.0%}; readings: {every} ms)")


def _when(phase: str) -> str:
    return phase if phase.startswith("after ") else f"at the {phase}"


def read_between(phases: Sequence[tuple[str, Callable[[], None]]],
                 reference: Callable[[str], Reading], measured: Callable[[], int],
                 say: Callable[[str], None], label: str = "") -> list[Reading]:
    """Run ``phases`` (name, run) between timings of the reference kernel: one at the
    start and one after each phase that measured anything (``measured()``, a count of
    the results, moved: a resumed phase with nothing left takes none), one at the end
    if no phase did. A reading more than :data:`DRIFT_LIMIT` from the first is said at
    once (``say``), in one WARNING line naming the phase. ``label`` follows each
    reading's name (a re-measure's, e.g. `` (re-measure 1)``)."""
    readings = [reference(f"start{label}")]
    for name, run in phases:
        before = measured()
        run()
        if measured() == before:
            continue
        readings.append(reference(f"after {name}{label}"))
        pairs = [(r["phase"], float(r["time_s"])) for r in readings]
        if drift(pairs[0][1], pairs[-1][1]) > DRIFT_LIMIT:
            say(f"WARNING: the machine's speed changed by the end of {name}: "
                f"{drift_text(pairs, -1)}; its timings may be off.")
    if len(readings) == 1:
        readings.append(reference(f"end{label}"))
    return readings


def judge(readings: Sequence[Reading], measured: list[dict[str, Any]],
          steal: float | None = None) -> Verdict:
    """The verdict on one attempt: its reference readings (the first at its start, the
    last at its end), the records it measured and the steal share over it (None where
    the machine does not count steal)."""
    spreads = [float(r["spread"]) for r in measured
               if r.get("ok") and r.get("kind") in TIMED_KINDS and "spread" in r]
    spreads += [float(ref["spread"]) for ref in readings if "spread" in ref]
    unnamed = ["start", *(f"reading {i}" for i in range(1, len(readings) - 1)), "end"]
    pairs = tuple((str(r.get("phase", unnamed[i])), float(r["time_s"]))
                  for i, r in enumerate(readings))
    first = pairs[0][1] if pairs else None
    return Verdict(first, pairs[-1][1] if pairs else None,
                   max(drift(first, t) for _, t in pairs[1:]) if first and len(pairs) > 1
                   else None,
                   float(statistics.median(spreads)) if spreads else None, len(spreads),
                   steal, pairs)
