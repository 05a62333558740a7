"""From a results file to the fits a hardware profile is built from: choose peaks, fit
curves, the collectives and the terms.

Peaks. The efficiency curves are relative to ``gpu.peak_tflops[dtype]`` and
``gpu.hbm_bandwidth_GBps``, and must stay ≤ 1. On a CUDA device whose datasheet
a bundled preset carries (A100, H100, H200: :mod:`simulator.system.devices`) the datasheet
peak is used, so the curve reads as "fraction of datasheet" like the presets'; otherwise
(a CPU, an unknown GPU) the peak is the best rate measured. The other dtypes' peaks come
from the same few large GEMMs timed in each dtype (peak × their speed ratio), so
one curve serves all dtypes, as the schema has it.

:mod:`calibration.microbench.profile_build` fills the schema from the fits and writes
the profile.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from calibration.microbench.fit import (
    AlphaBetaFit,
    CurveFit,
    LineFit,
    Sample,
    fit_alpha_beta,
    fit_efficiency,
    sig,
)
from calibration.microbench.fit_terms import (
    TermFits,
    best_rate,
    executed_peak,
    fit_classes,
    fit_overhead,
    fit_two_rank,
)
from simulator.model.inventory.ops import call_shape
from simulator.system.devices import preset_for as datasheet_preset
from simulator.system.hardware import HardwareProfile
from simulator.system.profiles import load_system


@dataclass
class Fits:
    dtype: str
    peak_tflops: dict[str, float] = field(default_factory=dict)
    peak_source: str = ""
    hbm_GBps: float | None = None
    hbm_source: str = ""
    gemm: CurveFit | None = None
    fp8_gemm: CurveFit | None = None  # against peak_tflops["fp8"], where FP8 GEMMs were timed
    # the CTA tiles and SMs whose quantisation the GEMM curves leave out (well_quantised)
    gemm_tiles: tuple[tuple[int, int], ...] = ()
    sms: int | None = None
    # the reduction-depth term the GEMM curves leave out (well_quantised): its points
    gemm_depth: list[tuple[float, float]] = field(default_factory=list)
    attention: CurveFit | None = None
    memory: CurveFit | None = None
    memory_kernels: dict[str, dict[str, float]] = field(default_factory=dict)
    collectives: dict[str, dict[str, AlphaBetaFit]] = field(default_factory=dict)
    collective_samples: dict[str, dict[str, list[Sample]]] = field(default_factory=dict)
    overhead: dict[str, LineFit] = field(default_factory=dict)  # per tiny kernel
    terms: TermFits = field(default_factory=TermFits)
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # by kind, fitted
    drift: float | None = None  # the busy guard's reference drift (spreads include it)


def _ok(records: list[dict[str, Any]], kind: str, **match: Any) -> list[dict[str, Any]]:
    """Successful records of a kind, the fastest per key (rechecks and retries re-time keys)."""
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        if (r.get("kind") == kind and r.get("ok") and "time_s" in r
                and all(r.get(k) == v for k, v in match.items())
                and (r["key"] not in best or r["time_s"] < best[r["key"]]["time_s"])):
            best[r["key"]] = r
    return list(best.values())


def fit_compute(records: list[dict[str, Any]], device: str, dtype: str, threads: int,
                device_name: str, drift: float | None = None) -> Fits:
    """Everything but the collectives from the records of this device, dtype and thread
    count: the peaks, the shared curves, the overhead, the class curves and the two-rank
    terms."""
    fits = Fits(dtype, drift=drift)
    sel = {"device": device, "threads": threads}
    by_kind = {kind: _ok(records, kind, dtype=dtype, **sel)
               for kind in ("gemm", "gemm_layout", "attention", "attention_bwd", "memory",
                            "overhead")}
    fits.records = by_kind
    fits.overhead, ov = fit_overhead(by_kind["overhead"])
    sheet = load_system(p) if device == "cuda" and (p := datasheet_preset(device_name)) else None
    # a GPU's GEMMs do not get less efficient with size (the envelope shrugs off a slow
    # reading); a CPU's do (a small GEMM runs from cache), so its curve follows the data
    gpu_like = device == "cuda"
    peak = _fit_flops(fits, records, by_kind, sheet, sel, ov, gpu_like)
    _fit_fp8(fits, _ok(records, "gemm_fp8", dtype="fp8", **sel), sheet, ov, gpu_like)
    _fit_memory(fits, by_kind["memory"], sheet, ov)
    shaped = {**by_kind, "gemm": well_quantised(by_kind["gemm"], sheet),
              "gemm_layout": well_quantised(by_kind["gemm_layout"], sheet)}
    fits.terms = fit_classes(shaped, peak, fits.hbm_GBps * 1e9 if fits.hbm_GBps else None, ov,
                             gpu_like)
    fit_two_rank(fits.terms, [r for r in records if all(r.get(k) == v for k, v in sel.items())])
    return fits


def well_quantised(records: list[dict[str, Any]],
                   sheet: HardwareProfile | None) -> list[dict[str, Any]]:
    """GEMM records with each time multiplied by its shape's factor on the datasheet
    preset's tiles (:meth:`GPUSpec.gemm_shape_factor`; the call as its layout runs it):
    the time those FLOPs would take perfectly tiled in whole waves over a deep k-loop
    (the preset's ``gemm_depth`` too), so the fitted curve is the one the cost model
    multiplies by the same factor again. Unchanged without tiles or a depth curve (a
    CPU, a GPU no preset describes)."""
    if sheet is None or not (sheet.gpu.gemm_tiles or sheet.gpu.gemm_depth):
        return records
    gpu = sheet.gpu
    return [{**r, "time_s": r["time_s"] * gpu.gemm_shape_factor(
        call_shape(r["m"], r["k"], r["n"], f"gemm_{r.get('layout', 'fwd')}"))}
            for r in records]


def _fit_flops(fits: Fits, records: list[dict[str, Any]],
               by_kind: dict[str, list[dict[str, Any]]], sheet: HardwareProfile | None,
               sel: dict[str, Any], ov: float, gpu_like: bool) -> float | None:
    """The FLOP/s peaks (the datasheet's where it is at least the best measured rate,
    else that rate, and the other dtypes' from the probe GEMMs) and the GEMM and attention
    curves against them; returns the fitted dtype's peak in FLOP/s (None without GEMMs)."""
    gemm, att, dtype = by_kind["gemm"], by_kind["attention"], fits.dtype
    if not gemm:
        return None
    best = best_rate(gemm + by_kind["gemm_layout"], "flops", ov) / 1e12
    if sheet and sheet.gpu.peak_tflops.get(dtype, 0) >= best:  # type: ignore[call-overload]
        fits.peak_tflops = {str(k): v for k, v in sheet.gpu.peak_tflops.items()}
        fits.peak_source = f"datasheet (preset {sheet.name})"
    else:
        fits.peak_tflops = {dtype: sig(best)}
        fits.peak_source = f"best measured {dtype} GEMM rate"
        fits.peak_tflops.update(_other_dtype_peaks(records, gemm, best, sel, dtype))
    peak = fits.peak_tflops[dtype] * 1e12
    shaped = well_quantised(gemm, sheet)
    fits.gemm = fit_efficiency([r["flops"] for r in shaped], [r["time_s"] for r in shaped],
                               peak, monotone=gpu_like, offset_s=ov)
    if sheet is not None and sheet.gpu.gemm_tiles:  # the shape term the curve leaves out
        fits.gemm_tiles, fits.sms = sheet.gpu.gemm_tiles, sheet.gpu.sms
    if sheet is not None and sheet.gpu.gemm_depth is not None:  # and the depth term
        fits.gemm_depth = list(sheet.gpu.gemm_depth.points)
    if att:
        fits.attention = fit_efficiency([r["flops"] for r in att], [r["time_s"] for r in att],
                                        executed_peak(att, peak), monotone=gpu_like,
                                        offset_s=ov)
    return peak


def _fit_fp8(fits: Fits, fp8: list[dict[str, Any]], sheet: HardwareProfile | None, ov: float,
             gpu_like: bool) -> None:
    """The fp8 peak (the datasheet's where it is at least the best measured FP8 rate, else
    that rate) and the FP8 GEMM curve against it; nothing without FP8 records."""
    if not fp8:
        return
    best = best_rate(fp8, "flops", ov) / 1e12
    listed = sheet.gpu.peak_tflops.get("fp8", 0) if sheet else 0
    fits.peak_tflops["fp8"] = listed if listed >= best else sig(best)
    shaped = well_quantised(fp8, sheet)
    fits.fp8_gemm = fit_efficiency([r["flops"] for r in shaped], [r["time_s"] for r in shaped],
                                   fits.peak_tflops["fp8"] * 1e12, monotone=gpu_like,
                                   offset_s=ov)


def _fit_memory(fits: Fits, mem: list[dict[str, Any]], sheet: HardwareProfile | None,
                ov: float) -> None:
    """The HBM bandwidth (the datasheet's where it is at least the best measured, else
    that) and the memory-bound curve against it, with each kernel's distance from it."""
    if not mem:
        return
    best_bw = best_rate(mem, "bytes", ov) / 1e9
    if sheet and sheet.gpu.hbm_bandwidth_GBps >= best_bw:
        fits.hbm_GBps = sheet.gpu.hbm_bandwidth_GBps
        fits.hbm_source = f"datasheet ({sheet.name})"
    else:
        fits.hbm_GBps, fits.hbm_source = sig(best_bw), "best measured memory-bound kernel"
    fits.memory = fit_efficiency([r["bytes"] for r in mem], [r["time_s"] for r in mem],
                                 fits.hbm_GBps * 1e9, monotone=False, offset_s=ov)
    fits.memory_kernels = _per_kernel(mem, fits.memory)


def _per_kernel(mem: list[dict[str, Any]], fit: CurveFit) -> dict[str, dict[str, float]]:
    """How far each kernel sits from the one shared curve (the schema has one per device).

    time_ratio > 1: the kernel runs slower than the curve predicts (on a CPU, GELU's erf
    and softmax's exp make them compute-bound; on a GPU all cluster near 1).
    """
    out: dict[str, dict[str, float]] = {}
    for kernel in sorted({r["kernel"] for r in mem}):
        rs = [r for r in mem if r["kernel"] == kernel]
        out[kernel] = {
            "median_GBps": sig(statistics.median(r["bytes"] / r["time_s"] / 1e9 for r in rs)),
            "time_ratio": sig(statistics.median(r["time_s"] / fit.predict_time(r["bytes"])
                                                 for r in rs), 3)}
    return out


def _other_dtype_peaks(records: list[dict[str, Any]], main: list[dict[str, Any]], best: float,
                       sel: dict[str, Any], dtype: str) -> dict[str, float]:
    """peak[other] = peak[main] × median speed ratio on the probe shapes timed in both."""
    rate = {(r["m"], r["n"], r["k"]): r["flops"] / r["time_s"] for r in main}
    out: dict[str, float] = {}
    for other in ("bf16", "fp16", "fp32"):
        if other == dtype:
            continue
        ratios = [r["flops"] / r["time_s"] / rate[(r["m"], r["n"], r["k"])]
                  for r in _ok(records, "gemm", dtype=other, **sel)
                  if (r["m"], r["n"], r["k"]) in rate]
        if ratios:
            out[other] = sig(best * statistics.median(ratios))
    return out


def fit_collectives(fits: Fits, samples: dict[str, dict[str, list[Sample]]]) -> None:
    """samples[op][link] → α/busbw per op and link class (fits.collectives)."""
    for op, by_link in samples.items():
        for link, ss in by_link.items():
            if ss:
                fits.collectives.setdefault(op, {})[link] = fit_alpha_beta(ss)
                fits.collective_samples.setdefault(op, {})[link] = list(ss)


def samples_from_records(records: list[dict[str, Any]], device: str,
                         threads: int) -> dict[str, dict[str, list[Sample]]]:
    out: dict[str, dict[str, list[Sample]]] = {}
    for r in _ok(records, "collective", device=device, threads=threads):
        out.setdefault(r["op"], {}).setdefault(r.get("link", "intra_node"), []).append(
            Sample(r["op"], int(r["nranks"]), float(r["bytes"]), float(r["time_s"])))
    return out
