"""The schedules by name. :data:`SCHEDULES` is the one place that lists them; a new
schedule is a module with its builder and :class:`~simulator.schedules.spec.ScheduleSpec`
and one entry here. Everything else reads the registry at call time.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from simulator.schedules.action import Schedule
from simulator.schedules.dualpipe import DUALPIPE
from simulator.schedules.gpipe import GPIPE
from simulator.schedules.interleaved import INTERLEAVED
from simulator.schedules.one_f_one_b import ONE_F_ONE_B
from simulator.schedules.spec import Requirement, ScheduleSpec
from simulator.schedules.zb_h1 import ZB_H1
from simulator.schedules.zbv import ZBV

#: name -> schedule, in the order the schema lists them
SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType({
    "gpipe": GPIPE,
    "1f1b": ONE_F_ONE_B,
    "interleaved": INTERLEAVED,
    "zb-h1": ZB_H1,
    "zbv": ZBV,
    "dualpipe": DUALPIPE,
})
#: the schedule a scenario runs when it names none (and the one a single stage runs)
DEFAULT_SCHEDULE = "1f1b"


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule ``name``, or ValueError naming the valid ones."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}")
    return spec


def requirements(name: str, p: int, m: int, v: int) -> list[Requirement]:
    """What (p, m, v) must change for schedule ``name``; empty when it can run."""
    spec = schedule_spec(name)
    lo, hi = spec.chunks
    if v > 1 and hi == 1:
        chunked = " or ".join(n for n, other in SCHEDULES.items() if other.chunked)
        out = [Requirement("virtual_stages", f"> 1 only with schedule: {chunked} (schedule is "
                                             f"{name}); set virtual_stages: 1 or schedule: "
                                             f"{chunked}")]
    elif lo == hi and v != lo:
        out = [Requirement("virtual_stages", f"{name} needs virtual_stages: {lo}")]
    elif v < lo or (hi is not None and v > hi):
        most = "" if hi is None else f" and <= {hi}"
        out = [Requirement("virtual_stages", f"{name} needs virtual_stages >= {lo}{most}")]
    else:
        out = []
    return out + spec.requirements(p, m, v)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build the schedule registered as ``name``; only one with chunks takes v > 1."""
    spec = schedule_spec(name)
    if not spec.chunked and v != 1:
        raise ValueError(f"schedule {name!r} has one chunk per rank; got v={v}")
    lo, hi = spec.chunks
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"schedule {name!r} runs {lo} to {hi or 'any'} chunks per rank; "
                         f"got v={v}")
    return spec.build(p, m, v)
