"""Plain-text tables: collectives in nccl-tests' columns, the fit-error summary, each
term's source and spread, and the calibration's closing summary.

algbw = S / t and busbw = algbw × factor(op, n), exactly as nccl-tests
(``doc/PERFORMANCE.md``) defines them, so a user can hold this table next to an
``all_reduce_perf`` run. The fitted time and its relative error sit beside each
measured size; held-out sizes are marked ``*``.
"""

from __future__ import annotations

from typing import Any

from calibration.microbench.dist import human
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
    for cls, row in (fit.get("classes") or {}).items():
        if row:
            out.append(f"| class {cls} | {row['samples']} | "
                       f"{_pct(row['train_median_rel_error'])} | "
                       f"{_pct(row['holdout_median_rel_error'])} | own curve, same peak |")
    for kernel, row in (fit.get("kernel_overhead") or {}).items():
        out.append(f"| overhead ({kernel}) | {row['samples']} | "
                   f"{_pct(row['median_rel_error'])} | n/a | intercept {row['intercept_us']} us |")
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


def terms_markdown(profile: dict[str, Any]) -> str:
    """Each cost term: measured or preset, its samples and relative spread; and the
    busy-machine guard's figures (with its warning when it fired)."""
    prov = profile.get("provenance", {})
    out = ["| term | source | samples | relative std |", "| --- | --- | ---: | ---: |"]
    for term, row in (prov.get("terms") or {}).items():
        src = row.get("source", "?") + (f" ({row['from']})" if row.get("from") else "")
        sigma = row.get("rel_std")
        out.append(f"| {term} | {src} | {row.get('samples', '')} | "
                   f"{'' if sigma is None else _pct(sigma)} |")
    guard = prov.get("busy_guard")
    if guard:
        out += ["", f"Reference GEMM: {_readings(guard)}; median repeat spread "
                f"{_pct(guard.get('median_repeat_spread'))} (limit "
                f"{_pct(guard.get('spread_limit'))}); steal {_pct(guard.get('steal'))} (limit "
                f"{_pct(guard.get('steal_limit'))}); re-measures {guard.get('retries', 0)}."]
        if guard.get("warning"):
            out += ["", f"**{guard['warning']}**"]
    return "\n".join(out) + "\n"


def summary_text(profile: dict[str, Any], failed: list[dict[str, Any]], elapsed: float) -> str:
    """What ``calibrate`` prints when it has written the profile."""
    gpu = profile["gpu"]
    intra = profile["intra_node"]
    lines = [f"profile {profile['name']}: peak {gpu['peak_tflops']} TFLOP/s, "
             f"HBM {gpu['hbm_bandwidth_GBps']} GB/s, intra-node {intra['bandwidth_GBps']} GB/s "
             f"x {intra['efficiency']}, alpha {intra['latency_us']} us ({elapsed:.0f} s)"]
    lines += _curve_lines(gpu, profile["provenance"]["fit"])
    lines += _term_lines(gpu)
    for op, by_link in profile.get("collectives", {}).items():
        for link, ab in by_link.items():
            lines.append(f"  {op} {link}: alpha {ab['alpha_us']} us, busbw {ab['busbw_GBps']} "
                         f"GB/s, held-out median error {_pct(ab['median_rel_error'])}")
    spread = profile.get("uncertainty") or {}
    if spread:
        lines.append("  relative spread: " + ", ".join(f"{k} {v:.1%}" for k, v in spread.items()))
    preset = [t for t, r in (profile["provenance"].get("terms") or {}).items()
              if r.get("source") == "preset"]
    if preset:
        lines.append(f"  from the base preset (not measured): {', '.join(preset)}")
    if failed:
        lines.append(f"  {len(failed)} measurement(s) failed and were skipped, e.g. "
                     f"{failed[0]['key']}: {failed[0].get('error')}")
    guard = profile["provenance"].get("busy_guard") or {}
    if guard:
        lines.append(f"  reference GEMM: {_readings(guard)}")
    if guard.get("warning"):
        lines.append(guard["warning"])
    return "\n".join(lines)


def _readings(guard: dict[str, Any]) -> str:
    """The reference GEMM's readings (at the start and after each phase) and their drift."""
    readings = guard.get("reference_ms") or {"start": guard.get("reference_start_ms"),
                                              "end": guard.get("reference_end_ms")}
    return (", ".join(f"{phase} {ms} ms" for phase, ms in readings.items())
            + f" (drift {_pct(guard.get('drift'))}, limit {_pct(guard.get('drift_limit'))})")


def _curve_lines(gpu: dict[str, Any], fit: dict[str, Any]) -> list[str]:
    """The summary's lines on the curves: held-out errors, the overhead, the classes."""
    lines = []
    for part in ("gemm", "attention", "memory"):
        if fit.get(part):
            lines.append(f"  {part}: held-out median error "
                         f"{_pct(fit[part]['holdout_median_rel_error'])} "
                         f"({fit[part]['samples']} samples)")
    if fit.get("kernel_overhead"):
        lines.append(f"  kernel overhead: {gpu['kernel_overhead_us']} us per kernel (intercepts "
                     + ", ".join(f"{k} {r['intercept_us']} us" for k, r in
                                 fit["kernel_overhead"].items()) + ")")
    classes = fit.get("classes") or {}
    if classes:
        lines.append("  class curves: " + ", ".join(
            f"{c} {_pct(r['holdout_median_rel_error'])}" for c, r in classes.items() if r)
            + " (held-out median error)")
    return lines


def _term_lines(gpu: dict[str, Any]) -> list[str]:
    """The summary's lines on the two-rank terms, as the profile states them."""
    lines = []
    for link, factor in (gpu.get("interference") or {}).items():
        lines.append(f"  interference ({link}): compute x{factor} while a collective overlaps it")
    lines += _sync_lines(gpu)
    for link, us in (gpu.get("send_sync_us") or {}).items():
        lines.append(f"  send sync ({link}): {us} us per point-to-point send after compute, "
                     "beyond back to back")
    for link, us in (gpu.get("funcol_sync_us") or {}).items():
        lines.append(f"  funcol sync ({link}): {us} us per DTensor redistribution after compute, "
                     "beyond a plain collective")
    for kind, line in (gpu.get("funcol_host") or {}).items():
        lines.append(f"  funcol host ({kind}): {line.get('us')} us + {line.get('us_per_mib', 0)} "
                     "us/MiB of host time per DTensor redistribution beyond a plain collective")
    if gpu.get("rank_spread"):
        lines.append(f"  rank spread: {gpu['rank_spread']} (relative spread of a rank's compute "
                     "time; each synchronisation waits for the slowest)")
    if gpu.get("rank_excess"):  # the base preset's, kept where no spread was measured
        points = ", ".join(f"{n:g}: +{x:.2%}" for n, x in gpu["rank_excess"]["points"])
        lines.append(f"  rank excess (the base's GPU population): the slowest of n {points}")
    return lines


def _sync_lines(gpu: dict[str, Any]) -> list[str]:
    """The collective sync cost per link class: its figure, by size and by burst."""
    lines = []
    curves = gpu.get("collective_sync_curve") or {}
    for link, us in (gpu.get("collective_sync_us") or {}).items():
        by_size = ", ".join(f"{human(b)} {t:g}" for b, t in
                            (curves.get(link) or {}).get("points", []))
        lines.append(f"  collective sync ({link}): {us} us per collective after compute, "
                     "beyond back to back" + (f" (by size, us: {by_size})" if by_size else ""))
        grown = ", ".join(f"{b * 1e3:g} ms {t:+g}" for b, t in
                          ((gpu.get("collective_sync_burst") or {}).get(link) or {})
                          .get("points", []))
        if grown:
            lines.append(f"  collective sync ({link}) by the compute before it, us: {grown}")
    return lines
