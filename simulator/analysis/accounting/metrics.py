"""What results.json derives from the per-rank breakdown, whichever method made it:
the mean and per-stage breakdowns, exposed communication, compute, and the bubble
fraction from each rank's schedule bubble.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from simulator.analysis.accounting.vocabulary import (
    COMPUTE_CATEGORIES,
    categories,
    comm_kinds,
)


def mean_breakdown(entries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``step_breakdown_s``: each category's mean over the entries (ranks); an entry
    that stands for several ranks (asymmetric folding's ``ranks``) counts that often."""
    weights = [float(e.get("ranks", 1)) for e in entries]
    n = sum(weights) or 1.0
    return {c: sum(w * float(e.get(c, 0.0)) for w, e in zip(weights, entries, strict=True)) / n
            for c in categories()}


def stage_breakdown(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Each category's mean over the entries of each pipeline stage, by stage."""
    by_stage: dict[int, list[Mapping[str, Any]]] = {}
    for e in entries:
        by_stage.setdefault(int(e["stage"]), []).append(e)
    return [mean_breakdown(by_stage[s]) for s in sorted(by_stage)]


def exposed_comm(mean: Mapping[str, float]) -> dict[str, float]:
    """Seconds a rank is held back by each communication kind (transfer + peer-wait)."""
    return {k: mean.get(f"{k}_transfer", 0.0) + mean.get(f"{k}_wait", 0.0)
            for k in comm_kinds()}


def _weighted_mean(pairs: Sequence[tuple[float, float]]) -> float:
    total = sum(w for w, _ in pairs)
    return sum(w * x for w, x in pairs) / total if total else 0.0


def metrics(entries: list[dict[str, Any]], step: float, phase: tuple[float, float],
            bubbles: Sequence[float]) -> dict[str, Any]:
    """The results.json keys every method derives from its per-rank breakdown and
    per-rank schedule bubbles (:func:`schedule_bubble`, in the order of ``entries``)."""
    duration = phase[1] - phase[0]
    stages = stage_breakdown(entries)
    mean = mean_breakdown(entries)
    per_stage: dict[int, list[tuple[float, float]]] = {}
    for e, bubble in zip(entries, bubbles, strict=True):
        per_stage.setdefault(int(e["stage"]), []).append((float(e.get("ranks", 1)), bubble))
    every = [(float(e.get("ranks", 1)), b) for e, b in zip(entries, bubbles, strict=True)]
    return {
        "step_time_s": step,
        "time_breakdown_s": entries,
        "step_breakdown_s": mean,
        "bubble_fraction": _weighted_mean(every) / duration if bubbles and duration > 0
        else 0.0,
        "bubble_fraction_per_stage": [_weighted_mean(b) / duration if duration > 0 else 0.0
                                      for _, b in sorted(per_stage.items())],
        "pipeline_phase_s": list(phase),
        "compute_s": [sum(st[c] for c in COMPUTE_CATEGORIES) for st in stages],
        "exposed_comm_s": exposed_comm(mean),
    }
