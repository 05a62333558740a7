"""What bounds a step: its sensitivity to each cost class.

``clustersim run --what-if`` prices the same step again with one cost class
:data:`SPEEDUP` (1.1) times faster at a time, with the run's own method and
fidelity, and reports for each class

- the step time then, ``step'``;
- *sensitivity* ``(step − step') / step``: the fraction of the step that a 10%
  faster class saves;
- *elasticity* ``ln(step / step') / ln 1.1``: the share of the step that moves
  with the class (1 when the whole step scales with it, 0 when it does not matter).

The classes are the compute ones of :mod:`simulator.system.costs` — GEMMs, attention,
memory-bound kernels (the optimizer step is memory-bound), made faster through
:attr:`CostModel.speed <simulator.system.costs.CostModel.speed>` — and the fabric's link
classes of :meth:`HardwareProfile.with_faster_link
<simulator.system.hardware.HardwareProfile.with_faster_link>`: the NVSwitch ports, the
NICs and, when the fat-tree is oversubscribed, its core. A class's time is
divided by the factor, its kernel overheads and link latencies included.

Reading the sensitivities: the classes partition the compute of every op, so a
step made only of compute has compute sensitivities that sum to exactly
1 − 1/1.1 ≈ 9.09%, in proportion to each class's share. Where communication
is on the critical path the link classes take their share and the compute
sum falls to about (1 − 1/1.1) × the compute fraction of the critical path.
Overlapped work that a faster class leaves hidden scores 0. Contention can
make a sensitivity slightly negative (a faster flow lands a collective in a
busier moment); it is reported as it is.

The engine re-simulates with the collective algorithms chosen for the profile
as it is (a partial derivative: the same plans, faster links); the analytic
method re-chooses them, which changes nothing it would not price the same.
Not covered: ZeRO-Offload's host (CPU Adam and PCIe).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from simulator.analysis.analytic.estimate import analytic_estimate
from simulator.builder.workload import build_workload
from simulator.engine.engine import simulate
from simulator.spec.scenario import Scenario
from simulator.system.costs import COMPUTE_CLASSES, CostModel

SPEEDUP = 1.1  # each class this many times faster, one at a time

#: Display names of the cost classes.
CLASS_LABELS: Mapping[str, str] = {
    "gemm": "GEMM",
    "attention": "attention",
    "memory": "memory-bound kernels",
    "intra_node": "intra-node links (NVSwitch)",
    "inter_node": "inter-node links (NIC)",
    "core": "fabric core",
}


def cost_classes(s: Scenario) -> tuple[str, ...]:
    """The classes a scenario's step can depend on: compute, then its fabric's links."""
    return (*COMPUTE_CLASSES, *s.hardware.link_classes)


def step_time_with(s: Scenario, cost_class: str, factor: float, method: str,
                   fidelity: str) -> float:
    """The step time of ``s`` with ``cost_class`` ``factor`` times faster."""
    hw, speed = s.hardware, dict[str, float]()
    if cost_class in COMPUTE_CLASSES:
        speed[cost_class] = factor
    elif cost_class in hw.link_classes:
        hw = hw.with_faster_link(cost_class, factor)
    else:
        raise ValueError(f"cost class {cost_class!r} is not one of {cost_classes(s)}")
    cost = CostModel(s.hardware, s.training.dtype, speed, s.stack.host_us, s.parallel.world)
    if method == "analytic":
        return float(analytic_estimate(s, cost=cost, hw=hw)["step_time_s"])
    workload = build_workload(s, cost=cost, fidelity=fidelity)
    return simulate(workload, hw).end_time


def elasticity(step_time: float, faster: float) -> float:
    """``ln(step / step') / ln SPEEDUP``: the share of a step of ``step_time`` that moves
    with a class whose :data:`SPEEDUP` gives ``faster`` (0 for a degenerate step)."""
    return math.log(step_time / faster) / math.log(SPEEDUP) \
        if step_time > 0 and faster > 0 else 0.0


def what_if(s: Scenario, step_time: float, method: str, fidelity: str | None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The ``what_if`` entry of results.json: per class, the step time with that class
    :data:`SPEEDUP` times faster, the sensitivity and the elasticity."""
    fidelity = fidelity or s.simulation.fidelity
    classes: dict[str, dict[str, float]] = {}
    for name in cost_classes(s):
        if progress is not None:
            progress(name)
        faster = step_time_with(s, name, SPEEDUP, method, fidelity)
        classes[name] = {
            "step_time_s": faster,
            "sensitivity": (step_time - faster) / step_time if step_time > 0 else 0.0,
            "elasticity": elasticity(step_time, faster),
        }
    return {"speedup": SPEEDUP, "method": method,
            "fidelity": fidelity if method == "engine" else None,
            "step_time_s": step_time, "classes": classes}


def what_if_lines(entry: Mapping[str, Any]) -> list[str]:
    """The "what bounds this step" table, most sensitive class first."""
    pct = (entry["speedup"] - 1) * 100
    how = entry["method"] + (f", {entry['fidelity']}" if entry.get("fidelity") else "")
    rows = sorted(entry["classes"].items(), key=lambda kv: -kv[1]["sensitivity"])
    width = max(len(CLASS_LABELS.get(k, k)) for k, _ in rows)
    out = [f"what bounds this step: each class {pct:.0f}% faster in turn ({how}, "
           f"step {entry['step_time_s']:.4g} s)",
           f"  {'class':<{width}}  {'step (s)':>10}  {'saves':>7}  {'elasticity':>10}"]
    for name, row in rows:
        out.append(f"  {CLASS_LABELS.get(name, name):<{width}}  {row['step_time_s']:>#10.4g}  "
                   f"{row['sensitivity']:>7.2%}  {row['elasticity']:>10.3f}")
    total = sum(row["sensitivity"] for name, row in rows if name in COMPUTE_CLASSES)
    out.append(f"  compute classes together save {total:.2%} of the step "
               f"(all of it compute: {1 - 1 / entry['speedup']:.2%})")
    return out
