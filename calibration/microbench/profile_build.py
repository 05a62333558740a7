"""From the fits to the hardware profile: fill the schema over a base preset, say where
every term came from, and write the file.

Everything not measured (inter-node links without nccl-tests input, host numbers,
skipped benchmarks) is copied from a base preset, and provenance says which fields those
are. Link specs are filled from the all-reduce fit (line rate = fitted busbw, efficiency
1, unless a datasheet line rate is known) so that a consumer that ignores the
``collectives`` table still gets measured numbers. ``provenance.terms`` gives each term
its source (measured, with its samples and spread, or the preset) and ``uncertainty``
the measured terms' spreads (:mod:`calibration.microbench.spread`); the two-rank terms
say theirs through the registry (:mod:`calibration.microbench.terms.registry`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from calibration.microbench.fit import AlphaBetaFit, CurveFit, sig
from calibration.microbench.fit_profile import Fits
from calibration.microbench.fit_terms import CLASS_SOURCES
from calibration.microbench.spread import curve_spread, link_spread, overhead_spread
from calibration.microbench.terms.registry import in_profile_order
from simulator.system.hardware import HardwareProfile

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv",
                  "all_to_all")
#: the collectives a link's α-β spec is read from, in preference
LINK_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def build_profile(fits: Fits, base: HardwareProfile, *, name: str, device: str,
                  device_name: str, gpus_per_node: int, memory_GB: float | None,
                  provenance: dict[str, Any], datasheet: bool) -> dict[str, Any]:
    """The profile as a plain dict (measured parts over the base preset's)."""
    prof = base.model_dump(mode="json")
    gpu = prof["gpu"]
    gpu["name"] = device_name
    not_measured: list[str] = []
    _curves_into(gpu, fits, not_measured)
    if memory_GB:
        gpu["memory_GB"] = sig(memory_GB)
    terms = _terms_into(gpu, prof, fits, base, not_measured)
    prof["gpus_per_node"] = gpus_per_node
    for link in ("intra_node", "inter_node"):
        ab = _link_fit(fits, link)
        if ab:
            spec = base.intra_node if link == "intra_node" else base.inter_node
            prof[link].update(_link_from(ab, spec.bandwidth_GBps, datasheet))
        else:
            not_measured.append(link)
    prof["collectives"] = {
        op: {link: {"alpha_us": sig(f.alpha_s * 1e6), "busbw_GBps": sig(f.busbw_Bps / 1e9),
                    "samples": f.n_train + f.n_holdout,
                    "median_rel_error": _round(f.holdout_error if f.holdout_error is not None
                                               else f.train_error)}
             for link, f in by_link.items()}
        for op, by_link in fits.collectives.items() if op in COLLECTIVE_OPS}
    not_measured.append("host")
    prof["name"] = name
    kind = "CPU process" if device == "cpu" else "GPU"
    prof["description"] = f"calibrated on {device_name} ({kind}) by clustersim calibrate"
    prof["provenance"] = {**provenance, "terms": terms, "base_preset": base.name,
                          "not_measured": not_measured, "peak_source": fits.peak_source or None,
                          "hbm_source": fits.hbm_source or None, "fit": _fit_summary(fits)}
    return prof


def _curves_into(gpu: dict[str, Any], fits: Fits, not_measured: list[str]) -> None:
    """The peaks and the shared GEMM, attention and memory curves over the base's."""
    if fits.gemm:
        gpu["peak_tflops"] = fits.peak_tflops
        gpu["gemm_efficiency"] = {"points": [list(p) for p in fits.gemm.points]}
        gpu["kernel_overhead_us"] = 0.0  # without an overhead fit it is inside the curves
        if fits.gemm_tiles:  # the shape term the fit divided out, multiplied back
            gpu["gemm_tiles"], gpu["sms"] = [list(t) for t in fits.gemm_tiles], fits.sms
        else:  # curves over FLOPs alone: no shape term on top
            gpu.pop("gemm_tiles", None)
        if fits.gemm_depth:  # the depth term the fit divided out, multiplied back
            gpu["gemm_depth"] = {"points": [list(p) for p in fits.gemm_depth]}
        else:
            gpu.pop("gemm_depth", None)
    else:
        not_measured += ["gpu.peak_tflops", "gpu.gemm_efficiency"]
    if fits.fp8_gemm and "fp8" in gpu.get("peak_tflops", {}):  # per-tensor FP8 GEMMs timed
        gpu["fp8_gemm_efficiency"] = {"points": [list(p) for p in fits.fp8_gemm.points]}
        gpu["fp8_recipes"] = sorted({*gpu.get("fp8_recipes", ()), "delayed", "current"})
    else:
        not_measured.append("gpu.fp8_gemm_efficiency")
    if fits.attention:
        gpu["attention_efficiency"] = {"points": [list(p) for p in fits.attention.points]}
    else:
        not_measured.append("gpu.attention_efficiency")
    if fits.memory and fits.hbm_GBps:
        gpu["hbm_bandwidth_GBps"] = fits.hbm_GBps
        gpu["memory_efficiency"] = {"points": [list(p) for p in fits.memory.points]}
    else:
        not_measured += ["gpu.hbm_bandwidth_GBps", "gpu.memory_efficiency"]


def _fit_summary(fits: Fits) -> dict[str, Any]:
    """``provenance.fit``: how well each curve, the overhead, the classes and the
    collectives fit, and what each two-rank term's record held."""
    return {
        "gemm": _curve_summary(fits.gemm),
        "attention": _curve_summary(fits.attention),
        "memory": ({**summary, "per_kernel": fits.memory_kernels}
                   if (summary := _curve_summary(fits.memory)) else None),
        "kernel_overhead": {k: {"intercept_us": sig(f.intercept_s * 1e6),
                                "GBps": sig(1 / f.slope_s / 1e9) if f.slope_s else None,
                                "samples": f.n, "median_rel_error": _round(f.median_rel_error),
                                "intercept_rel_se": _round(f.intercept_rel_se)}
                            for k, f in fits.overhead.items()},
        "classes": {cls: _curve_summary(f) for cls, f in fits.terms.classes.items()},
        **{name: (rec := fits.terms.records.get(name)) and {k: rec.get(k)
                                                             for k in term.FIT_FIELDS}
           for name, term in in_profile_order().items()},
        "collectives_holdout_median_rel_error": _round(_pooled_holdout_error(fits)),
        "collectives": {op: {link: {"n_train": f.n_train, "n_holdout": f.n_holdout,
                                    "train_median_rel_error": _round(f.train_error),
                                    "holdout_median_rel_error": _round(f.holdout_error)}
                             for link, f in by_link.items()}
                        for op, by_link in fits.collectives.items()},
    }


def _curve_summary(fit: CurveFit | None) -> dict[str, Any] | None:
    if fit is None:
        return None
    return {"samples": fit.n_train + fit.n_holdout, "n_train": fit.n_train,
            "n_holdout": fit.n_holdout, "train_median_rel_error": _round(fit.train_error),
            "holdout_median_rel_error": _round(fit.holdout_error)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _pooled_holdout_error(fits: Fits) -> float | None:
    """Median relative error over every held-out size of every collective and link."""
    errs = [abs(f.predict(s.op, s.n, s.size) - s.time_s) / s.time_s
            for op, by_link in fits.collectives.items() for link, f in by_link.items()
            for s in fits.collective_samples[op][link] if (s.n, s.size) in f.holdout_keys]
    return float(statistics.median(errs)) if errs else None


def _link_from(fit: AlphaBetaFit, base_bw: float, datasheet: bool) -> dict[str, float]:
    busbw = fit.busbw_Bps / 1e9
    if datasheet and base_bw >= busbw:
        return {"bandwidth_GBps": base_bw, "latency_us": sig(fit.alpha_s * 1e6),
                "efficiency": sig(busbw / base_bw)}
    return {"bandwidth_GBps": sig(busbw), "latency_us": sig(fit.alpha_s * 1e6), "efficiency": 1.0}


def _link_op(fits: Fits, link: str) -> str | None:
    """The collective a link's spec is read from (:data:`LINK_OPS`), None if none ran on it."""
    return next((op for op in LINK_OPS if link in fits.collectives.get(op, {})), None)


def _link_fit(fits: Fits, link: str) -> AlphaBetaFit | None:
    op = _link_op(fits, link)
    return None if op is None else fits.collectives[op][link]


def _terms_into(gpu: dict[str, Any], prof: dict[str, Any], fits: Fits, base: HardwareProfile,
                not_measured: list[str]) -> dict[str, dict[str, Any]]:
    """Overhead, class curves, interference, the sync costs and the spreads over the
    base's; returns each term's source for ``provenance.terms``."""
    if fits.overhead:
        gpu["kernel_overhead_us"] = sig(fits.terms.overhead_s * 1e6)
    else:
        not_measured.append("gpu.kernel_overhead_us")
    gpu["class_efficiency"] = {**gpu.get("class_efficiency", {}),
                               **{cls: {"points": [list(p) for p in f.points]}
                                  for cls, f in fits.terms.classes.items()}}
    gpu["interference"] = {**gpu.get("interference", {}),
                           **{k: sig(v) for k, v in fits.terms.interference.items()}}
    _collective_sync_into(gpu, fits)
    gpu["send_sync_us"] = {**gpu.get("send_sync_us", {}),
                           **{k: sig(v * 1e6) for k, v in fits.terms.send_sync.items()}}
    if fits.terms.funcol_host:  # by kind; the base's older one figure does not outlive it
        gpu["funcol_host"] = {**gpu.get("funcol_host", {}),
                              **{k: {"us": sig(a * 1e6), "us_per_mib": sig(b * 1e6 * (1 << 20))}
                                 for k, (a, b) in fits.terms.funcol_host.items()}}
        gpu.pop("funcol_sync_us", None)
    if fits.terms.rank_spread is not None:  # this machine's own spread, not the base's
        gpu["rank_spread"] = sig(fits.terms.rank_spread)  # population curve
        gpu.pop("rank_excess", None)
    terms, spread = term_sources(fits, base.name)
    prof["uncertainty"] = {**prof.get("uncertainty", {}), **spread}
    return terms


def _collective_sync_into(gpu: dict[str, Any], fits: Fits) -> None:
    """The collective sync cost per link class over the base's, with its curve by size and
    its growth by burst where measured (an earlier profile's of either does not outlive a
    new figure)."""
    gpu["collective_sync_us"] = {**gpu.get("collective_sync_us", {}),
                                 **{k: sig(v * 1e6) for k, v in
                                    fits.terms.collective_sync.items()}}
    if fits.terms.collective_sync_curve:  # by size: the simulator reads it at each size
        gpu["collective_sync_curve"] = {
            **gpu.get("collective_sync_curve", {}),
            **{k: {"points": [[b, sig(t * 1e6)] for b, t in pts]}
               for k, pts in fits.terms.collective_sync_curve.items()}}
    else:  # a figure alone: no curve of an earlier profile outlives it
        for k in fits.terms.collective_sync:
            gpu.get("collective_sync_curve", {}).pop(k, None)
    for k in fits.terms.collective_sync:  # its growth by burst, where measured, else none
        gpu.setdefault("collective_sync_burst", {}).pop(k, None)
    for k, pts in fits.terms.collective_sync_burst.items():
        gpu["collective_sync_burst"][k] = {"points": [[sig(b), sig(t * 1e6)]
                                                      for b, t in pts]}
    if not gpu.get("collective_sync_burst"):
        gpu.pop("collective_sync_burst", None)


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
        op = _link_op(fits, link)
        if op is not None:
            ab = fits.collectives[op][link]
            measured(link, ab.n_train + ab.n_holdout,
                     link_spread(ab, fits.collective_samples[op][link]), fitted_from=op)
    p2p = fits.collectives.get("send_recv", {})
    if p2p:
        terms["point_to_point"] = {"source": "measured", "links": sorted(p2p)}
    for name, two_rank in in_profile_order().items():
        rec = fits.terms.records.get(name)
        if rec is not None:
            samples, details = two_rank.provenance(rec)
            measured(name, samples, two_rank.uncertainty(rec), **details)
    names = ("gemm", "attention", "memory", *CLASS_SOURCES, "kernel_overhead", "intra_node",
             "inter_node", "point_to_point", *in_profile_order())
    for term in names:
        terms.setdefault(term, {"source": "preset", "from": base_name})
    return terms, spread


def _plain(obj: Any) -> Any:
    """Only YAML's plain types (torch's version string is a str subclass yaml rejects)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, bool) or obj is None:
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    return str(obj)


def write_profile(profile: dict[str, Any], path: Path) -> HardwareProfile:
    """Validate against the schema, then write atomically (tmp file + os.replace)."""
    profile = _plain(profile)
    validated = HardwareProfile.model_validate(profile)
    header = (f"# Hardware profile measured by `clustersim calibrate` on "
              f"{time.strftime('%Y-%m-%d')}.\n# Use it with `cluster.system: {path.name}` "
              "in a scenario; provenance lists what was measured and how well it fits.\n")
    text = header + yaml.safe_dump(profile, sort_keys=False, width=100)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        mask = os.umask(0)
        os.umask(mask)
        Path(tmp).chmod(0o666 & ~mask)  # mkstemp made it private; a profile is for sharing
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return validated
