"""Is the machine busy? The reference kernel's drift and the repeat spread of a calibration.

Another job on the same cores slows whatever is timed while it runs. The recheck
passes and interleaved rounds catch short intrusions; a job that runs through the
whole calibration slows every kernel alike and leaves no outlier to catch, but
the machine's speed then differs between the start and the end (the intruder
came or went) or its timings scatter (it competes for the core in bursts). So:

- the same reference GEMM is timed at the start and at the end
  (:func:`calibration.microbench.bench_terms.time_reference`); a relative
  difference above :data:`DRIFT_LIMIT` (15%) means the machine changed speed
  during the run;
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
from dataclasses import dataclass
from typing import Any

from calibration.host import STEAL_LIMIT

DRIFT_LIMIT = 0.15
SPREAD_LIMIT = 0.12
#: Record kinds whose repeat spread counts toward the run's spread.
TIMED_KINDS = ("gemm", "attention", "memory", "overhead", "gemm_layout", "attention_bwd")


@dataclass(frozen=True)
class Verdict:
    start_s: float | None  # reference GEMM seconds at the start of the (last) attempt
    end_s: float | None  # ... and at its end
    drift: float | None  # |end − start| / min(start, end)
    spread: float | None  # median repeat spread of the attempt's measurements
    samples: int  # measurements the spread is the median of
    steal: float | None = None  # the hypervisor's share of the CPU over the attempt

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
        if (self.drift or 0.0) > DRIFT_LIMIT and self.start_s and self.end_s:
            why.append(f"the reference GEMM took {self.start_s * 1e3:.3f} ms at the start and "
                       f"{self.end_s * 1e3:.3f} ms at the end ({self.drift:.0%} apart, limit "
                       f"{DRIFT_LIMIT:.0%})")
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


def judge(start: dict[str, Any] | None, end: dict[str, Any] | None,
          measured: list[dict[str, Any]], steal: float | None = None) -> Verdict:
    """The verdict on one attempt: its reference records, the records it measured and
    the steal share over it (None where the machine does not count steal)."""
    spreads = [float(r["spread"]) for r in measured
               if r.get("ok") and r.get("kind") in TIMED_KINDS and "spread" in r]
    for ref in (start, end):
        if ref and "spread" in ref:
            spreads.append(float(ref["spread"]))
    s = float(start["time_s"]) if start else None
    e = float(end["time_s"]) if end else None
    return Verdict(s, e, drift(s, e) if s and e else None,
                   float(statistics.median(spreads)) if spreads else None, len(spreads),
                   steal)
