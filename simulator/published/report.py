"""What ``clustersim validate-runs`` writes and prints: the per-row table
(``runs.csv``), the regime summary (``regimes.csv``), with ``--by-class`` the factor per
cost class (``classes.csv``, :mod:`simulator.published.classes`) and the attention kernels'
against the rest's (``split.csv``), weak scaling (``scaling.csv``,
:mod:`simulator.published.scaling`), a Markdown page with
them and the rows it could not express (``runs.md``), the numbers of the run
(``summary.json``) and the scatter (``scatter.png``), each file atomically.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.outputs.trace_export import atomic_output
from simulator.published.classes import fit_line, split_line
from simulator.published.scaling import scaling_line, weak_scaling


def totals(table: pd.DataFrame) -> dict[str, Any]:
    """Rows, rows compared, rows not expressed (by reason), mean and mean |error|."""
    done = table[table["error"].notna()]
    reasons = table.loc[table["error"].isna(), "reason"].value_counts()
    return {"rows": len(table), "compared": len(done),
            "not_expressed": int(table["error"].isna().sum()),
            "mean_error": float(done["error"].mean()) if len(done) else math.nan,
            "mean_abs_error": float(done["error"].abs().mean()) if len(done) else math.nan,
            "not_fitting": int((done["fits"] == False).sum()),  # noqa: E712 (a column)
            "reasons": {str(k): int(v) for k, v in reasons.items()}}


def summary_lines(table: pd.DataFrame, regimes: pd.DataFrame,
                  fits: pd.DataFrame | None = None,
                  split: pd.DataFrame | None = None) -> list[str]:
    t = totals(table)
    lines = [f"{t['rows']} row(s): {t['compared']} compared, {t['not_expressed']} not "
             "expressed" + (f"; mean error {t['mean_error']:+.1%}, mean |error| "
                            f"{t['mean_abs_error']:.1%}" if t["compared"] else "")]
    if t["not_fitting"]:
        lines.append(f"{t['not_fitting']} compared row(s) trained but do not fit in the "
                     "simulation's memory")
    for reason, n in list(t["reasons"].items())[:5]:
        lines.append(f"  not expressed ({n}): {reason}")
    if len(regimes):
        worst = regimes.iloc[regimes["mean_error"].abs().argmax()]
        lines.append(f"largest regime error: {worst['regime']} {worst['group']}: "
                     f"{worst['mean_error']:+.1%} over {worst['rows']} row(s)")
    for line in (scaling_line(weak_scaling(table)),
                 fit_line(fits) if fits is not None else None,
                 split_line(split) if split is not None else None):
        if line:
            lines.append(line)
    return lines


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table of ``frame`` (cells as text, pipes escaped)."""
    cells = [[str(v).replace("|", "\\|") for v in row] for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |",
             "|" + "|".join("---" for _ in frame.columns) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in cells)])


def _formatted(frame: pd.DataFrame, **formats: str) -> pd.DataFrame:
    """``frame`` with each named column as text in its format (``"{:.3f}"``)."""
    return frame.assign(**{c: frame[c].map(f.format) for c, f in formats.items()})


def _section(title: str, intro: str, shown: pd.DataFrame) -> list[str]:
    """A ``runs.md`` section: its heading, what it shows, its table."""
    return [f"## {title}", "", intro, "", markdown_table(shown), ""]


def _class_section(fits: pd.DataFrame | None) -> list[str]:
    if fits is None:
        return []
    if fits.empty:
        return ["## By cost class", "", "no group of more than four rows with a time or a "
                "rate to fit", ""]
    shown = _formatted(fits, **dict.fromkeys(("mean_share", "factor", "std_error"), "{:.3f}"),
                       mean_abs_error="{:.1%}", mean_abs_error_after="{:.1%}",
                       condition="{:.3g}")
    return _section("By cost class",
                    "Measured over simulated step time per class, least squares over the "
                    "rows' shares of the simulated step (a diagnosis; "
                    "`simulator/published/classes.py`): a factor above 1, the runs spent "
                    "longer in the class than simulated.", shown)


def _split_section(split: pd.DataFrame | None) -> list[str]:
    if split is None or split.empty:
        return []
    shown = _formatted(split, **dict.fromkeys(
        ("attention_share_min", "attention_share_max", "factor_rest", "std_error_rest",
         "factor_attention", "std_error_attention"), "{:.3f}"),
        mean_abs_error="{:.1%}", mean_abs_error_after="{:.1%}")
    return _section("Attention against the rest",
                    "Measured over simulated step time, least squares over each row's "
                    "attention share of the simulated step and the rest: per GPU, and per "
                    "GPU, attention kernel and head dimension, where runs over several "
                    "sequence lengths tell the two apart (a diagnosis; "
                    "`simulator/published/classes.py`).", shown)


def _scaling_section(scaling: pd.DataFrame) -> list[str]:
    if scaling.empty:
        return []
    shown = _formatted(scaling, measured_ratio="{:.3f}", simulated_ratio="{:.3f}",
                       gap="{:+.1%}")
    return _section("Weak scaling",
                    "Rows that differ only in their GPU count: the per-GPU rate at each "
                    "count over the series' smallest, measured and simulated; a positive "
                    "gap, the simulation loses less going out than the runs did "
                    "(`simulator/published/scaling.py`).", shown)


def _markdown(table: pd.DataFrame, regimes: pd.DataFrame, meta: dict[str, Any],
              fits: pd.DataFrame | None = None, split: pd.DataFrame | None = None) -> str:
    t = totals(table)
    head = [f"# Published runs: {meta.get('table', '')}", "",
            f"`clustersim validate-runs` with `--method {meta.get('method', '')}`: "
            f"{t['rows']} rows, {t['compared']} compared, {t['not_expressed']} not expressed.",
            ""]
    if t["compared"]:
        head += [f"Mean error {t['mean_error']:+.1%} (simulated / measured − 1: positive "
                 f"reads faster than measured), mean |error| {t['mean_abs_error']:.1%}.", ""]
    reg = _formatted(regimes, mean_error="{:+.1%}", mean_abs_error="{:.1%}", worst="{:+.1%}")
    done = table[table["error"].notna()]
    rows = _formatted(done, error="{:+.1%}", simulated="{:.4g}", params_B="{:.3g}")
    skipped = table[table["error"].isna()][["name", "reason"]]
    return "\n".join([*head, "## By regime", "", markdown_table(reg), "",
                      *_scaling_section(weak_scaling(table)),
                      *_class_section(fits), *_split_section(split), "## Rows", "",
                      markdown_table(rows.drop(columns=["reason"])),
                      "", "## Not expressed", "",
                      markdown_table(skipped) if len(skipped) else "none", ""])


def write_report(out: Path, table: pd.DataFrame, regimes: pd.DataFrame,
                 meta: dict[str, Any], plots: bool = True,
                 fits: pd.DataFrame | None = None,
                 split: pd.DataFrame | None = None) -> list[Path]:
    from simulator.outputs.search_files import write_table

    out.mkdir(parents=True, exist_ok=True)
    written = [write_table(table, out / "runs.csv"), write_table(regimes, out / "regimes.csv")]
    scaling = weak_scaling(table)
    if not scaling.empty:
        written.append(write_table(scaling, out / "scaling.csv"))
    if fits is not None:
        written.append(write_table(fits, out / "classes.csv"))
    if split is not None:
        written.append(write_table(split, out / "split.csv"))
    with atomic_output(out / "runs.md") as tmp:
        tmp.write_text(_markdown(table, regimes, meta, fits, split), encoding="utf-8")
    written.append(out / "runs.md")
    with atomic_output(out / "summary.json") as tmp:
        tmp.write_text(json.dumps({**meta, **totals(table)}, indent=2) + "\n", encoding="utf-8")
    written.append(out / "summary.json")
    if plots:
        from simulator.outputs.plots.published import plot_published

        written.append(plot_published(table, out / "scatter.png", str(meta.get("table", ""))))
    return written
