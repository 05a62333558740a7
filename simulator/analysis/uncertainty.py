"""Uncertainty: the calibration's spread of each fitted term, carried to step time and MFU.

A calibrated profile's ``uncertainty`` section gives each fitted term's relative
standard deviation σ (:data:`simulator.system.units.UNCERTAINTY_TERMS`; how
calibration estimates it: :mod:`calibration.microbench.fit_terms`).
``clustersim run --uncertainty N`` draws N profiles and simulates each with the
run's own method and fidelity (Monte Carlo):

- each term with a spread gets one factor per sample, lognormal with median 1 and
  coefficient of variation σ: f = exp(s·z), s = √ln(1 + σ²), z standard normal;
- an efficiency term (``gemm``, ``attention``, ``memory``, a cost class's own
  curve) multiplies every point of its curve by f, clamped to at most 1
  (``attention`` the fused attention kernels' curves too);
  ``kernel_overhead`` multiplies the per-kernel overhead by 1/f (a larger
  efficiency and a smaller overhead both mean faster); a link class is f times
  faster (bandwidth, latency and its calibrated collectives, as
  :meth:`HardwareProfile.with_faster_link` does it); ``interference``
  multiplies each link class's slowdown factor by f, kept within [1, 10];
  ``collective_sync`` multiplies each link class's sync cost (its curves by size and
  by burst too) by f, ``send_sync`` each link class's point-to-point sync cost,
  ``funcol_host`` each kind's DTensor redistribution host time (both terms of its
  line), ``funcol_sync`` an older profile's one figure per link class,
  ``rank_spread`` the rank spread (at most 1);
- sample i draws from the generator seeded with (seed, i), so a seed gives the
  same samples whatever N, and the same N and seed the same percentiles.

Step time and MFU are reported as the 5th, 50th and 95th percentiles over the
samples (numpy's linear interpolation). A profile without an ``uncertainty``
section has nothing to propagate: the three percentiles are the point estimate,
the run says so, and no sample is simulated. The scenario's other inputs (the
model, the plan, the stages on another system) are not perturbed, nor is the
jitter of ``variability``: each sample is the scenario's step 0.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from simulator.spec.scenario import Scenario
from simulator.system.curves import BurstCurve, EfficiencyCurve, HostLine, SyncCurve
from simulator.system.hardware import HardwareProfile
from simulator.system.units import LINK_NAMES

MAX_SAMPLES = 10_000
PERCENTILES = (("p5", 5.0), ("p50", 50.0), ("p95", 95.0))
#: The generic curve each efficiency term scales.
CURVES = {"gemm": "gemm_efficiency", "attention": "attention_efficiency",
          "memory": "memory_efficiency"}

#: Simulates a scenario as the run does and returns its step time in seconds.
StepTime = Callable[[Scenario], float]


def draw_factors(spread: dict[str, float], seed: int, sample: int) -> dict[str, float]:
    """Sample ``sample``'s factor per term (terms without a spread are left out)."""
    import numpy as np

    rng = np.random.default_rng([seed, sample])
    z = rng.standard_normal(len(spread))
    return {term: math.exp(math.sqrt(math.log1p(sigma * sigma)) * float(zi))
            for (term, sigma), zi in zip(sorted(spread.items()), z, strict=True) if sigma > 0}


def _scaled(curve: EfficiencyCurve, factor: float) -> EfficiencyCurve:
    return EfficiencyCurve(points=tuple((x, min(max(e * factor, 1.0001e-4), 1.0))
                                        for x, e in curve.points))


def perturbed(hw: HardwareProfile, factors: dict[str, float]) -> HardwareProfile:
    """``hw`` with each term scaled by its factor (see the module docstring)."""
    gpu: dict[str, Any] = {}
    for term, field in CURVES.items():
        if term in factors:
            gpu[field] = _scaled(getattr(hw.gpu, field), factors[term])
    if "attention" in factors and hw.gpu.attention_kernels:  # the kernels' own curves too
        f = factors["attention"]
        gpu["attention_kernels"] = {
            name: k.model_copy(update={"fwd": {d: _scaled(c, f) for d, c in k.fwd.items()},
                                       "bwd": {d: _scaled(c, f) for d, c in k.bwd.items()}})
            for name, k in hw.gpu.attention_kernels.items()}
    classes = {cls: _scaled(curve, factors[cls]) if cls in factors else curve
               for cls, curve in hw.gpu.class_efficiency.items()}
    if classes != hw.gpu.class_efficiency:
        gpu["class_efficiency"] = classes
    if "kernel_overhead" in factors:
        gpu["kernel_overhead_us"] = hw.gpu.kernel_overhead_us / factors["kernel_overhead"]
    if "interference" in factors:
        gpu["interference"] = {link: min(max(f * factors["interference"], 1.0), 10.0)
                               for link, f in hw.gpu.interference.items()}
    if "collective_sync" in factors:
        gpu["collective_sync_us"] = {link: us * factors["collective_sync"]
                                     for link, us in hw.gpu.collective_sync_us.items()}
        gpu["collective_sync_curve"] = {
            link: SyncCurve(points=tuple((b, us * factors["collective_sync"])
                                         for b, us in curve.points))
            for link, curve in hw.gpu.collective_sync_curve.items()}
        gpu["collective_sync_burst"] = {
            link: BurstCurve(points=tuple((b, us * factors["collective_sync"])
                                          for b, us in curve.points))
            for link, curve in hw.gpu.collective_sync_burst.items()}
    if "send_sync" in factors:
        gpu["send_sync_us"] = {link: us * factors["send_sync"]
                               for link, us in hw.gpu.send_sync_us.items()}
    if "funcol_host" in factors:
        f = factors["funcol_host"]
        gpu["funcol_host"] = {k: HostLine(us=line.us * f, us_per_mib=line.us_per_mib * f)
                              for k, line in hw.gpu.funcol_host.items()}
    if "funcol_sync" in factors:
        gpu["funcol_sync_us"] = {link: us * factors["funcol_sync"]
                                 for link, us in hw.gpu.funcol_sync_us.items()}
    if "rank_spread" in factors:
        gpu["rank_spread"] = min(hw.gpu.rank_spread * factors["rank_spread"], 1.0)
    out = hw.model_copy(update={"gpu": hw.gpu.model_copy(update=gpu)}) if gpu else hw
    for link in LINK_NAMES:
        if link in factors:
            out = out.with_faster_link(link, factors[link])  # type: ignore[arg-type]
    return out


def with_hardware(s: Scenario, hw: HardwareProfile) -> Scenario:
    """A copy of ``s`` whose resolved hardware is ``hw`` (the cluster's overrides are
    already inside it; ``Scenario.hardware`` is a cached property)."""
    out = s.model_copy()
    out.__dict__["hardware"] = hw
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    arr = np.asarray(values, float)
    return {name: float(np.percentile(arr, q)) for name, q in PERCENTILES}


def step_time_of(s: Scenario, method: str, fidelity: str | None) -> float:
    """The step time of ``s`` as ``clustersim run`` prices it with ``method`` (step 0)."""
    if method == "analytic":
        from simulator.analysis.analytic.estimate import analytic_estimate

        return float(analytic_estimate(s)["step_time_s"])
    from simulator.builder.workload import build_workload
    from simulator.engine.engine import simulate

    return float(simulate(build_workload(s, fidelity=fidelity), s.hardware).end_time)


def monte_carlo(s: Scenario, n: int, seed: int, point: dict[str, Any],
                step_time: StepTime | None = None) -> dict[str, Any]:
    """The ``uncertainty`` block of results.json. ``point`` is the plain run's results
    (``step_time_s``, ``mfu``, ``method``, ``fidelity``): the answer when the profile
    has no spread, and the method each sample is simulated with (or ``step_time``)."""
    from simulator.outputs.progress import progress_bar

    spread = {t: v for t, v in s.hardware.uncertainty.items() if v > 0}
    block: dict[str, Any] = {"samples": n, "seed": seed, "relative_std": dict(spread)}
    t0, mfu0 = float(point["step_time_s"]), float(point["mfu"])
    if not spread:
        times, mfus = [t0], [mfu0]
        block["samples"] = 0
        block["note"] = (f"profile {s.hardware.name} has no uncertainty section (or only zero "
                         "spreads): step time and MFU are the point estimate")
    else:
        price = step_time or (lambda sc: step_time_of(sc, point["method"],
                                                      point.get("fidelity")))
        times = []
        with progress_bar(n, "uncertainty samples") as bar:
            for i in range(n):
                hw = perturbed(s.hardware, draw_factors(spread, seed, i))
                times.append(price(with_hardware(s, hw)))
                bar.update(1)
        # MFU = model FLOPs / (step time × GPUs × peak); the peak is not a fitted term
        mfus = [mfu0 * t0 / t for t in times]
    block["step_time_s"] = percentiles(times)
    block["mfu"] = percentiles(mfus)
    return block


def flat_keys(block: dict[str, Any]) -> dict[str, float]:
    """results.json's top-level keys: ``step_time_s_p5`` … ``mfu_p95``."""
    return {f"{metric}_{name}": block[metric][name]
            for metric in ("step_time_s", "mfu") for name, _ in PERCENTILES}


def summary_lines(block: dict[str, Any]) -> list[str]:
    t, m = block["step_time_s"], block["mfu"]
    if block.get("note"):
        head = f"uncertainty: {block['note']}"
    else:
        terms = ", ".join(f"{k} {v:.1%}" for k, v in block["relative_std"].items())
        head = (f"uncertainty: {block['samples']} samples (seed {block['seed']}) over the "
                f"profile's fitted terms ({terms})")
    return [head,
            f"  step time p5 / p50 / p95: {t['p5']:.4g} / {t['p50']:.4g} / {t['p95']:.4g} s",
            f"  MFU       p5 / p50 / p95: {m['p5']:.1%} / {m['p50']:.1%} / {m['p95']:.1%}"]


def parse_samples(text: str) -> int:
    """``--uncertainty N``: a whole number 1 … :data:`MAX_SAMPLES`, else a UserError."""
    from simulator.errors import Problem, UserError

    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_SAMPLES or str(n) != text.strip().lstrip("+"):
        raise UserError([Problem("--uncertainty", text, f"use a whole number of samples "
                                 f"from 1 to {MAX_SAMPLES:,}, e.g. --uncertainty 200")])
    return n


def parse_seed(text: str) -> int:
    """``--seed S``: a whole number 0 … 2⁶³ − 1, else a UserError."""
    from simulator.errors import Problem, UserError

    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**63:
        raise UserError([Problem("--seed", text, "use a whole number >= 0, e.g. --seed 1")])
    return seed


def print_start(n: int, hw: HardwareProfile) -> None:
    if any(v > 0 for v in hw.uncertainty.values()):
        print(f"uncertainty: simulating {n} sample(s) of profile {hw.name}'s fitted terms ...",
              file=sys.stderr, flush=True)
