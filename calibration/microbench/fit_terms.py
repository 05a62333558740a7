"""Fitting the cost terms: overhead, a curve per cost class, interference, the collective
sync cost, and each one's spread.

- ``kernel_overhead``: the intercept of t = o + bytes / bandwidth through the tiny
  add and copy kernels (:func:`calibration.microbench.fit.fit_intercept`), the
  median of the kernels' intercepts. Every curve is then fitted to times net of
  it, so the cost model's ``max(compute, memory) + overhead`` charges it once.
- ``class_efficiency``: each cost class's own records (:data:`CLASS_SOURCES`)
  fitted like the shared curves, against the same peak (GEMM and attention
  curves monotone on a GPU, as the shared ones are).
- ``interference``: the measured factor per link class (one node: ``intra_node``).
- ``collective_sync``: the cost of a collective after compute beyond back to back,
  per link class (:func:`calibration.microbench.collective_sync.sync_seconds`);
- ``send_sync``: the same for a point-to-point send
  (:func:`calibration.microbench.send_sync.sync_seconds`);
- ``funcol_host``: the issuing thread's time in DTensor's redistributions beyond the
  plain c10d collectives, a line in the bytes per kind
  (:func:`calibration.microbench.funcol_host.host_lines`);
- ``rank_spread``: the relative spread of a rank's compute time, from the slower of two
  ranks running the same burst (:func:`calibration.microbench.rank_spread.spread`).

The spread of each fitted term (``uncertainty``, a relative σ) is how far a
rerun of the calibration could plausibly move the term as a whole — the Monte
Carlo of ``clustersim run --uncertainty`` scales each term by one factor per
sample, so this is the uncertainty of the curve's level, not one kernel's
scatter about it. Three sources, added in quadrature: the standard error of the
level (the robust σ of the relative residuals about the curve, 1.4826 × their
median absolute value, over √n points); the machine's state, as the scatter of
one timing between repeats (the median (p75 − p25) / median of the term's
records, / 1.349 to read as a σ; about 1.5–4% on an idle machine), which does
not average away over points; and the machine's drift during the run (the
reference kernel's start-to-end drift d as a uniform spread, d / √12). The
overhead's spread is its jackknife standard error, the standard error of the
mean over kernels, and the drift; a link's the standard error of its α-β fit's
level (residual σ / √n); the interference factor's the standard error of the
mean over its rounds, each sync cost's the standard error of its rounds' figures
relative to it, and the rank spread's the standard error of its rounds' excesses
relative to their mean. A term that was not measured gets no spread (the run
reports a point estimate for it) and ``source: preset`` in ``provenance.terms``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from calibration.microbench import collective_sync as cs
from calibration.microbench import funcol_host as fh
from calibration.microbench import rank_spread as rs
from calibration.microbench import send_sync as ss
from calibration.microbench.bench_compute import KERNEL_CLASS
from calibration.microbench.fit import (
    AlphaBetaFit,
    CurveFit,
    LineFit,
    Sample,
    fit_efficiency,
    fit_intercept,
    net_time,
    robust_sigma,
)

#: Record kind (and, for memory, the kernels) that feed each class's curve.
CLASS_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemm_fwd": ("gemm", ()), "gemm_dgrad": ("gemm_layout", ("dgrad",)),
    "gemm_wgrad": ("gemm_layout", ("wgrad",)), "attention_fwd": ("attention", ()),
    "attention_bwd": ("attention_bwd", ()),
    **{cls: ("memory", tuple(k for k, c in KERNEL_CLASS.items() if c == cls))
       for cls in ("softmax", "cross_entropy", "elementwise", "norm", "reduction", "copy",
                   "optimizer")},
}
if TYPE_CHECKING:
    from calibration.microbench.fit_profile import Fits

IQR_PER_SIGMA = 1.349  # a normal distribution's interquartile range in σ
#: A sync record's figure in seconds (``sync_seconds`` of its microbenchmark).
Figure = Callable[[dict[str, Any]], float]


@dataclass
class TermFits:
    overhead: dict[str, LineFit] = field(default_factory=dict)  # per kernel
    overhead_s: float = 0.0
    classes: dict[str, CurveFit] = field(default_factory=dict)
    class_records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    interference: dict[str, float] = field(default_factory=dict)  # link class -> factor
    interference_record: dict[str, Any] | None = None
    collective_sync: dict[str, float] = field(default_factory=dict)  # link class -> s
    # link class -> (bytes, s) by size
    collective_sync_curve: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # link class -> (seconds of compute before, s beyond the base burst's) by burst
    collective_sync_burst: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    collective_sync_record: dict[str, Any] | None = None
    send_sync: dict[str, float] = field(default_factory=dict)  # link class -> s
    send_sync_record: dict[str, Any] | None = None
    # kind -> (s, s per byte)
    funcol_host: dict[str, tuple[float, float]] = field(default_factory=dict)
    funcol_host_record: dict[str, Any] | None = None
    rank_spread: float | None = None  # relative spread of a rank's compute time
    rank_spread_record: dict[str, Any] | None = None


def fit_overhead(records: list[dict[str, Any]]) -> tuple[dict[str, LineFit], float]:
    """Per-kernel intercept fits of the tiny kernels, and the overhead (their median)."""
    by_kernel: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_kernel.setdefault(r["kernel"], []).append(r)
    fits = {k: fit_intercept([r["bytes"] for r in rs], [r["time_s"] for r in rs])
            for k, rs in sorted(by_kernel.items()) if len(rs) >= 2}
    overhead = statistics.median(f.intercept_s for f in fits.values()) if fits else 0.0
    return fits, overhead


def class_records(cls: str, by_kind: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    kind, which = CLASS_SOURCES[cls]
    rs = by_kind.get(kind, [])
    if kind == "memory":
        return [r for r in rs if r.get("kernel") in which]
    if kind == "gemm_layout":
        return [r for r in rs if r.get("layout") in which]
    return rs


def fit_classes(by_kind: dict[str, list[dict[str, Any]]], flops_peak: float | None,
                bytes_peak: float | None, overhead_s: float,
                monotone_flops: bool = True) -> TermFits:
    """A curve per cost class that has records (two or more), against the shared peaks."""
    out = TermFits(overhead_s=overhead_s)
    for cls in CLASS_SOURCES:
        rs = class_records(cls, by_kind)
        flops = CLASS_SOURCES[cls][0] != "memory"
        peak = flops_peak if flops else bytes_peak
        if len(rs) < 2 or not peak:
            continue
        size = "flops" if flops else "bytes"
        if cls.startswith("attention_"):
            peak = executed_peak(rs, peak)
        out.classes[cls] = fit_efficiency([r[size] for r in rs], [r["time_s"] for r in rs],
                                          peak, monotone=flops and monotone_flops,
                                          offset_s=overhead_s)
        out.class_records[cls] = rs
    return out


def executed_peak(records: list[dict[str, Any]], peak: float) -> float:
    """The peak an attention curve is fitted against: ``peak / CAUSAL_FLASH_SCALE`` when
    every record timed a causal call, so that the curve's efficiencies are of executed
    FLOPs, as the cost model reads them (``flops · compute_scale / (peak · eff)``,
    :mod:`simulator.system.costs`).

    The records count the full square (``4·b·a·s²·d``, causal not discounted); fitted
    against the plain peak, a causal kernel's curve held the skipped half already and
    the cost model halved it again, charging half the time a calibrated shape took.
    Whatever the kernel really skips at a size (on a CPU at s = 256 the flash kernel's
    one key block covers the whole row: it skips little) is then in the curve."""
    from simulator.model.inventory import CAUSAL_FLASH_SCALE

    causal = bool(records) and all(r.get("causal") for r in records)
    return peak / CAUSAL_FLASH_SCALE if causal else peak


def best_rate(records: list[dict[str, Any]], size: str, overhead_s: float) -> float:
    """The fastest size per net second among kernels whose own work is at least the
    overhead (smaller ones' net times are mostly the overhead's error)."""
    big = [r for r in records if r["time_s"] >= 2 * overhead_s] or records
    return max(r[size] / net_time(r["time_s"], overhead_s) for r in big)


def interference_factor(records: list[dict[str, Any]]) -> tuple[dict[str, float],
                                                                 dict[str, Any] | None]:
    ok = [r for r in records if r.get("ok") and "factor" in r]
    if not ok:
        return {}, None
    rec = ok[-1]
    return {str(rec.get("link", "intra_node")): float(rec["factor"])}, rec


def collective_sync(records: list[dict[str, Any]]) -> tuple[dict[str, float],
                                                            dict[str, Any] | None]:
    """The sync cost in seconds per link class, from the latest successful record."""
    return _sync_term(records, cs.sync_seconds)


def collective_sync_curve(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The sync cost by size per link class (:func:`calibration.microbench.collective_sync.
    sync_curve`), from the latest successful record; none with fewer than two sizes."""
    rec = _latest_rounds(records)
    if rec is None:
        return {}
    curve = cs.sync_curve(rec)
    return {str(rec.get("link", "intra_node")): curve} if len(curve) > 1 else {}


def collective_sync_burst(records: list[dict[str, Any]], spread: float = 0.0,
                          ) -> dict[str, list[tuple[float, float]]]:
    """The sync cost's growth by compute burst per link class (:func:`calibration.
    microbench.collective_sync.burst_curve`, less what a rank ``spread`` already charges),
    from the latest successful record; none without longer bursts."""
    rec = _latest_rounds(records)
    if rec is None:
        return {}
    curve = cs.burst_curve(rec, spread)
    return {str(rec.get("link", "intra_node")): curve} if len(curve) > 1 else {}


def send_sync(records: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any] | None]:
    """The send sync cost in seconds per link class, from the latest successful record."""
    return _sync_term(records, ss.sync_seconds)


def funcol_host(records: list[dict[str, Any]]) -> tuple[dict[str, tuple[float, float]],
                                                        dict[str, Any] | None]:
    """The host time of DTensor's redistributions beyond the plain collectives, per kind
    ``(seconds, seconds per byte)``, from the latest successful record."""
    rec = _latest_rounds(records)
    return ({}, None) if rec is None else (fh.host_lines(rec), rec)


def rank_spread(records: list[dict[str, Any]]) -> tuple[float | None, dict[str, Any] | None]:
    """The rank spread (relative σ of a rank's compute time), from the latest successful
    record."""
    rec = _latest_rounds(records)
    return (None, None) if rec is None else (rs.spread(rec), rec)


def _sync_term(records: list[dict[str, Any]], seconds: Figure) -> tuple[dict[str, float],
                                                                         dict[str, Any] | None]:
    rec = _latest_rounds(records)
    return ({}, None) if rec is None else ({str(rec.get("link", "intra_node")): seconds(rec)},
                                           rec)


def _latest_rounds(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest successful record that has rounds (a term measured in rounds)."""
    ok = [r for r in records if r.get("ok") and r.get("rounds")]
    return ok[-1] if ok else None


# ---------------------------------------------------------------- spreads


def quadrature(*parts: float | None) -> float:
    return math.sqrt(sum(p * p for p in parts if p is not None))


def repeat_sigma(records: list[dict[str, Any]]) -> float | None:
    spreads = [float(r["spread"]) for r in records if "spread" in r]
    return statistics.median(spreads) / IQR_PER_SIGMA if spreads else None


def curve_spread(fit: CurveFit, records: list[dict[str, Any]], drift: float | None) -> float:
    n = fit.n_train + fit.n_holdout
    level = fit.resid_sigma / math.sqrt(n) if fit.resid_sigma is not None and n else None
    return _clamp(quadrature(level, repeat_sigma(records),
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
    return _clamp(quadrature(between, math.sqrt(statistics.fmean(x * x for x in se)) if se
                             else None, drift / math.sqrt(12) if drift else None))


def link_spread(fit: AlphaBetaFit, samples: list[Sample]) -> float | None:
    errs = [fit.predict(s.op, s.n, s.size) / s.time_s - 1.0 for s in samples]
    sigma = robust_sigma(errs)
    return None if sigma is None else _clamp(sigma / math.sqrt(len(errs)))


def interference_spread(rec: dict[str, Any] | None) -> float | None:
    return _mean_rel_se([float(x) for x in (rec or {}).get("round_ratios", [])])


def _mean_rel_se(values: list[float]) -> float | None:
    """The standard error of the mean of ``values`` relative to it (None for fewer than
    two, or a mean of 0 or less)."""
    if len(values) < 2 or statistics.fmean(values) <= 0:
        return None
    return _clamp(statistics.stdev(values) / statistics.fmean(values) / math.sqrt(len(values)))


def collective_sync_spread(rec: dict[str, Any] | None) -> float | None:
    return _sync_spread(rec, cs.sync_seconds, cs.round_figures)


def send_sync_spread(rec: dict[str, Any] | None) -> float | None:
    return _sync_spread(rec, ss.sync_seconds, ss.round_figures)


def funcol_host_spread(rec: dict[str, Any] | None) -> float | None:
    return _sync_spread(rec, fh.level_seconds, fh.round_figures)


def rank_spread_spread(rec: dict[str, Any] | None) -> float | None:
    return _mean_rel_se(rs.round_excesses(rec) if rec else [])


def _sync_spread(rec: dict[str, Any] | None, seconds: Figure,
                 figures_of: Callable[[dict[str, Any]], list[float]]) -> float | None:
    if not rec or len(rec.get("rounds", [])) < 2 or seconds(rec) <= 0:
        return None
    figures = figures_of(rec)
    return _clamp(statistics.stdev(figures) / seconds(rec) / math.sqrt(len(figures)))


def _clamp(x: float) -> float:
    return round(min(max(x, 0.0), 1.0), 4)


# ---------------------------------------------------------------- what the profile says


def term_sources(fits: Fits, base_name: str) -> tuple[dict[str, dict[str, Any]],
                                                      dict[str, float]]:
    """``provenance.terms`` (each term: measured, with its samples and spread, or
    preset) and the ``uncertainty`` section (measured terms only)."""
    terms: dict[str, dict[str, Any]] = {}
    spread: dict[str, float] = {}

    def measured(term: str, samples: int, sigma: float | None, **extra: Any) -> None:
        terms[term] = {"source": "measured", "samples": samples, "rel_std": sigma, **extra}
        if sigma is not None:
            spread[term] = sigma

    for term, fit in (("gemm", fits.gemm), ("attention", fits.attention),
                      ("memory", fits.memory)):
        if fit is not None:
            measured(term, fit.n_train + fit.n_holdout,
                     curve_spread(fit, fits.records.get(term, []), fits.drift))
    for cls, fit in fits.terms.classes.items():
        measured(cls, fit.n_train + fit.n_holdout,
                 curve_spread(fit, fits.terms.class_records[cls], fits.drift))
    if fits.overhead:
        measured("kernel_overhead", sum(f.n for f in fits.overhead.values()),
                 overhead_spread(fits.overhead, fits.drift))
    for link in ("intra_node", "inter_node"):
        op = next((o for o in ("all_reduce", "reduce_scatter", "all_gather")
                   if link in fits.collectives.get(o, {})), None)
        if op is not None:
            ab = fits.collectives[op][link]
            measured(link, ab.n_train + ab.n_holdout,
                     link_spread(ab, fits.collective_samples[op][link]), fitted_from=op)
    p2p = fits.collectives.get("send_recv", {})
    if p2p:
        terms["point_to_point"] = {"source": "measured", "links": sorted(p2p)}
    rec = fits.terms.interference_record
    if rec is not None:
        measured("interference", len(rec.get("round_ratios", [])), interference_spread(rec),
                 link=rec.get("link", "intra_node"), covered=rec.get("covered"))
    for term, rec, mod, sync_spread in (
            ("collective_sync", fits.terms.collective_sync_record, cs, collective_sync_spread),
            ("send_sync", fits.terms.send_sync_record, ss, send_sync_spread)):
        if rec is not None:
            measured(term, len(rec["rounds"]), sync_spread(rec),
                     link=rec.get("link", "intra_node"),
                     by_size_us={s: round(t * 1e6, 1) for s, t in mod.excess_by_size(rec).items()})
    rec = fits.terms.funcol_host_record
    if rec is not None:
        measured("funcol_host", len(rec["rounds"]), funcol_host_spread(rec),
                 link=rec.get("link", "intra_node"), clock=rec.get("clock"),
                 by_size_us={kind: {s: round(t * 1e6, 1)
                                    for s, t in fh.excess_by_size(rec, kind).items()}
                             for kind in fits.terms.funcol_host})
    rec = fits.terms.collective_sync_record
    if rec is not None and rec.get("burst_rounds"):  # its growth, by the burst's ms
        terms["collective_sync"]["growth_by_burst_us"] = {
            f"{b * 1e3:.3g} ms": round(t * 1e6, 1) for b, t in cs.burst_excess(rec).items()}
    rec = fits.terms.rank_spread_record
    if rec is not None:
        measured("rank_spread", len(rec["rounds"]), rank_spread_spread(rec),
                 excess=round(rs.excess(rec), 4), burst_s=rec.get("burst_s"))
    names = ("gemm", "attention", "memory", *CLASS_SOURCES, "kernel_overhead", "intra_node",
             "inter_node", "point_to_point", "interference", "collective_sync", "send_sync",
             "funcol_host", "rank_spread")
    for term in names:
        terms.setdefault(term, {"source": "preset", "from": base_name})
    return terms, spread
