"""What a plan costs: each leg's rate (the link's, times the protocol's factor, or a
calibrated busbw), each phase's latency (NCCL's for an ``auto`` plan, else steps × the
slowest class's α), the sync cost a collective pays once after compute (and its growth
with the compute burst before it), the uncontended time, and the step-by-step form.

A collective that follows compute pays the profile's sync cost once
(``gpu.collective_sync_us``, :func:`sync_cost`): the back-to-back α-β fit misses the
communication threads waking and the ranks arriving skewed. It rides on the first
phase's latency (:func:`phase_latencies`), which the engine and the analytic estimate
both use. Where the profile measured it growing with the compute before the collective
(``gpu.collective_sync_burst``, :func:`sync_burst_cost`), the engine adds the growth at
each collective from its members' compute since their previous one. A calibrated
collective (``hw.collectives``) already holds what the library did, so its measured α
and busbw replace the protocol's factor and latency in the time.
"""

from __future__ import annotations

from dataclasses import replace

from simulator.system.collectives.plan import Leg, Phase, Plan
from simulator.system.hardware import HardwareProfile
from simulator.system.units import CollectiveName


def leg_rate(leg: Leg, op: CollectiveName, hw: HardwareProfile) -> float:
    """Bytes/s of one leg alone: the link's achievable rate times the protocol's factor,
    or a calibrated busbw (which already is what the library achieved)."""
    cal = hw.collectives.get(op, {}).get(leg.link_class)
    if cal is not None:
        return cal.busbw_GBps * 1e9
    return hw.link(leg.link_class).bytes_per_s * leg.rate_factor


def phase_alpha(phase: Phase, op: CollectiveName, hw: HardwareProfile) -> float:
    """The phase's latency: NCCL's (an ``auto`` plan) unless a leg's link class has a
    calibrated entry for the op; else steps × the slowest class's α."""
    calibrated = hw.collectives.get(op, {})
    if phase.alpha_units is not None and not any(g.link_class in calibrated
                                                 for g in phase.legs):
        return sum(u * hw.link(cls).alpha_s for cls, u in phase.alpha_units)
    alphas = []
    for leg in phase.legs:
        cal = calibrated.get(leg.link_class)
        alphas.append(cal.alpha_us * 1e-6 if cal is not None else hw.link(leg.link_class).alpha_s)
    return max(alphas, default=0.0) * phase.steps


def sync_cost(plan: Plan, hw: HardwareProfile) -> float:
    """What the collective costs after compute beyond its back-to-back time, once per
    collective: ``gpu.collective_sync_curve`` at the collective's bytes (else
    ``gpu.collective_sync_us``) of the slowest link class it crosses (0 for a group of
    one, or a profile without the term)."""
    if plan.n <= 1:
        return 0.0
    return max((hw.gpu.collective_sync_s(leg.link_class, plan.size) for phase in plan.phases
                for leg in phase.legs), default=0.0)


def sync_burst_cost(plan: Plan, hw: HardwareProfile, burst_s: float) -> float:
    """What the collective costs beyond :func:`sync_cost` when its members come from up
    to ``burst_s`` seconds of compute since their previous collective:
    ``gpu.collective_sync_burst`` at that burst, of the slowest link class it crosses (0
    for a group of one, or a profile without the curve). Negative after a burst shorter
    than the calibration's where the profile measured one (less of the sync cost), but
    never more than the sync cost itself off. The engine charges it; the analytic
    estimate, which has no per-collective burst, does not."""
    if plan.n <= 1 or not hw.gpu.collective_sync_burst:
        return 0.0
    growth = max((hw.gpu.collective_sync_burst_s(leg.link_class, burst_s)
                  for phase in plan.phases for leg in phase.legs), default=0.0)
    return growth if growth >= 0 else max(growth, -sync_cost(plan, hw))


def phase_latencies(plan: Plan, hw: HardwareProfile) -> list[float]:
    """Each phase's latency (:func:`phase_alpha`), the first phase's with the collective's
    :func:`sync_cost`: the one place the engine and the analytic estimate take a plan's
    latencies from, so the sync cost is charged once however the plan is split
    (:func:`expand`)."""
    out = [phase_alpha(phase, plan.op, hw) for phase in plan.phases]
    if out:
        out[0] += sync_cost(plan, hw)
    return out


def estimate(plan: Plan, hw: HardwareProfile) -> float:
    """Uncontended time: per phase, the slowest leg plus its latency steps (the first
    phase's with the sync cost)."""
    total = 0.0
    for phase, alpha in zip(plan.phases, phase_latencies(plan, hw), strict=True):
        legs = [leg.bytes_per_rank / leg_rate(leg, plan.op, hw) for leg in phase.legs]
        total += max(legs, default=0.0) + alpha
    return total


def expand(plan: Plan) -> Plan:
    """Step-by-step form: every latency step becomes its own phase with its share of
    the bytes. For small groups, as a check on the aggregated form."""
    phases: list[Phase] = []
    for phase in plan.phases:
        steps = max(phase.steps, 1)
        legs = tuple(replace(g, bytes_per_rank=g.bytes_per_rank / steps) for g in phase.legs)
        units = None if phase.alpha_units is None else tuple(
            (cls, u / steps) for cls, u in phase.alpha_units)
        phases.extend(Phase(legs, 1, units) for _ in range(steps))
    return replace(plan, phases=tuple(phases))
