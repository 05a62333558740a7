"""Many steps: the step-time distribution under jitter, and the wait for the slowest.

A step is deterministic for a scenario, its seed and the step's index, so ``--steps
N`` simulates steps 0 … N−1 with fresh jitter draws (:mod:`simulator.spec.variability`)
and summarises their times: mean, p50, p95, p99 and max. Consecutive steps do not
overlap in the stacks we model (the optimizer step ends one, the next one's first
forward waits for it), so N steps take the sum of their times. Without jitter every
step is the same and one simulation stands for all N.

**Waiting for the slowest rank** is the accounting's peer-wait: the seconds a rank
sits at a collective until its last member arrives (``<kind>_wait`` summed over
the kinds; :data:`simulator.analysis.accounting.vocabulary.WAIT_CATEGORIES`), as a mean over ranks
and
per step. A slow GPU or a jittered kernel anywhere in a group shows up there on
every other member.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from simulator.analysis import report
from simulator.analysis.accounting.vocabulary import WAIT_CATEGORIES
from simulator.builder.workload import build_workload
from simulator.engine.engine import simulate
from simulator.spec.scenario import Scenario

QUANTILES = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0))


def straggler_wait(mean: Mapping[str, float]) -> float:
    """Seconds of the mean rank's step spent waiting for a later peer at a collective."""
    return sum(float(mean.get(c, 0.0)) for c in WAIT_CATEGORIES)


def distribution(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, float)
    out = {"mean": float(a.mean()), "min": float(a.min())}
    out.update({name: float(np.percentile(a, q)) for name, q in QUANTILES})
    out["max"] = float(a.max())
    return out


def _line(i: int, n: int) -> None:
    print(f"  step {i + 1} of {n}", file=sys.stderr, flush=True)


def many_steps(s: Scenario, n: int, first: Mapping[str, Any], fidelity: str | None = None,
               progress: Callable[[int, int], None] | None = _line) -> dict[str, Any]:
    """The ``steps`` block of results.json for ``n`` steps, given step 0's results
    (``first``); steps 1 … n−1 are simulated (engine) when the scenario has jitter."""
    times = [float(first["step_time_s"])]
    waits = [straggler_wait(first.get("step_breakdown_s") or {})]
    jittered = s.variability.jitter is not None
    for i in range(1, n if jittered else 1):
        if progress is not None:
            progress(i, n)
        result = simulate(build_workload(s, fidelity=fidelity, step=i), s.hardware)
        out = report.engine_metrics(s, result)
        times.append(out["step_time_s"])
        waits.append(straggler_wait(out["step_breakdown_s"]))
    if not jittered:  # deterministic: every step is step 0
        times, waits = times * n, waits * n
    return {"count": n, "jitter": jittered, "step_time_s": distribution(times),
            "straggler_wait_s": distribution(waits), "total_s": float(sum(times)),
            "per_step_s": times}


def summary_lines(steps: Mapping[str, Any]) -> list[str]:
    t, w = steps["step_time_s"], steps["straggler_wait_s"]
    how = "fresh jitter each" if steps["jitter"] else "no jitter: all equal"
    return [f"{steps['count']} steps ({how}): p50 {t['p50']:.4g} s, p95 {t['p95']:.4g} s, "
            f"p99 {t['p99']:.4g} s, max {t['max']:.4g} s",
            f"waiting for the slowest rank: mean {w['mean']:.4g} s per step "
            f"({w['mean'] / t['mean']:.1%} of it), max {w['max']:.4g} s"]
