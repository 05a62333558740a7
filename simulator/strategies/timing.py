"""Closed-form timing the strategies' analytic terms share: a collective's uncontended
time on the scenario's layout (its plan as ``simulation.collective_algorithm`` and the
stack's NCCL version choose it), how much slower compute runs while it is in flight
(``gpu.interference``, or the SMs NCCL's kernels hold), and what that costs the
compute it overlaps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from simulator.memo import by_identity
from simulator.spec.scenario import Scenario
from simulator.system.collectives.channels import sm_factor
from simulator.system.collectives.choice import make_plan
from simulator.system.collectives.cost import estimate
from simulator.system.collectives.plan import GroupShape, Plan
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout
from simulator.system.units import CollectiveName

#: Uncontended times already priced, per hardware profile (held beside them, so its id
#: names no other profile while they are kept; a profile is frozen): a planner prices
#: the same collective for thousands of candidates.
_PRICED: dict[int, tuple[HardwareProfile, dict[tuple[Any, ...], float]]] = {}
_PRICED_MOST = 200_000  # entries per profile before they are dropped


def _priced(hw: HardwareProfile) -> dict[tuple[Any, ...], float]:
    return by_identity(_PRICED, hw, dict, 8)


def _memo(s: Scenario, layout: Layout, op: CollectiveName, size: float,
          group: tuple[int, ...], hw: HardwareProfile, what: str,
          figure: Callable[[Plan], float]) -> float:
    """``figure`` of the collective's plan (``what`` names it in the key), priced once
    per hardware profile."""
    shape = GroupShape(len(group), len(group) // layout.domains_spanned(group))
    key = (what, op, size, shape, s.simulation.collective_algorithm, s.stack.nccl_version)
    priced = _priced(hw)
    value = priced.get(key)
    if value is None:
        plan = make_plan(op, size, shape, key[4], hw, key[5])
        if len(priced) >= _PRICED_MOST:
            priced.clear()
        value = priced[key] = figure(plan)
    return value


def collective_time(s: Scenario, layout: Layout, op: CollectiveName, size: float,
                     group: tuple[int, ...], hw: HardwareProfile) -> float:
    if len(group) <= 1 or size <= 0:
        return 0.0
    return _memo(s, layout, op, size, group, hw, "time", lambda plan: estimate(plan, hw))


def interference(s: Scenario, layout: Layout, op: CollectiveName, size: float,
                  group: tuple[int, ...], hw: HardwareProfile) -> float:
    """How many times slower compute runs while this collective is in flight: the
    largest ``gpu.interference`` of the link classes its plan crosses and of the SMs
    its kernels hold (:func:`simulator.system.collectives.channels.sm_factor`); 1 where
    transfers run in line with compute, as the engine has it."""
    gpu = hw.gpu
    if len(group) <= 1 or size <= 0 or not gpu.comm_overlaps_compute \
            or not (gpu.interference or gpu.sms):
        return 1.0
    return _memo(s, layout, op, size, group, hw, "slows", lambda plan: max(
        sm_factor(plan, gpu), *(gpu.interference_factor(leg.link_class)
                                for phase in plan.phases for leg in phase.legs)))


def stretch(t_comm: float, window: float, factor: float) -> float:
    """What a transfer of ``t_comm`` adds to the ``window`` of compute it overlaps when
    that compute runs ``factor`` times slower while it is in flight: (f − 1) × the work
    done meanwhile, min(window, t_comm / f)."""
    if factor <= 1.0 or window <= 0 or t_comm <= 0:
        return 0.0
    return (factor - 1.0) * min(window, t_comm / factor)
