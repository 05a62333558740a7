"""From a results file to a hardware profile: choose peaks, fit curves, fill the schema.

Peaks. The efficiency curves are relative to ``gpu.peak_tflops[dtype]`` and
``gpu.hbm_bandwidth_GBps``, and must stay ≤ 1. On a CUDA device whose datasheet
a bundled preset carries (A100, H100, H200) the datasheet peak is used, so the
curve reads as "fraction of datasheet" like the presets'; otherwise (a CPU, an
unknown GPU) the peak is the best rate measured. The other dtypes' peaks come
from the same few large GEMMs timed in each dtype (peak × their speed ratio), so
one curve serves all dtypes, as the schema has it.

Everything not measured (inter-node links without nccl-tests input, host
numbers, skipped benchmarks) is copied from a base preset, and provenance says
which fields those are. Link specs are filled from the all-reduce fit (line rate
= fitted busbw, efficiency 1, unless a datasheet line rate is known) so that a
consumer that ignores the ``collectives`` table still gets measured numbers.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from calibration.microbench.fit import (
    AlphaBetaFit,
    CurveFit,
    LineFit,
    Sample,
    fit_alpha_beta,
    fit_efficiency,
)
from calibration.microbench.fit_terms import (
    TermFits,
    best_rate,
    collective_sync,
    collective_sync_burst,
    collective_sync_curve,
    executed_peak,
    fit_classes,
    fit_overhead,
    funcol_host,
    interference_factor,
    rank_spread,
    send_sync,
)
from simulator.system.hardware import HardwareProfile, load_system

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv",
                  "all_to_all")
# torch.cuda.get_device_name() substring -> bundled datasheet preset
DATASHEET_PRESETS = (("H200", "dgx-h200"), ("H100", "dgx-h100"),
                     ("A100-SXM4-80GB", "dgx-a100-80gb"), ("A100 80GB", "dgx-a100-80gb"),
                     ("A100", "dgx-a100-40gb"))


def datasheet_preset(device_name: str) -> str | None:
    for needle, preset in DATASHEET_PRESETS:
        if needle.lower() in device_name.lower():
            return preset
    return None


@dataclass
class Fits:
    dtype: str
    peak_tflops: dict[str, float] = field(default_factory=dict)
    peak_source: str = ""
    hbm_GBps: float | None = None
    hbm_source: str = ""
    gemm: CurveFit | None = None
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
    fits = Fits(dtype, drift=drift)
    sel = {"device": device, "threads": threads}
    by_kind = {kind: _ok(records, kind, dtype=dtype, **sel)
               for kind in ("gemm", "gemm_layout", "attention", "attention_bwd", "memory",
                            "overhead")}
    fits.records = by_kind
    gemm, att, mem = by_kind["gemm"], by_kind["attention"], by_kind["memory"]
    fits.overhead, ov = fit_overhead(by_kind["overhead"])
    sheet = load_system(p) if device == "cuda" and (p := datasheet_preset(device_name)) else None
    peak: float | None = None
    # a GPU's GEMMs do not get less efficient with size (the envelope shrugs off a slow
    # reading); a CPU's do (a small GEMM runs from cache), so its curve follows the data
    gpu_like = device == "cuda"
    if gemm:
        best = best_rate(gemm + by_kind["gemm_layout"], "flops", ov) / 1e12
        if sheet and sheet.gpu.peak_tflops.get(dtype, 0) >= best:  # type: ignore[call-overload]
            fits.peak_tflops = {str(k): v for k, v in sheet.gpu.peak_tflops.items()}
            fits.peak_source = f"datasheet (preset {sheet.name})"
        else:
            fits.peak_tflops = {dtype: _sig(best)}
            fits.peak_source = f"best measured {dtype} GEMM rate"
            fits.peak_tflops.update(_other_dtype_peaks(records, gemm, best, sel, dtype))
        peak = fits.peak_tflops[dtype] * 1e12
        fits.gemm = fit_efficiency([r["flops"] for r in gemm], [r["time_s"] for r in gemm],
                                   peak, monotone=gpu_like, offset_s=ov)
        if att:
            fits.attention = fit_efficiency([r["flops"] for r in att], [r["time_s"] for r in att],
                                            executed_peak(att, peak), monotone=gpu_like,
                                            offset_s=ov)
    if mem:
        best_bw = best_rate(mem, "bytes", ov) / 1e9
        if sheet and sheet.gpu.hbm_bandwidth_GBps >= best_bw:
            fits.hbm_GBps = sheet.gpu.hbm_bandwidth_GBps
            fits.hbm_source = f"datasheet ({sheet.name})"
        else:
            fits.hbm_GBps, fits.hbm_source = _sig(best_bw), "best measured memory-bound kernel"
        fits.memory = fit_efficiency([r["bytes"] for r in mem], [r["time_s"] for r in mem],
                                     fits.hbm_GBps * 1e9, monotone=False, offset_s=ov)
        fits.memory_kernels = _per_kernel(mem, fits.memory)
    fits.terms = fit_classes(by_kind, peak, fits.hbm_GBps * 1e9 if fits.hbm_GBps else None, ov,
                             gpu_like)
    fits.terms.interference, fits.terms.interference_record = interference_factor(
        [r for r in records if r.get("kind") == "interference"
         and all(r.get(k) == v for k, v in sel.items())])
    fits.terms.collective_sync, fits.terms.collective_sync_record = collective_sync(
        [r for r in records if r.get("kind") == "collective_sync"
         and all(r.get(k) == v for k, v in sel.items())])
    fits.terms.collective_sync_curve = collective_sync_curve(
        [r for r in records if r.get("kind") == "collective_sync"
         and all(r.get(k) == v for k, v in sel.items())])
    fits.terms.send_sync, fits.terms.send_sync_record = send_sync(
        [r for r in records if r.get("kind") == "send_sync"
         and all(r.get(k) == v for k, v in sel.items())])
    fits.terms.funcol_host, fits.terms.funcol_host_record = funcol_host(
        [r for r in records if r.get("kind") == "funcol_host"
         and all(r.get(k) == v for k, v in sel.items())])
    fits.terms.rank_spread, fits.terms.rank_spread_record = rank_spread(
        [r for r in records if r.get("kind") == "rank_spread"
         and all(r.get(k) == v for k, v in sel.items())])
    fits.terms.collective_sync_burst = collective_sync_burst(  # less what the spread charges
        [r for r in records if r.get("kind") == "collective_sync"
         and all(r.get(k) == v for k, v in sel.items())], fits.terms.rank_spread or 0.0)
    return fits


def _per_kernel(mem: list[dict[str, Any]], fit: CurveFit) -> dict[str, dict[str, float]]:
    """How far each kernel sits from the one shared curve (the schema has one per device).

    time_ratio > 1: the kernel runs slower than the curve predicts (on a CPU, GELU's erf
    and softmax's exp make them compute-bound; on a GPU all cluster near 1).
    """
    out: dict[str, dict[str, float]] = {}
    for kernel in sorted({r["kernel"] for r in mem}):
        rs = [r for r in mem if r["kernel"] == kernel]
        out[kernel] = {
            "median_GBps": _sig(statistics.median(r["bytes"] / r["time_s"] / 1e9 for r in rs)),
            "time_ratio": _sig(statistics.median(r["time_s"] / fit.predict_time(r["bytes"])
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
            out[other] = _sig(best * statistics.median(ratios))
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


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


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
        return {"bandwidth_GBps": base_bw, "latency_us": _sig(fit.alpha_s * 1e6),
                "efficiency": _sig(busbw / base_bw)}
    return {"bandwidth_GBps": _sig(busbw), "latency_us": _sig(fit.alpha_s * 1e6), "efficiency": 1.0}


def _link_fit(fits: Fits, link: str) -> AlphaBetaFit | None:
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        if link in fits.collectives.get(op, {}):
            return fits.collectives[op][link]
    return None


def build_profile(fits: Fits, base: HardwareProfile, *, name: str, device: str,
                  device_name: str, gpus_per_node: int, memory_GB: float | None,
                  provenance: dict[str, Any], datasheet: bool) -> dict[str, Any]:
    """The profile as a plain dict (measured parts over the base preset's)."""
    prof = base.model_dump(mode="json")
    gpu = prof["gpu"]
    gpu["name"] = device_name
    not_measured: list[str] = []
    if fits.gemm:
        gpu["peak_tflops"] = fits.peak_tflops
        gpu["gemm_efficiency"] = {"points": [list(p) for p in fits.gemm.points]}
        gpu["kernel_overhead_us"] = 0.0  # without an overhead fit it is inside the curves
    else:
        not_measured += ["gpu.peak_tflops", "gpu.gemm_efficiency"]
    if fits.attention:
        gpu["attention_efficiency"] = {"points": [list(p) for p in fits.attention.points]}
    else:
        not_measured.append("gpu.attention_efficiency")
    if fits.memory and fits.hbm_GBps:
        gpu["hbm_bandwidth_GBps"] = fits.hbm_GBps
        gpu["memory_efficiency"] = {"points": [list(p) for p in fits.memory.points]}
    else:
        not_measured += ["gpu.hbm_bandwidth_GBps", "gpu.memory_efficiency"]
    if memory_GB:
        gpu["memory_GB"] = _sig(memory_GB)
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
        op: {link: {"alpha_us": _sig(f.alpha_s * 1e6), "busbw_GBps": _sig(f.busbw_Bps / 1e9),
                    "samples": f.n_train + f.n_holdout,
                    "median_rel_error": _round(f.holdout_error if f.holdout_error is not None
                                               else f.train_error)}
             for link, f in by_link.items()}
        for op, by_link in fits.collectives.items() if op in COLLECTIVE_OPS}
    not_measured.append("host")
    prof["name"] = name
    kind = "CPU process" if device == "cpu" else "GPU"
    prof["description"] = f"calibrated on {device_name} ({kind}) by clustersim calibrate"
    prof["provenance"] = {
        **provenance,
        "terms": terms,
        "base_preset": base.name,
        "not_measured": not_measured,
        "peak_source": fits.peak_source or None,
        "hbm_source": fits.hbm_source or None,
        "fit": {
            "gemm": _curve_summary(fits.gemm),
            "attention": _curve_summary(fits.attention),
            "memory": ({**summary, "per_kernel": fits.memory_kernels}
                       if (summary := _curve_summary(fits.memory)) else None),
            "kernel_overhead": {k: {"intercept_us": _sig(f.intercept_s * 1e6),
                                    "GBps": _sig(1 / f.slope_s / 1e9) if f.slope_s else None,
                                    "samples": f.n, "median_rel_error": _round(f.median_rel_error),
                                    "intercept_rel_se": _round(f.intercept_rel_se)}
                                for k, f in fits.overhead.items()},
            "classes": {cls: _curve_summary(f) for cls, f in fits.terms.classes.items()},
            "interference": fits.terms.interference_record and {
                k: fits.terms.interference_record.get(k)
                for k in ("factor", "round_ratios", "alone_s", "overlapped_s", "covered",
                          "bytes")},
            "collective_sync": fits.terms.collective_sync_record and {
                k: fits.terms.collective_sync_record.get(k)
                for k in ("burst_s", "gemms", "iterations", "sizes")},
            "send_sync": fits.terms.send_sync_record and {
                k: fits.terms.send_sync_record.get(k)
                for k in ("burst_s", "gemms", "iterations", "sizes")},
            "funcol_host": fits.terms.funcol_host_record and {
                k: fits.terms.funcol_host_record.get(k)
                for k in ("iterations", "sizes", "hidden", "clock")},
            "rank_spread": fits.terms.rank_spread_record and {
                k: fits.terms.rank_spread_record.get(k)
                for k in ("burst_s", "gemms", "iterations")},
            "collectives_holdout_median_rel_error": _round(_pooled_holdout_error(fits)),
            "collectives": {op: {link: {"n_train": f.n_train, "n_holdout": f.n_holdout,
                                        "train_median_rel_error": _round(f.train_error),
                                        "holdout_median_rel_error": _round(f.holdout_error)}
                                 for link, f in by_link.items()}
                            for op, by_link in fits.collectives.items()},
        },
    }
    return prof


def _terms_into(gpu: dict[str, Any], prof: dict[str, Any], fits: Fits, base: HardwareProfile,
                not_measured: list[str]) -> dict[str, dict[str, Any]]:
    """Overhead, class curves, interference, the sync costs and the spreads over the
    base's; returns each term's source for ``provenance.terms``."""
    from calibration.microbench.fit_terms import term_sources

    if fits.overhead:
        gpu["kernel_overhead_us"] = _sig(fits.terms.overhead_s * 1e6)
    else:
        not_measured.append("gpu.kernel_overhead_us")
    gpu["class_efficiency"] = {**gpu.get("class_efficiency", {}),
                               **{cls: {"points": [list(p) for p in f.points]}
                                  for cls, f in fits.terms.classes.items()}}
    gpu["interference"] = {**gpu.get("interference", {}),
                           **{k: _sig(v) for k, v in fits.terms.interference.items()}}
    gpu["collective_sync_us"] = {**gpu.get("collective_sync_us", {}),
                                 **{k: _sig(v * 1e6) for k, v in
                                    fits.terms.collective_sync.items()}}
    if fits.terms.collective_sync_curve:  # by size: the simulator reads it at each size
        gpu["collective_sync_curve"] = {
            **gpu.get("collective_sync_curve", {}),
            **{k: {"points": [[b, _sig(t * 1e6)] for b, t in pts]}
               for k, pts in fits.terms.collective_sync_curve.items()}}
    else:  # a figure alone: no curve of an earlier profile outlives it
        for k in fits.terms.collective_sync:
            gpu.get("collective_sync_curve", {}).pop(k, None)
    for k in fits.terms.collective_sync:  # its growth by burst, where measured, else none
        gpu.setdefault("collective_sync_burst", {}).pop(k, None)
    for k, pts in fits.terms.collective_sync_burst.items():
        gpu["collective_sync_burst"][k] = {"points": [[_sig(b), _sig(t * 1e6)]
                                                      for b, t in pts]}
    if not gpu.get("collective_sync_burst"):
        gpu.pop("collective_sync_burst", None)
    gpu["send_sync_us"] = {**gpu.get("send_sync_us", {}),
                           **{k: _sig(v * 1e6) for k, v in fits.terms.send_sync.items()}}
    if fits.terms.funcol_host:  # by kind; the base's older one figure does not outlive it
        gpu["funcol_host"] = {**gpu.get("funcol_host", {}),
                              **{k: {"us": _sig(a * 1e6), "us_per_mib": _sig(b * 1e6 * (1 << 20))}
                                 for k, (a, b) in fits.terms.funcol_host.items()}}
        gpu.pop("funcol_sync_us", None)
    if fits.terms.rank_spread is not None:
        gpu["rank_spread"] = _sig(fits.terms.rank_spread)
    terms, spread = term_sources(fits, base.name)
    prof["uncertainty"] = {**prof.get("uncertainty", {}), **spread}
    return terms


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
