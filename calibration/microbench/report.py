"""``clustersim calibrate report PROFILE.yaml --out DIR``: how well the profile fits.

Reads a calibrated profile and the measurements its provenance names (or the
nccl-tests files it was fitted from) and writes:

- ``gemm.png``, ``attention.png``, ``memory.png``: achieved / peak against
  problem size, measured points (held-out ones marked) and the fitted curve;
- ``collectives.png``: busbw against message size per collective, measured and
  fitted (busbw(S) = S · factor / t(S) with the profile's α and busbw), one
  line per group size;
- ``fit_errors.md``: the fit residuals table, the collectives in nccl-tests'
  columns, and what failed.

Without the measurements (a profile copied alone) the fitted curves are still
drawn. Figures are drawn with matplotlib's object API on the Agg canvas, which
leaves any interactive backend (a notebook's) alone.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from calibration.microbench.fit import (
    HOLDOUT_EVERY,
    Sample,
    busbw_factor,
    collective_steps,
    holdout_mask,
    net_time,
)
from simulator.errors import Problem, UserError


def write_report(profile_path: Path, out_dir: Path, results: Path | None = None) -> list[Path]:
    profile = _load_profile(profile_path)
    records = _records(profile, profile_path, results)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError([Problem("--out", str(out_dir),
                                 f"cannot create it ({exc.strerror})")]) from None
    prov = profile.get("provenance", {})
    sel = {"device": prov.get("device"), "threads": prov.get("threads")}
    dtype = prov.get("dtype")
    gpu = profile["gpu"]
    peak = gpu["peak_tflops"].get(dtype, max(gpu["peak_tflops"].values())) * 1e12
    written = []
    for part, size_key, denom, label in (
            ("gemm", "flops", peak, "FLOPs per GEMM"),
            ("attention", "flops", peak, "FLOPs per attention call"),
            ("memory", "bytes", gpu["hbm_bandwidth_GBps"] * 1e9, "bytes moved per kernel")):
        recs = _best([r for r in records if r.get("kind") == part and r.get("ok")
                      and r.get("dtype") == dtype and all(r.get(k) == v for k, v in sel.items())])
        curve = gpu[f"{part if part != 'memory' else 'memory'}_efficiency"]["points"]
        path = out_dir / f"{part}.png"
        _efficiency_plot(path, part, recs, size_key, denom, curve, label,
                         (prov.get("fit") or {}).get(part),
                         float(gpu.get("kernel_overhead_us", 0.0)) * 1e-6)
        written.append(path)
    samples = _collective_samples(records, prov, sel)
    path = out_dir / "collectives.png"
    _collectives_plot(path, samples, profile.get("collectives", {}))
    written.append(path)
    md = out_dir / "fit_errors.md"
    md.write_text(_markdown(profile, profile_path, samples, records), encoding="utf-8")
    written.append(md)
    return written


def _load_profile(path: Path) -> dict[str, Any]:
    from pydantic import ValidationError

    from simulator.loading import read_yaml
    from simulator.system.hardware import HardwareProfile

    data = read_yaml(path, "PROFILE.yaml")
    try:
        HardwareProfile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise UserError([Problem("PROFILE.yaml", str(path),
                                 f"not a valid hardware profile: {loc}: {first['msg']}")]) from None
    assert isinstance(data, dict)
    return data


def _best(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fastest reading per key, as the fitter uses them."""
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["key"] not in best or r["time_s"] < best[r["key"]]["time_s"]:
            best[r["key"]] = r
    return list(best.values())


def _records(profile: dict[str, Any], profile_path: Path,
             results: Path | None) -> list[dict[str, Any]]:
    from calibration.microbench.bench_results import read_records

    if results is None:
        name = profile.get("provenance", {}).get("results_file")
        if not name:
            return []
        results = profile_path.parent / name
        if not results.is_file():
            print(f"warning: results file {results} not found; plotting the fitted curves only",
                  file=sys.stderr)
            return []
    elif not results.is_file():
        raise UserError([Problem("--results", str(results), "no such file")])
    return read_records(results)


def _collective_samples(records: list[dict[str, Any]], prov: dict[str, Any],
                        sel: dict[str, Any]) -> dict[str, dict[str, list[Sample]]]:
    from calibration.microbench.fit_profile import samples_from_records

    files = prov.get("nccl_tests_files") or []
    if not files:
        return samples_from_records(records, sel["device"], sel["threads"])
    from calibration.microbench import nccl_tests

    out: dict[str, dict[str, list[Sample]]] = {}
    for entry in files:
        spec = entry.get("spec") if isinstance(entry, dict) else None
        if not spec:
            continue
        try:
            run = nccl_tests.load(spec)
        except UserError:
            print(f"warning: cannot re-read nccl-tests file {spec}", file=sys.stderr)
            continue
        out.setdefault(run.op, {}).setdefault(run.link, []).extend(run.samples())
    return out


def _figure(width: float = 6.4, height: float = 4.4) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _efficiency_plot(path: Path, part: str, recs: list[dict[str, Any]], size_key: str,
                     denom: float, curve: list[list[float]], xlabel: str,
                     fit: dict[str, Any] | None, overhead_s: float = 0.0) -> None:
    """Measured efficiency (net of the per-kernel overhead, as the curve is fitted)
    against the fitted curve."""
    from simulator.system.curves import interpolate_log

    fig = _figure()
    ax = fig.add_subplot()
    recs = sorted(recs, key=lambda r: r[size_key])
    mask = holdout_mask(len(recs))
    groups: dict[str, list[tuple[float, float, bool]]] = {}
    for r, is_held in zip(recs, mask, strict=True):
        label = r.get("kernel", "measured") if part == "memory" else "measured"
        groups.setdefault(label, []).append(
            (r[size_key], r[size_key] / net_time(r["time_s"], overhead_s) / denom, is_held))
    for label, members in groups.items():
        train = [(x, y) for x, y, h in members if not h]
        held = [(x, y) for x, y, h in members if h]
        dots = ax.scatter([x for x, _ in train], [y for _, y in train], s=16, label=label)
        if held:
            ax.scatter([x for x, _ in held], [y for _, y in held], s=40, marker="x",
                       color=dots.get_facecolor()[0],
                       label=f"{label} (held out)" if part != "memory" else None)
    xs_all = [r[size_key] for r in recs] + [p[0] for p in curve]
    lo, hi = min(xs_all), max(xs_all)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)] if hi > lo else [lo]
    pts = [(float(a), float(b)) for a, b in curve]
    ax.plot(grid, [interpolate_log(pts, x) for x in grid], color="black", lw=1.5,
            label="fitted curve")
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="black", s=12, zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("achieved / peak")
    err = fit.get("holdout_median_rel_error") if fit else None
    ax.set_title(f"{part} efficiency" + (f" (held-out median time error {err:.1%})"
                                         if err is not None else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)


def _collectives_plot(path: Path, samples: dict[str, dict[str, list[Sample]]],
                      table: dict[str, dict[str, dict[str, Any]]]) -> None:
    ops = sorted(set(samples) | set(table))
    cols = max(1, min(3, len(ops)))
    rows = max(1, math.ceil(len(ops) / cols))
    fig = _figure(4.2 * cols, 3.4 * rows)
    if not ops:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no collectives measured", ha="center", va="center")
        ax.set_axis_off()
    for i, op in enumerate(ops, 1):
        ax = fig.add_subplot(rows, cols, i)
        for link in sorted(set(samples.get(op, {})) | set(table.get(op, {}))):
            ss = samples.get(op, {}).get(link, [])
            ab = table.get(op, {}).get(link)
            for n in sorted({s.n for s in ss}) or [2]:
                pts = sorted((s for s in ss if s.n == n), key=lambda s: s.size)
                label = f"{link} n={n}"
                line = None
                if pts:
                    line = ax.plot([s.size for s in pts],
                                   [s.size / s.time_s * busbw_factor(op, n) / 1e9 for s in pts],
                                   "o", ms=3, label=f"{label} measured")[0]
                if ab:
                    sizes = [s.size for s in pts] or [2.0**k for k in range(10, 31)]
                    fitted = [x * busbw_factor(op, n) / _predict(ab, op, n, x) / 1e9 for x in sizes]
                    ax.plot(sizes, fitted, "-", lw=1.2, label=f"{label} fitted",
                            color=line.get_color() if line else None)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(op, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


def _predict(ab: dict[str, Any], op: str, n: int, size: float) -> float:
    return (ab["alpha_us"] * 1e-6 * collective_steps(op, n)
            + size * busbw_factor(op, n) / (ab["busbw_GBps"] * 1e9))


def _markdown(profile: dict[str, Any], profile_path: Path,
              samples: dict[str, dict[str, list[Sample]]], records: list[dict[str, Any]]) -> str:
    from calibration.microbench.fit import fit_alpha_beta
    from calibration.microbench.report_tables import (
        collective_table,
        fit_error_markdown,
        terms_markdown,
    )

    prov = profile.get("provenance", {})
    out = [f"# Calibration report: {profile.get('name')}", "",
           f"Profile `{profile_path.name}`: {profile.get('description', '')}. Measured on "
           f"{prov.get('device_name', '?')} with torch {prov.get('torch', '?')} on "
           f"{prov.get('date', '?')} ({prov.get('level', '?')} level, {prov.get('threads', '?')} "
           f"thread(s) per process, {prov.get('nproc', '?')} process(es)).", "",
           f"Every {HOLDOUT_EVERY}th size (by size order) is held out of each fit; errors are "
           "median relative errors of predicted time.", "", fit_error_markdown(profile),
           "## Cost terms: source and spread", "", terms_markdown(profile)]
    if samples:
        fits = {op: {link: fit_alpha_beta(ss) for link, ss in by.items() if ss}
                for op, by in samples.items()}
        out += ["## Collectives (nccl-tests columns)", "", "```",
                collective_table(samples, fits), "```", ""]
    failed = [r for r in records if not r.get("ok")]
    if failed:
        out += ["## Failed measurements (recorded and skipped)", ""]
        out += [f"- `{r.get('key')}`: {r.get('error')}" for r in failed[:50]]
        out.append("")
    return "\n".join(out)
