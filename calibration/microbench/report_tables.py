"""Plain-text tables: collectives in nccl-tests' columns, and the fit-error summary.

algbw = S / t and busbw = algbw × factor(op, n), exactly as nccl-tests
(``doc/PERFORMANCE.md``) defines them, so a user can hold this table next to an
``all_reduce_perf`` run. The fitted time and its relative error sit beside each
measured size; held-out sizes are marked ``*``.
"""

from __future__ import annotations

from typing import Any

from calibration.microbench.fit import AlphaBetaFit, Sample, busbw_factor


def collective_table(samples: dict[str, dict[str, list[Sample]]],
                     fits: dict[str, dict[str, AlphaBetaFit]]) -> str:
    lines: list[str] = []
    for op in sorted(samples):
        for link in sorted(samples[op]):
            fit = fits.get(op, {}).get(link)
            for n in sorted({s.n for s in samples[op][link]}):
                rows = sorted((s for s in samples[op][link] if s.n == n), key=lambda s: s.size)
                lines.append(f"# {op}, {n} ranks, {link}"
                             + (f": fit alpha {fit.alpha_s * 1e6:.3g} us/step, busbw "
                                f"{fit.busbw_Bps / 1e9:.4g} GB/s" if fit else ""))
                lines.append(f"# {'size':>12} {'count':>12} {'type':>6} {'time':>10} {'algbw':>8} "
                             f"{'busbw':>8} {'fit':>10} {'err':>7}")
                lines.append(f"# {'(B)':>12} {'(elements)':>12} {'':>6} {'(us)':>10} {'(GB/s)':>8} "
                             f"{'(GB/s)':>8} {'(us)':>10} {'':>7}")
                for s in rows:
                    alg = s.size / s.time_s / 1e9
                    bus = alg * busbw_factor(op, n)
                    pred = fit.predict(op, n, s.size) if fit else float("nan")
                    held = "*" if fit and (n, s.size) in fit.holdout_keys else " "
                    err = abs(pred - s.time_s) / s.time_s
                    lines.append(f"  {int(s.size):>12} {int(s.size) // 4:>12} {'float':>6} "
                                 f"{s.time_s * 1e6:>10.2f} {alg:>8.3f} {bus:>8.3f} "
                                 f"{pred * 1e6:>10.2f} {err:>6.1%}{held}")
    lines.append("# * held out of the fit")
    return "\n".join(lines)


def fit_error_markdown(profile: dict[str, Any]) -> str:
    """The provenance's fit residuals as a markdown table."""
    prov = profile.get("provenance", {})
    fit = prov.get("fit", {})
    out = ["| fit | samples | train median rel. error | held-out median rel. error | fitted |",
           "| --- | ---: | ---: | ---: | --- |"]
    gpu = profile.get("gpu", {})
    fitted = {"gemm": f"peak {gpu.get('peak_tflops')} TFLOP/s",
              "attention": "same peak", "memory": f"{gpu.get('hbm_bandwidth_GBps')} GB/s"}
    for name in ("gemm", "attention", "memory"):
        row = fit.get(name)
        if row:
            out.append(f"| {name} | {row['samples']} | {_pct(row['train_median_rel_error'])} | "
                       f"{_pct(row['holdout_median_rel_error'])} | {fitted[name]} |")
    colls = profile.get("collectives", {})
    for op, by_link in fit.get("collectives", {}).items():
        for link, row in by_link.items():
            ab = colls.get(op, {}).get(link, {})
            out.append(f"| {op} ({link}) | {row['n_train'] + row['n_holdout']} | "
                       f"{_pct(row['train_median_rel_error'])} | "
                       f"{_pct(row['holdout_median_rel_error'])} | "
                       f"alpha {ab.get('alpha_us')} us, busbw {ab.get('busbw_GBps')} GB/s |")
    return "\n".join(out) + "\n"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"
