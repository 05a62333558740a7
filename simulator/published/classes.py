"""Where a table's error sits, by cost class (``clustersim validate-runs --by-class``).

Each compared row's simulated step is split into the shares that scale with its GEMMs,
its attention kernels and its memory-bound kernels (the optimizer step included), each
the elasticity ``clustersim run --what-if`` reports (:mod:`simulator.analysis.whatif`:
the class 10% faster, ``ln(step / step') / ln 1.1``), the share its links move (the sum
of the fabric's link classes' elasticities: exposed communication), and the other:
host time that no kernel hides, latencies, bubbles, which none of them moves.

Then, per group of rows (all of them, then each GPU's), the factor per class that best
turns the simulated steps into the measured ones, by least squares without an intercept:

    measured time / simulated time of row i  ≈  Σ_c f_c · share_ic

A factor above 1 says the runs spent that much longer in the class than the simulation
prices (GEMMs at 1.0 and attention at 0.8: the attention kernels run faster than their
curves, the GEMMs as priced). Each factor comes with its standard error
(σ² (SᵀS)⁻¹ with σ² the residual variance over n − 5 degrees of freedom) and each group
with the condition number of its share matrix: rows whose shares move together (a set
of one model at one sequence length) cannot tell two classes apart, and the standard
errors say so. With the factors applied each row's figure is corrected (a throughput
divided by Σ f_c · share_c, a time multiplied) and the group's mean |error| after it
says how much of the error a per-class mispricing explains; what it leaves is not one
class's speed (a mechanism that is not a kernel class's, or a class priced wrong in one
regime only). A diagnosis to find the mechanism, never an input to the model.

Five classes move together across most tables (a row's GEMM and memory-bound shares both
scale with its tokens), so the same fit is also made with two: the attention kernels
against the rest of the step (:func:`fit_split`),

    measured time / simulated time of row i  ≈  f_rest · (1 − share_attention_i)
                                               + f_attention · share_attention_i

over all rows, per GPU and per GPU, attention kernel and head dimension, where a set of
runs of one model over several sequence lengths spans a wide range of attention shares
and tells the two apart: the kernel's curve at that head dimension on the one side,
everything else the step does per token on the other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from simulator.spec.scenario import Scenario
from simulator.system.costs import COMPUTE_CLASSES

#: the classes a step is split into: the compute ones, the links, then the other
CLASSES: tuple[str, ...] = (*COMPUTE_CLASSES, "communication", "other")
SHARE_COLUMNS: tuple[str, ...] = tuple(f"share_{c}" for c in CLASSES)
LABELS = {"gemm": "GEMM", "attention": "attention", "memory": "memory-bound",
          "communication": "communication", "other": "the other"}
#: units in which a larger figure is a shorter step (throughput, or MFU at fixed FLOPs)
THROUGHPUT_UNITS = frozenset({"tokens/s/gpu", "tokens/s", "seq/s", "mfu"})
#: units that are the step's time
TIME_UNITS = frozenset({"s/step", "step_time_s"})
FIT_COLUMNS = ("group", "rows", "class", "mean_share", "factor", "std_error",
               "mean_abs_error", "mean_abs_error_after", "condition")
SPLIT_COLUMNS = ("group", "rows", "attention_share_min", "attention_share_max",
                 "factor_rest", "std_error_rest", "factor_attention", "std_error_attention",
                 "mean_abs_error", "mean_abs_error_after")


def step_shares(s: Scenario, method: str, step_time: float) -> dict[str, float]:
    """``share_<class>`` of the step ``s`` takes (``step_time``, by ``method``): each
    compute class's elasticity, the link classes' together, and the other, 1 minus
    their sum."""
    from simulator.analysis.whatif import SPEEDUP, elasticity, step_time_with

    def moved(name: str) -> float:
        return elasticity(step_time, step_time_with(s, name, SPEEDUP, method,
                                                    s.simulation.fidelity))

    shares = {f"share_{name}": moved(name) for name in COMPUTE_CLASSES}
    shares["share_communication"] = sum(moved(link) for link in s.hardware.link_classes)
    shares["share_other"] = 1.0 - sum(shares.values())
    return shares


def time_ratio(unit: str, measured: float, simulated: float) -> float:
    """The measured step's time over the simulated one's, from two figures in ``unit``
    (NaN for a unit that is not a time or a rate, peak memory)."""
    u = unit.strip().lower()
    if not (measured > 0 and simulated > 0):
        return math.nan
    if u in THROUGHPUT_UNITS:
        return simulated / measured
    if u in TIME_UNITS:
        return measured / simulated
    return math.nan


def _corrected(unit: str, simulated: float, scale: float) -> float:
    """The simulated figure of a step ``scale`` times longer."""
    return simulated / scale if unit.strip().lower() in THROUGHPUT_UNITS else simulated * scale


def _least_squares(x: np.ndarray, ratio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The factors that best turn ``x``'s columns into ``ratio`` (no intercept) and their
    standard errors (σ² (XᵀX)⁻¹, σ² the residual variance over n − p)."""
    n, p = x.shape
    factors, *_ = np.linalg.lstsq(x, ratio, rcond=None)
    resid = ratio - x @ factors
    cov = float(resid @ resid) / (n - p) * np.linalg.pinv(x.T @ x)
    return factors, np.sqrt(np.clip(np.diag(cov), 0.0, None))


def _after(g: pd.DataFrame, scale: np.ndarray) -> float:
    """The group's mean |error| once each row's simulated figure is ``scale`` times
    corrected."""
    after = [_corrected(u, s, k) / m - 1 if k > 0 else math.nan for u, s, m, k in
             zip(g["unit"], g["simulated"], g["measured"], scale, strict=True)]
    return float(np.nanmean(np.abs(after)))


def _fit_group(group: str, g: pd.DataFrame) -> list[dict[str, Any]]:
    shares = g[list(SHARE_COLUMNS)].to_numpy(dtype=float)
    factors, errors = _least_squares(shares, g["time_ratio"].to_numpy(dtype=float))
    common = {"group": group, "rows": len(g),
              "mean_abs_error": float(g["error"].abs().mean()),
              "mean_abs_error_after": _after(g, shares @ factors),
              "condition": float(np.linalg.cond(shares))}
    return [{**common, "class": name, "mean_share": float(shares[:, i].mean()),
             "factor": float(factors[i]), "std_error": float(errors[i])}
            for i, name in enumerate(CLASSES)]


def _split_group(group: str, g: pd.DataFrame) -> dict[str, Any]:
    """One group's split; NaN factors where its rows share one attention share (the two
    columns are then one: nothing tells attention from the rest)."""
    attention = g["share_attention"].to_numpy(dtype=float)
    x = np.column_stack([1.0 - attention, attention])
    if np.linalg.matrix_rank(x) < 2:
        factors = errors = np.full(2, math.nan)
        scale = np.ones(len(g))
    else:
        factors, errors = _least_squares(x, g["time_ratio"].to_numpy(dtype=float))
        scale = x @ factors
    return {"group": group, "rows": len(g), "attention_share_min": float(attention.min()),
            "attention_share_max": float(attention.max()),
            "factor_rest": float(factors[0]), "std_error_rest": float(errors[0]),
            "factor_attention": float(factors[1]), "std_error_attention": float(errors[1]),
            "mean_abs_error": float(g["error"].abs().mean()),
            "mean_abs_error_after": _after(g, scale)}


def _timed(table: pd.DataFrame) -> pd.DataFrame | None:
    """The compared rows with shares and a time ratio (``time_ratio``); None without
    shares."""
    done = table[table["error"].notna()].copy()
    if not set(SHARE_COLUMNS) <= set(done.columns):
        return None
    done["time_ratio"] = [time_ratio(u, m, s) for u, m, s in
                          zip(done["unit"], done["measured"], done["simulated"], strict=True)]
    return done[done[[*SHARE_COLUMNS, "time_ratio"]].notna().all(axis=1)]


def _groups(done: pd.DataFrame, group_of: Sequence[Callable[[pd.Series], str]]
            ) -> list[tuple[str, pd.DataFrame]]:
    """("all", every row), then each grouping's groups in turn, by name."""
    groups: list[tuple[str, pd.DataFrame]] = [("all", done)]
    for key in group_of:
        if len(done):
            keys = done.apply(key, axis=1)
            groups += [(str(k), g) for k, g in done.groupby(keys, sort=True)]
    return groups


def fit_classes(table: pd.DataFrame,
                group_of: Callable[[pd.Series], str] | None = None) -> pd.DataFrame:
    """:data:`FIT_COLUMNS` per group and class: all rows with shares and a time ratio
    ("all"), then each group ``group_of(row)`` gives (default: none), each only with more
    rows than classes (fewer leave no degree of freedom)."""
    done = _timed(table)
    if done is None:
        return pd.DataFrame(columns=list(FIT_COLUMNS))
    parts = [entry for name, g in _groups(done, [group_of] if group_of else [])
             if len(g) > len(CLASSES) for entry in _fit_group(name, g)]
    return pd.DataFrame(parts, columns=list(FIT_COLUMNS))


def fit_split(table: pd.DataFrame,
              group_of: Sequence[Callable[[pd.Series], str]] = ()) -> pd.DataFrame:
    """:data:`SPLIT_COLUMNS` per group: the attention kernels' factor and the rest's,
    over all rows, then each grouping's groups (e.g. by GPU, and by GPU, kernel and head
    dimension), each with more than two rows."""
    done = _timed(table)
    if done is None:
        return pd.DataFrame(columns=list(SPLIT_COLUMNS))
    parts = [_split_group(name, g) for name, g in _groups(done, group_of) if len(g) > 2]
    return pd.DataFrame(parts, columns=list(SPLIT_COLUMNS))


def fit_line(fits: pd.DataFrame) -> str | None:
    """One line for the whole set: each class's factor ± its standard error, and the
    mean |error| the factors leave."""
    whole = fits[fits["group"] == "all"]
    if whole.empty:
        return None
    parts = ", ".join(f"{LABELS[r['class']]} x{r['factor']:.2f}±{r['std_error']:.2f}"
                      for _, r in whole.iterrows())
    first = whole.iloc[0]
    return (f"by cost class, measured over simulated time (least squares, {first['rows']} "
            f"rows): {parts}; mean |error| {first['mean_abs_error']:.1%} → "
            f"{first['mean_abs_error_after']:.1%} with them")


def split_line(split: pd.DataFrame) -> str | None:
    """One line for the whole set: the attention kernels' factor and the rest's, each ±
    its standard error, and the mean |error| they leave."""
    whole = split[split["group"] == "all"]
    if whole.empty or whole["factor_rest"].isna().all():
        return None
    r = whole.iloc[0]
    return (f"attention kernels against the rest (least squares, {r['rows']} rows): "
            f"attention x{r['factor_attention']:.2f}±{r['std_error_attention']:.2f}, the rest "
            f"x{r['factor_rest']:.2f}±{r['std_error_rest']:.2f}; mean |error| "
            f"{r['mean_abs_error']:.1%} → {r['mean_abs_error_after']:.1%} with them")
