"""The spread of a fitted term (``uncertainty``, a relative σ): how far a rerun of the
calibration could plausibly move the term as a whole.

The Monte Carlo of ``clustersim run --uncertainty`` scales each term by one factor per
sample, so this is the uncertainty of the curve's level, not one kernel's scatter about
it. A curve's has three sources, added in quadrature: the standard error of the level
(the robust σ of the relative residuals about the curve, 1.4826 × their median absolute
value, over √n points); the machine's state, as the scatter of one timing between
repeats (the median (p75 − p25) / median of the term's records, / 1.349 to read as a σ;
about 1.5–4% on an idle machine), which does not average away over points; and the
machine's drift during the run (the reference kernel's largest drift d from its first
reading, at the end or after a phase, as a uniform spread, d / √12). The overhead's
spread is its jackknife standard error, the standard error of the mean over kernels,
and the drift; a link's the standard error of
its α-β fit's level (residual σ / √n); a two-rank term measured in rounds the standard
error of its rounds' figures relative to its figure
(:mod:`calibration.microbench.terms`). Every spread is clamped to [0, 1] and rounded to
four places.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from calibration.microbench.fit import AlphaBetaFit, CurveFit, LineFit, Sample, robust_sigma

IQR_PER_SIGMA = 1.349  # a normal distribution's interquartile range in σ
#: A record's figure in seconds (a term's ``sync_seconds``, say).
Figure = Callable[[dict[str, Any]], float]


def quadrature(*parts: float | None) -> float:
    return math.sqrt(sum(p * p for p in parts if p is not None))


def repeat_sigma(records: list[dict[str, Any]]) -> float | None:
    spreads = [float(r["spread"]) for r in records if "spread" in r]
    return statistics.median(spreads) / IQR_PER_SIGMA if spreads else None


def curve_spread(fit: CurveFit, records: list[dict[str, Any]], drift: float | None) -> float:
    n = fit.n_train + fit.n_holdout
    level = fit.resid_sigma / math.sqrt(n) if fit.resid_sigma is not None and n else None
    return clamp(quadrature(level, repeat_sigma(records),
                            drift / math.sqrt(12) if drift else None))


def overhead_spread(fits: dict[str, LineFit], drift: float | None) -> float | None:
    if not fits:
        return None
    vals = [f.intercept_s for f in fits.values()]
    mean = statistics.fmean(vals)
    if mean <= 0:
        return None
    between = statistics.stdev(vals) / mean / math.sqrt(len(vals)) if len(vals) > 1 else None
    se = [f.intercept_rel_se for f in fits.values() if f.intercept_rel_se is not None]
    return clamp(quadrature(between, math.sqrt(statistics.fmean(x * x for x in se)) if se
                            else None, drift / math.sqrt(12) if drift else None))


def link_spread(fit: AlphaBetaFit, samples: list[Sample]) -> float | None:
    errs = [fit.predict(s.op, s.n, s.size) / s.time_s - 1.0 for s in samples]
    sigma = robust_sigma(errs)
    return None if sigma is None else clamp(sigma / math.sqrt(len(errs)))


def mean_rel_se(values: list[float]) -> float | None:
    """The standard error of the mean of ``values`` relative to it (None for fewer than
    two, or a mean of 0 or less)."""
    if len(values) < 2 or statistics.fmean(values) <= 0:
        return None
    return clamp(statistics.stdev(values) / statistics.fmean(values) / math.sqrt(len(values)))


def rounds_spread(rec: dict[str, Any] | None, seconds: Figure,
                  figures_of: Callable[[dict[str, Any]], list[float]]) -> float | None:
    """The standard error of a record's round figures relative to its figure ``seconds``
    (None for fewer than two rounds, or a figure of 0 or less)."""
    if not rec or len(rec.get("rounds", [])) < 2 or seconds(rec) <= 0:
        return None
    figures = figures_of(rec)
    return clamp(statistics.stdev(figures) / seconds(rec) / math.sqrt(len(figures)))


def clamp(x: float) -> float:
    return round(min(max(x, 0.0), 1.0), 4)
