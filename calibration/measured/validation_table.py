"""The validation table: one markdown table per model (its header the machine, the
profile and the runs; a row per configuration; a closing summary of the mean and largest
|step error|, the runs' repeatability and the rows measured under steal), and the rows
as CSV, both written atomically.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from calibration.host import STEAL_LIMIT

COLUMNS = ("model", "config", "tp", "pp", "dp", "schedule", "zero", "measured_ms", "simulated_ms",
           "step_error", "runs", "repeat", "compute_error", "idle_measured", "idle_simulated",
           "cpu_steal", "note")


def _fmt(row: dict[str, Any], key: str) -> str:
    v = row.get(key)
    if v is None:
        return "–"
    if key.endswith("_ms"):
        return f"{v:.1f}"
    if key.endswith("error"):
        return f"{v:+.1%}"
    if key.startswith("idle") or key in ("cpu_steal", "repeat"):
        return f"{v:.0%}"
    return str(v)


def summary(rows: list[dict[str, Any]]) -> str:
    """Mean and largest |step error| over the rows that ran, against the 10% / 5% target."""
    errs = [(abs(r["step_error"]), r["config"]) for r in rows if r.get("step_error") is not None]
    if not errs:
        return "No configuration ran."
    mean = sum(e for e, _ in errs) / len(errs)
    worst, name = max(errs)
    over = sum(e > 0.10 for e, _ in errs)
    return (f"Mean |step error| {mean:.1%} over {len(errs)} rows (target 5%: "
            f"{'met' if mean <= 0.05 else 'missed'}); largest {worst:.1%} ({name}); "
            f"{over} row(s) over 10%." + repeatability_sentence(rows) + stolen_summary(rows))


def repeatability_sentence(rows: list[dict[str, Any]]) -> str:
    """The sentence on how far a row's runs lay apart (``repeat``), on average and at
    most: the measurement's own repeatability. With two runs a row, a simulator without
    error would read a mean |step error| of about half that: for two runs' levels
    t(1 + e1) and t(1 + e2) with e1, e2 independent and alike symmetric about 0, e1 + e2
    has the distribution of e1 - e2, so the mean |(e1 + e2) / 2| that the pooled figure
    misses by is half the mean gap |e1 - e2| (the drift since the calibration comes on
    top)."""
    got = [(r["repeat"], r.get("runs")) for r in rows
           if r.get("repeat") is not None and r.get("step_error") is not None]
    if not got:
        return ""
    mean = sum(g for g, _ in got) / len(got)
    text = (f" The runs of a row lay {mean:.1%} apart on average (largest "
            f"{max(g for g, _ in got):.0%}): the measurement's own repeatability")
    if all(n == 2 for _, n in got):
        text += (f"; from it alone a simulator without error would read a mean |step "
                 f"error| of about {mean / 2:.1%}, more with the machine's drift since "
                 "the calibration")
    return text + "."


def stolen_summary(rows: list[dict[str, Any]]) -> str:
    """The sentence on rows measured while a hypervisor took over STEAL_LIMIT of the
    CPU."""
    stolen = [r["cpu_steal"] for r in rows if (r.get("cpu_steal") or 0.0) > STEAL_LIMIT]
    if not stolen:
        return ""
    low, high = f"{min(stolen):.0%}", f"{max(stolen):.0%}"
    share = low if low == high else f"{low}–{high}"
    return (f" {len(stolen)} row(s) ran while the hypervisor took {share} of the CPU "
            f"(steal, limit {STEAL_LIMIT:.0%}): their times "
            "include waits for the CPU that the simulation knows of only as far as the "
            "calibration ran under the same steal (its share is in the header).")


def _calibration_steal(steal: float | None) -> str:
    return "" if steal is None else f" (calibrated with {steal:.0%} steal)"


def _section(rows: list[dict[str, Any]], header: dict[str, Any], model: str) -> list[str]:
    steps = header["steps"]
    steps = steps.get(model) if isinstance(steps, dict) else steps
    lines = [f"Validation on {header['device_name']} ({header['device']}, {header['threads']} "
             f"thread(s) per process), torch {header['torch']}, profile `{header['profile']}`"
             f"{_calibration_steal(header.get('calibration_steal'))}, "
             f"{header['date']}; model {model}, {header['micro_batches']} "
             f"micro-batches of {header['micro_batch_size']}, {_runs(header.get('repeats'))}"
             f"{steps} steps{_spanning(header.get('min_seconds'))}.", "",
             "| config | measured ms | simulated ms | step error | runs | repeat | "
             "compute error | idle measured | idle simulated | steal | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    keys = ("measured_ms", "simulated_ms", "step_error", "runs", "repeat", "compute_error",
            "idle_measured", "idle_simulated", "cpu_steal")
    for row in rows:
        cells = [row["config"], *(_fmt(row, k) for k in keys), row.get("note", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, "", summary(rows)]


def _runs(n: int | None) -> str:
    return ("median of " if not n or n == 1 else
            f"{n} runs back to back, the median of their pooled steps; each of ")


def _spanning(seconds: float | None) -> str:
    return f" or more, spanning at least {seconds:g} s" if seconds else ""


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """One table per model (rows without a model are ``header['model']``'s), each with
    its mean and largest |step error|."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_model.setdefault(row.get("model") or header["model"], []).append(row)
    sections = [_section(r, header, m) for m, r in by_model.items()] or \
        [_section([], header, header["model"])]
    if header.get("recheck"):  # the machine after the last row (calibration/measured/recheck)
        sections.append([header["recheck"]])
    return "\n\n".join("\n".join(sec) for sec in sections) + "\n"


def write_table(out: Path, rows: list[dict[str, Any]], header: dict[str, Any]) -> list[Path]:
    from simulator.outputs.trace_export import atomic_output

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    paths = [out / "validation.csv", out / "validation.md"]
    for path, text in zip(paths, (buf.getvalue(), markdown(rows, header)), strict=True):
        with atomic_output(path) as tmp:
            tmp.write_text(text)
    return paths
