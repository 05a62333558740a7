"""Fitting the cost terms beyond the shared curves: the overhead, a curve per cost class,
and the two-rank terms of the collectives' launch.

- ``kernel_overhead``: the intercept of t = o + bytes / bandwidth through the tiny
  add and copy kernels (:func:`calibration.microbench.fit.fit_intercept`), the
  median of the kernels' intercepts. Every curve is then fitted to times net of
  it, so the cost model's ``max(compute, memory) + overhead`` charges it once.
- ``class_efficiency``: each cost class's own records (:data:`CLASS_SOURCES`)
  fitted like the shared curves, against the same peak (GEMM and attention
  curves monotone on a GPU, as the shared ones are).
- the two-rank terms (:mod:`calibration.microbench.terms`): each term's module fits
  its latest successful record (``interference`` per link class, one node:
  ``intra_node``; the ``collective_sync`` and ``send_sync`` costs; ``funcol_host``, a
  line in the bytes per kind; the ``rank_spread``), and :func:`fit_two_rank` keeps
  each figure and the record it came from. The collective sync cost's growth by the
  compute before it leaves out what the rank spread already charges, so it is fitted
  last.

Each term's spread (``uncertainty``) is :mod:`calibration.microbench.spread`'s.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from calibration.microbench.bench_compute import KERNEL_CLASS
from calibration.microbench.fit import CurveFit, LineFit, fit_efficiency, fit_intercept, net_time
from calibration.microbench.terms import collective_sync
from calibration.microbench.terms.registry import TERMS

#: Record kind (and, for memory, the kernels) that feed each class's curve.
CLASS_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemm_fwd": ("gemm", ()), "gemm_dgrad": ("gemm_layout", ("dgrad",)),
    "gemm_wgrad": ("gemm_layout", ("wgrad",)), "attention_fwd": ("attention", ()),
    "attention_bwd": ("attention_bwd", ()),
    **{cls: ("memory", tuple(k for k, c in KERNEL_CLASS.items() if c == cls))
       for cls in ("softmax", "cross_entropy", "elementwise", "norm", "reduction", "copy",
                   "optimizer")},
}


@dataclass
class TermFits:
    overhead: dict[str, LineFit] = field(default_factory=dict)  # per kernel
    overhead_s: float = 0.0
    classes: dict[str, CurveFit] = field(default_factory=dict)
    class_records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    interference: dict[str, float] = field(default_factory=dict)  # link class -> factor
    collective_sync: dict[str, float] = field(default_factory=dict)  # link class -> s
    # link class -> (bytes, s) by size
    collective_sync_curve: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # link class -> (seconds of compute before, s beyond the base burst's) by burst
    collective_sync_burst: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    send_sync: dict[str, float] = field(default_factory=dict)  # link class -> s
    # kind -> (s, s per byte)
    funcol_host: dict[str, tuple[float, float]] = field(default_factory=dict)
    rank_spread: float | None = None  # relative spread of a rank's compute time
    # two-rank term (its registry name) -> the record it was fitted from, measured ones only
    records: dict[str, dict[str, Any]] = field(default_factory=dict)


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
            peak = executed_peak(rs, peak, "bwd" if cls == "attention_bwd" else "fwd")
        out.classes[cls] = fit_efficiency([r[size] for r in rs], [r["time_s"] for r in rs],
                                          peak, monotone=flops and monotone_flops,
                                          offset_s=overhead_s)
        out.class_records[cls] = rs
    return out


def executed_peak(records: list[dict[str, Any]], peak: float, pass_: str = "fwd") -> float:
    """The peak an attention curve is fitted against: ``peak / flash_scale`` when every
    record timed a causal call, so that the curve's efficiencies are of executed FLOPs,
    as the cost model reads them (``flops · compute_scale / (peak · eff)``,
    :mod:`simulator.system.costs`): the causal half, and for a backward (``pass_``) its
    recomputation of the scores (:func:`simulator.model.inventory.ops.flash_scale`).

    The records count the full square (``4·b·a·s²·d``, causal not discounted; a backward
    twice that); fitted against the plain peak, a causal kernel's curve held the skipped
    half already and the cost model halved it again, charging half the time a calibrated
    shape took. Whatever the kernel really skips at a size (on a CPU at s = 256 the flash
    kernel's one key block covers the whole row: it skips little) is then in the
    curve."""
    from simulator.model.inventory.ops import flash_scale

    causal = bool(records) and all(r.get("causal") for r in records)
    return peak / flash_scale(pass_) if causal else peak


def best_rate(records: list[dict[str, Any]], size: str, overhead_s: float) -> float:
    """The fastest size per net second among kernels whose own work is at least the
    overhead (smaller ones' net times are mostly the overhead's error)."""
    big = [r for r in records if r["time_s"] >= 2 * overhead_s] or records
    return max(r[size] / net_time(r["time_s"], overhead_s) for r in big)


def fit_two_rank(out: TermFits, records: list[dict[str, Any]]) -> None:
    """Each two-rank term's figure from its records among ``records`` (one device and
    thread count), into ``out``, with the record each measured term was fitted from."""
    of = {name: [r for r in records if r.get("kind") == term.KIND]
          for name, term in TERMS.items()}
    fitted = {name: term.fit(of[name]) for name, term in TERMS.items()}
    out.records = {name: rec for name, (_, rec) in fitted.items() if rec is not None}
    out.interference = fitted["interference"][0]
    out.collective_sync = fitted["collective_sync"][0]
    out.collective_sync_curve = collective_sync.curve_by_link(of["collective_sync"])
    out.send_sync = fitted["send_sync"][0]
    out.funcol_host = fitted["funcol_host"][0]
    out.rank_spread = fitted["rank_spread"][0]
    out.collective_sync_burst = collective_sync.burst_by_link(  # less what the spread charges
        of["collective_sync"], out.rank_spread or 0.0)
