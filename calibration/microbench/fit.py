"""Turning measurements into the cost model's numbers, and saying how wrong they are.

Cost semantics the simulator uses with a calibrated profile (and that these fits
minimise relative error against):

- GEMM of F FLOPs:        t = F / (peak × gemm_efficiency(F)) + o
- attention of F FLOPs:   t = F / (peak × attention_efficiency(F)) + o
- memory-bound, B bytes:  t = B / (hbm_bandwidth × memory_efficiency(B)) + o
- o, the per-kernel overhead, is the intercept of a straight line through
  tiny-to-small kernels' times, t = o + B / bandwidth (:func:`fit_intercept`),
  and the curves are fitted to the time net of it (``offset_s``), so a kernel's
  overhead is charged once; the same applies to every class curve.
- collective of S bytes over n ranks:
      t = α · steps(op, n) + S · factor(op, n) / busbw
  factor is nccl-tests' bus-bandwidth factor (2(n−1)/n all-reduce, (n−1)/n
  all-gather and reduce-scatter, 1 send/recv and broadcast); steps is the ring's
  latency-step count (2(n−1) all-reduce, n−1 all-gather, reduce-scatter and
  broadcast, 1 send/recv). S is the total array (all-gather output,
  reduce-scatter input), as in nccl-tests.

Efficiency curves are piecewise linear in log10(size), clamped at both ends
(:class:`simulator.system.curves.EfficiencyCurve`). The knots are the measured
points smoothed by a running median of five (see :func:`knots`); on a GPU, GEMM
and attention curves are then made non-decreasing (bigger problems do not get
less efficient there), on a CPU they are not (a small GEMM runs from cache, and
with the overhead taken out its net efficiency reads high: an envelope would
carry that to every larger size; the monotone envelope made the held-out error
of this machine's GEMM fits 2-3× larger), and memory curves never are (a CPU's
caches make mid-sized kernels faster than DRAM-sized ones).

α and busbw are fitted per collective and link class, over all group sizes at
once, by least absolute relative deviation (:func:`fit_alpha_beta`).

Held out: after sorting by size (per group size for collectives), every 4th
point (never the smallest or the largest, so the test is interpolation) is left
out of the fit, and the median relative time error on those points is reported:
a few noisy points neither hide a bad fit nor spoil a good one.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.system.curves import interpolate_log
from simulator.system.units import MIN_EFFICIENCY

HOLDOUT_EVERY = 4


def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):  # nccl-tests alltoall_perf too
        return (n - 1) / n
    return 1.0  # send_recv, broadcast


def collective_steps(op: str, n: int) -> int:
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "broadcast", "all_to_all"):  # a2a: pairwise
        return n - 1
    return 1  # send_recv


def holdout_mask(n: int, every: int = HOLDOUT_EVERY) -> list[bool]:
    """True for held-out positions among n size-sorted points."""
    return [0 < i < n - 1 and i % every == every // 2 for i in range(n)]


def rel_error(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits, as a profile states a fitted figure."""
    return float(f"{x:.{digits}g}")


def median_or_none(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


# ---------------------------------------------------------------- efficiency curves


@dataclass(frozen=True)
class CurveFit:
    points: list[tuple[float, float]]  # (size, efficiency) knots
    peak: float  # units per second the efficiency is relative to (FLOP/s or bytes/s)
    n_train: int
    n_holdout: int
    train_error: float | None  # median relative time error on fitted points
    holdout_error: float | None  # median relative time error on held-out points
    holdout: list[bool]  # per input point, size-sorted order
    offset_s: float = 0.0  # per-kernel overhead added to every predicted time
    resid_sigma: float | None = None  # robust σ of the relative time error, all points

    def efficiency(self, size: float) -> float:
        return interpolate_log(self.points, size)

    def predict_time(self, size: float) -> float:
        return size / (self.peak * self.efficiency(size)) + self.offset_s


#: A kernel's time net of the overhead is kept at no less than this share of its time
#: (an overhead estimate above a kernel's whole time would otherwise leave it none).
NET_FLOOR = 0.05


#: A kernel shorter than this many overheads leaves too little of its own time to read
#: an efficiency off (a few percent of error in the overhead would swing it wildly, and a
#: monotone curve would carry the swing to every larger size): it is left out of the
#: knots, though it still counts in the fit's errors.
READABLE_OVER_OFFSET = 2.0


def net_time(time_s: float, offset_s: float) -> float:
    """Seconds of a kernel's own work: its time less the per-kernel overhead."""
    return max(time_s - offset_s, NET_FLOOR * time_s)


def fit_efficiency(sizes: Sequence[float], times: Sequence[float], peak: float,
                   monotone: bool, offset_s: float = 0.0) -> CurveFit:
    """Fit achieved/peak vs size from (size, seconds) samples; evaluate on held-out ones.

    With ``offset_s`` the efficiency is read off the time net of that per-kernel
    overhead, and predictions add it back; kernels shorter than twice the overhead
    do not shape the knots (:data:`READABLE_OVER_OFFSET`)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    xs = [float(sizes[i]) for i in order]
    ts = [float(times[i]) for i in order]
    mask = holdout_mask(len(xs))
    train = [(x, x / net_time(t, offset_s) / peak)
             for x, t, h in zip(xs, ts, mask, strict=True) if not h]
    readable = [(x, e) for (x, e), t in zip(train, (t for t, h in zip(ts, mask, strict=True)
                                                     if not h), strict=True)
                if t >= READABLE_OVER_OFFSET * offset_s]
    points = knots(readable if len(readable) >= 2 else train, monotone)
    fit = CurveFit(points, peak, len(train), sum(mask), None, None, mask, offset_s)
    tr = [rel_error(fit.predict_time(x), t) for x, t, h in zip(xs, ts, mask, strict=True) if not h]
    ho = [rel_error(fit.predict_time(x), t) for x, t, h in zip(xs, ts, mask, strict=True) if h]
    sigma = robust_sigma([fit.predict_time(x) / t - 1.0 for x, t in zip(xs, ts, strict=True)])
    return CurveFit(points, peak, len(train), len(ho), median_or_none(tr), median_or_none(ho),
                    mask, offset_s, sigma)


def robust_sigma(rel_errors: Sequence[float]) -> float | None:
    """σ of relative errors from their median absolute value (1.4826 × MAD about 0),
    which one wild reading does not move."""
    return 1.4826 * float(statistics.median(abs(e) for e in rel_errors)) if rel_errors else None


# ---------------------------------------------------------------- a line's intercept


@dataclass(frozen=True)
class LineFit:
    """t = intercept + slope · size, fitted by least absolute relative deviation."""

    intercept_s: float
    slope_s: float  # seconds per unit of size (1 / bandwidth for bytes)
    n: int
    median_rel_error: float | None
    intercept_rel_se: float | None  # jackknife standard error of the intercept, relative

    def predict(self, size: float) -> float:
        return self.intercept_s + self.slope_s * size


def fit_intercept(sizes: Sequence[float], times: Sequence[float]) -> LineFit:
    """The fixed cost of a call: the intercept of t = o + size·β (o, β ≥ 0) through
    tiny-to-small kernels' times, each point weighted alike (relative error), with a
    leave-one-out jackknife for the intercept's standard error."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("an intercept needs two or more (size, time) samples")
    pts = [(float(x), float(t)) for x, t in zip(sizes, times, strict=True)]
    o, b = _irls_l1([(1.0 / t, x / t) for x, t in pts])
    errs = [rel_error(o + b * x, t) for x, t in pts]
    se = None
    if len(pts) >= 3 and o > 0:
        loo = [_irls_l1([(1.0 / t, x / t) for j, (x, t) in enumerate(pts) if j != i])[0]
               for i in range(len(pts))]
        mean = statistics.fmean(loo)
        var = (len(loo) - 1) / len(loo) * sum((v - mean) ** 2 for v in loo)
        se = math.sqrt(var) / o
    return LineFit(o, b, len(pts), median_or_none(errs), se)


MAX_KNOTS = 16
MERGE_DECADES = 0.05  # sizes closer than this (12%) are one knot: the median of their readings


def knots(samples: Sequence[tuple[float, float]], monotone: bool) -> list[tuple[float, float]]:
    """Smoothed (size, efficiency) knots: strictly increasing sizes, efficiencies in (0, 1].

    Readings at sizes within 12% of each other (one size timed in several
    kernels, say) first become one point, their median. Sorted by size, each
    efficiency is replaced by the median of itself and its two neighbours on each
    side (fewer at the ends), which removes a single slow or fast reading without
    flattening the curve's shape. A monotone curve then takes the running
    maximum: timing noise on a shared machine only ever slows a kernel, so the
    upper envelope of the smoothed points is the machine's behaviour. More than
    16 points are thinned to 16 knots evenly spaced in log10(size), read off the
    smoothed points.
    """
    if not samples:
        raise ValueError("no samples to fit")
    pts = sorted((math.log10(x), e) for x, e in samples)
    clusters: list[list[tuple[float, float]]] = []  # within 12% of the first: one point
    for lx, e in pts:
        if clusters and lx - clusters[-1][0][0] < MERGE_DECADES:
            clusters[-1].append((lx, e))
        else:
            clusters.append([(lx, e)])
    merged = [(statistics.fmean(lx for lx, _ in c), statistics.median(e for _, e in c))
              for c in clusters]
    smooth = []
    for i, (lx, _) in enumerate(merged):
        half = min(2, i, len(merged) - 1 - i)
        smooth.append((lx, statistics.median(e for _, e in merged[i - half:i + half + 1])))
    if monotone:
        best = 0.0
        smooth = [(lx, best := max(best, e)) for lx, e in smooth]
    if len(smooth) > MAX_KNOTS:
        lo, hi = smooth[0][0], smooth[-1][0]
        grid = [lo + (hi - lo) * i / (MAX_KNOTS - 1) for i in range(MAX_KNOTS)]
        smooth = [(lx, _interp_log(smooth, lx)) for lx in grid]
    out: list[tuple[float, float]] = []
    for lx, eff in smooth:
        size = float(f"{10 ** lx:.4g}")
        if out and size <= out[-1][0]:
            continue
        out.append((size, float(f"{min(max(eff, MIN_EFFICIENCY), 1.0):.4g}")))
    return out


def _interp_log(pts: Sequence[tuple[float, float]], lx: float) -> float:
    """Linear interpolation over (log10 size, eff) points sorted by size."""
    if lx <= pts[0][0]:
        return pts[0][1]
    for (x0, e0), (x1, e1) in itertools.pairwise(pts):
        if lx <= x1:
            return e0 + (lx - x0) / (x1 - x0) * (e1 - e0)
    return pts[-1][1]


# ---------------------------------------------------------------- alpha-beta


@dataclass(frozen=True)
class Sample:
    op: str
    n: int
    size: float  # bytes (total array, nccl-tests convention)
    time_s: float


@dataclass(frozen=True)
class AlphaBetaFit:
    alpha_s: float  # per latency step
    busbw_Bps: float
    n_train: int
    n_holdout: int
    train_error: float | None
    holdout_error: float | None
    holdout_keys: frozenset[tuple[int, float]]  # (n, size) left out

    def predict(self, op: str, n: int, size: float) -> float:
        return self.alpha_s * collective_steps(op, n) + size * busbw_factor(op, n) / self.busbw_Bps


def fit_alpha_beta(samples: Sequence[Sample], holdout: bool = True) -> AlphaBetaFit:
    """Fit t = α·steps + S·factor·β (α, β ≥ 0) minimising the sum of |relative error|.

    Least absolute (not squared) relative deviations, by iteratively reweighted
    least squares: a size the machine's noise hit (another process took the core
    for a scheduler quantum) moves the fit little, and each size counts the same
    whether it takes microseconds or seconds.
    """
    held: set[tuple[int, float]] = set()
    for n in sorted({s.n for s in samples}) if holdout else []:
        sizes = sorted({s.size for s in samples if s.n == n})
        held.update((n, x) for x, h in zip(sizes, holdout_mask(len(sizes)), strict=True) if h)
    train = [s for s in samples if (s.n, s.size) not in held]
    test = [s for s in samples if (s.n, s.size) in held]
    if not train:
        raise ValueError("no collective samples to fit")
    rows = [(collective_steps(s.op, s.n) / s.time_s, s.size * busbw_factor(s.op, s.n) / s.time_s)
            for s in train]
    alpha, beta = _irls_l1(rows)
    if beta <= 0:  # time does not grow with size in these samples: bound it by the largest
        big = max(train, key=lambda s: s.size)
        beta = big.time_s / (big.size * busbw_factor(big.op, big.n))
    fit = AlphaBetaFit(alpha, 1.0 / beta, len(train), len(test), None, None, frozenset(held))
    tr = [rel_error(fit.predict(s.op, s.n, s.size), s.time_s) for s in train]
    ho = [rel_error(fit.predict(s.op, s.n, s.size), s.time_s) for s in test]
    return AlphaBetaFit(alpha, 1.0 / beta, len(train), len(test), median_or_none(tr),
                        median_or_none(ho), frozenset(held))


def _irls_l1(rows: Sequence[tuple[float, float]], iters: int = 50) -> tuple[float, float]:
    """min Σ |a·x + b·y − 1| over x, y ≥ 0, starting from the least-squares solution."""
    weights = [1.0] * len(rows)
    x, y = _nnls2(rows, weights)
    for _ in range(iters):
        weights = [1.0 / max(abs(a * x + b * y - 1.0), 1e-4) for a, b in rows]
        nx, ny = _nnls2(rows, weights)
        if abs(nx - x) <= 1e-9 * max(abs(x), 1e-30) and abs(ny - y) <= 1e-9 * max(abs(y), 1e-30):
            break
        x, y = nx, ny
    return x, y


def _nnls2(rows: Sequence[tuple[float, float]], w: Sequence[float]) -> tuple[float, float]:
    """min Σ w·(a·x + b·y − 1)² over x, y ≥ 0 (2 unknowns: solve the active sets directly)."""
    saa = sum(wi * a * a for (a, _), wi in zip(rows, w, strict=True))
    sbb = sum(wi * b * b for (_, b), wi in zip(rows, w, strict=True))
    sab = sum(wi * a * b for (a, b), wi in zip(rows, w, strict=True))
    sa = sum(wi * a for (a, _), wi in zip(rows, w, strict=True))
    sb = sum(wi * b for (_, b), wi in zip(rows, w, strict=True))
    det = saa * sbb - sab * sab
    if det > 1e-12 * max(saa * sbb, 1e-300):
        x = (sa * sbb - sb * sab) / det
        y = (saa * sb - sab * sa) / det
        if x >= 0 and y >= 0:
            return x, y
    cands = [(0.0, sb / sbb if sbb else 0.0), (sa / saa if saa else 0.0, 0.0)]

    def cost(c: tuple[float, float]) -> float:
        return sum(wi * (a * c[0] + b * c[1] - 1.0) ** 2
                   for (a, b), wi in zip(rows, w, strict=True))

    return min(cands, key=cost)
