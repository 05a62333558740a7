"""Two runs side by side: ``clustersim diff RUN_A RUN_B``.

Reads the ``results.json`` of two run directories — any two: different
scenarios, different methods (engine or analytic), different versions of a
scenario — and sets side by side, each as ``{"a", "b", "delta"}`` with
``delta = b − a``:

- the step time, peak memory per GPU and a few rates (:data:`SCALARS`);
- every category of the step breakdown (``step_breakdown_s``: the mean over
  simulated ranks of the disjoint partition of the step, in the vocabulary of
  :mod:`simulator.analysis.accounting`), and of the critical path where both runs have one.

Each run's breakdown sums to its step time, so the category deltas sum to the
step-time delta: the waterfall (:func:`waterfall`) walks from A's step time to
B's through them, and its end is B's step time to rounding. A category a run
does not have (a category added after it was written) counts as zero there.

Nothing here simulates: a diff reads files only, so it works on runs made
elsewhere or long ago, provided they carry a breakdown.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from simulator.analysis.accounting.vocabulary import CATEGORIES, label
from simulator.errors import Problem, UserError
from simulator.loading import local_path, read_json
from simulator.outputs.trace_export import atomic_output

#: Scalars compared besides the categories, with their display names.
SCALARS: Mapping[str, str] = {
    "step_time_s": "step time",
    "memory_peak_bytes": "peak memory per GPU",
    "tokens_per_s": "tokens/s",
    "mfu": "MFU",
    "bubble_fraction": "bubble fraction",
}


NOISE = 1e-12  # relative to the step: smaller category deltas are rounding


@dataclass(frozen=True)
class Bar:
    """One bar of the waterfall: from ``start`` to ``end`` seconds."""

    label: str
    start: float
    end: float
    total: bool  # a run's whole step (from zero), not a change


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


class _Results(BaseModel):
    """What a diff reads of ``results.json``; other fields pass through unchecked."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    step_time_s: float
    step_breakdown_s: dict[str, float]
    critical_path_s: dict[str, float] | None = None
    scenario: dict[str, Any] | None = None
    method: str | None = None
    fidelity: str | None = None
    memory_peak_bytes: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    bubble_fraction: float | None = None
    tables: dict[str, str] | None = None  # the per-rank tables' files (not diffed)


def load_run(run_dir: Path, which: str) -> dict[str, Any]:
    """A run directory's ``results.json`` (read by the bounded reader, its fields typed),
    or a one-line :class:`UserError` naming it."""
    run_dir = local_path(run_dir, which)
    path = run_dir / "results.json"
    hint = "give a directory written by `clustersim run SCENARIO --out DIR`"
    if not run_dir.is_dir():
        raise UserError([Problem(which, str(run_dir), f"is not a directory; {hint}")])
    if not path.exists():
        raise UserError([Problem(which, str(run_dir), f"has no results.json; {hint}")])
    data = read_json(path, which)
    if not isinstance(data, dict) or not _number(data.get("step_time_s")):
        raise UserError([Problem(which, str(path), "has no step_time_s; re-run the scenario "
                                 "to write it again")])
    breakdown = data.get("step_breakdown_s")
    if not isinstance(breakdown, dict) or not all(_number(v) for v in breakdown.values()):
        raise UserError([Problem(which, str(path), "has no step_breakdown_s (written before "
                                 "the time breakdown existed); re-run the scenario")])
    try:
        _Results.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise UserError([Problem(which, str(path), f"field {loc}: {err['msg']}; re-run the "
                                 "scenario to write it again")]) from None
    return data


def _triple(a: float, b: float) -> dict[str, float]:
    return {"a": a, "b": b, "delta": b - a}


def _by_category(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Every category of either side, in :data:`CATEGORIES` order, then any others."""
    names = [*CATEGORIES, *sorted((set(a) | set(b)) - set(CATEGORIES))]
    return {n: _triple(float(a.get(n, 0.0)), float(b.get(n, 0.0))) for n in names}


def _describe(results: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    scenario = results.get("scenario") or {}
    return {"dir": str(run_dir), "scenario": scenario.get("name"),
            "method": results.get("method"), "fidelity": results.get("fidelity")}


def run_diff(a: Mapping[str, Any], b: Mapping[str, Any], dir_a: Path = Path("A"),
             dir_b: Path = Path("B")) -> dict[str, Any]:
    """The ``diff.json`` dict of two results dicts (``load_run``'s)."""
    out: dict[str, Any] = {"runs": {"a": _describe(a, dir_a), "b": _describe(b, dir_b)}}
    for key in SCALARS:
        if _number(a.get(key)) and _number(b.get(key)):
            out[key] = _triple(float(a[key]), float(b[key]))
    out["categories"] = _by_category(a["step_breakdown_s"], b["step_breakdown_s"])
    paths = a.get("critical_path_s"), b.get("critical_path_s")
    if all(isinstance(p, dict) for p in paths):
        out["critical_path"] = _by_category(*paths)  # type: ignore[arg-type]
    return out


def _noise(diff: Mapping[str, Any]) -> float:
    """Deltas below this are rounding (a breakdown sums to its step within 1e-9)."""
    step = diff["step_time_s"]
    return NOISE * max(abs(step["a"]), abs(step["b"]))


def waterfall(diff: Mapping[str, Any]) -> list[Bar]:
    """A's step, each category that changed (in category order), then B's step."""
    a, b = diff["step_time_s"]["a"], diff["step_time_s"]["b"]
    bars = [Bar("A", 0.0, a, True)]
    level = a
    for name, row in diff["categories"].items():
        if abs(row["delta"]) > _noise(diff):
            bars.append(Bar(label(name), level, level + row["delta"], False))
            level += row["delta"]
    bars.append(Bar("B", 0.0, b, True))
    return bars


def _seconds_unit(t: float) -> tuple[float, str]:
    if t >= 1.0:
        return 1.0, "s"
    return (1e3, "ms") if t >= 1e-3 else (1e6, "µs")


def _fmt(key: str, value: float, unit: tuple[float, str], signed: bool = False) -> str:
    sign = "+" if signed else ""
    if key == "memory_peak_bytes":
        return f"{value / 1e9:{sign}.2f} GB"
    if key in ("mfu", "bubble_fraction"):
        # a difference of two percentages is in percentage points, not percent
        return f"{100 * value:+.2f} pp" if signed else f"{value:.2%}"
    if key == "tokens_per_s":
        return f"{value:{sign},.0f}"
    return f"{value * unit[0]:{sign}#.4g} {unit[1]}"


def diff_lines(diff: Mapping[str, Any]) -> list[str]:
    """The printed table: scalars, then every category either run spends time in."""
    runs = diff["runs"]
    head = [f"A: {runs['a']['dir']} ({runs['a']['scenario']}, {runs['a']['method']})",
            f"B: {runs['b']['dir']} ({runs['b']['scenario']}, {runs['b']['method']})"]
    unit = _seconds_unit(max(diff["step_time_s"]["a"], diff["step_time_s"]["b"]))
    rows: list[tuple[str, str, str, str]] = []
    for key, name in SCALARS.items():
        if key in diff:
            r = diff[key]
            rows.append((name, _fmt(key, r["a"], unit), _fmt(key, r["b"], unit),
                         _fmt(key, r["delta"], unit, signed=True)))
    rows.append(("step breakdown (mean over ranks)", "", "", ""))
    zero = 0
    for name, r in diff["categories"].items():
        if r["a"] == 0.0 and r["b"] == 0.0:
            zero += 1
            continue
        delta = r["delta"] if abs(r["delta"]) > _noise(diff) else 0.0
        rows.append((f"  {label(name)}", _fmt(name, r["a"], unit), _fmt(name, r["b"], unit),
                     _fmt(name, delta, unit, signed=True)))
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    w = [max(w[0], 10), max(w[1], 10), max(w[2], 10), max(w[3], 10)]
    lines = [*head, f"{'':<{w[0]}}  {'A':>{w[1]}}  {'B':>{w[2]}}  {'B − A':>{w[3]}}"]
    lines += [f"{n:<{w[0]}}  {x:>{w[1]}}  {y:>{w[2]}}  {d:>{w[3]}}".rstrip()
              for n, x, y, d in rows]
    if zero:
        lines.append(f"  ({zero} categories are zero in both runs; all are in diff.json)")
    return lines


def write_diff(out_dir: Path, diff: Mapping[str, Any], plot: bool = True) -> list[Path]:
    """``diff.json`` and ``diff.png`` in ``out_dir``, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "diff.json"
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(diff, indent=2, allow_nan=False) + "\n")
    written = [path]
    if plot:
        from simulator.outputs.plots.diff import plot_waterfall

        written.append(plot_waterfall(diff, waterfall(diff), out_dir / "diff.png"))
    return written
