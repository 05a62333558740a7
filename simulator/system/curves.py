"""Curves over a log scale: achievable efficiency over log10(problem size) — GEMM
FLOPs for compute, bytes moved for memory-bound kernels — clamped at both ends, and
the sync costs that grow with a collective's bytes or the compute burst before it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import Field, field_validator

from simulator.system.units import MIN_EFFICIENCY, Frozen


class LogCurve(Frozen):
    """Points (size, value), interpolated in log10(size), flat beyond the ends; a
    subclass bounds the values."""

    LOW: ClassVar[float]
    HIGH: ClassVar[float]
    WHAT: ClassVar[str]
    points: tuple[tuple[float, float], ...] = Field(min_length=1, max_length=1000)

    @field_validator("points", mode="before")
    @classmethod
    def _tuples(cls, pts: Any) -> Any:
        """YAML gives lists; strict validation wants the tuples the type names."""
        if isinstance(pts, list):
            return tuple(tuple(p) if isinstance(p, list) else p for p in pts)
        return pts

    @field_validator("points")
    @classmethod
    def _check(cls, pts: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        sizes = [x for x, _ in pts]
        if any(not 0 < x <= 1e30 for x in sizes) or sizes != sorted(set(sizes)):
            raise ValueError("sizes must lie in (0, 1e30] and strictly increase")
        if any(not cls.LOW <= v <= cls.HIGH for _, v in pts):
            raise ValueError(f"{cls.WHAT} must lie in [{cls.LOW:g}, {cls.HIGH:g}]")
        return pts

    def __call__(self, size: float) -> float:
        return interpolate_log(self.points, size)


class SpreadCurve(LogCurve):
    """How much longer the slowest of n ranks takes the same work than their mean, as a
    relative excess over the rank count n, interpolated in log10(n), flat beyond the
    measured counts."""

    LOW: ClassVar[float] = 0.0
    HIGH: ClassVar[float] = 1.0
    WHAT: ClassVar[str] = "excesses"


class HostLine(Frozen):
    """Host time of one call as a line in its bytes: ``us + us_per_mib · MiB``."""

    us: float = Field(ge=0, le=1e7)
    us_per_mib: float = Field(default=0.0, ge=0, le=1e7)

    def seconds(self, nbytes: float) -> float:
        return (self.us + self.us_per_mib * max(nbytes, 0.0) / (1 << 20)) * 1e-6


class EfficiencyCurve(LogCurve):
    """Achieved / peak as a function of problem size, interpolated in log10(size)."""

    LOW: ClassVar[float] = MIN_EFFICIENCY
    HIGH: ClassVar[float] = 1.0
    WHAT: ClassVar[str] = "efficiencies"


class SyncCurve(LogCurve):
    """A sync cost in µs as a function of the collective's bytes, interpolated in
    log10(bytes), flat beyond the measured sizes."""

    LOW: ClassVar[float] = 0.0
    HIGH: ClassVar[float] = 1e9
    WHAT: ClassVar[str] = "sync costs (µs)"


class BurstCurve(LogCurve):
    """What a collective after a compute burst costs beyond the sync cost after the
    calibration's own burst, µs, as a function of the burst (seconds of compute on the
    rank since its previous collective), interpolated in log10(seconds), flat beyond
    the measured bursts: 0 at the calibration's burst, growing after longer ones,
    negative (a discount, at most the sync cost itself) after shorter ones where the
    calibration measured them, and without them no discount."""

    LOW: ClassVar[float] = -1e6  # a discount of up to a second
    HIGH: ClassVar[float] = 1e9
    WHAT: ClassVar[str] = "sync costs (µs)"


def known_keys(data: Any, known: Sequence[str], what: str) -> Any:
    """``data`` unchanged when it is a mapping whose keys all lie in ``known``; else a
    ValueError naming the first unknown key, the nearest known one and the choices."""
    if isinstance(data, dict):
        for key in data:
            if key not in known:
                import difflib

                near = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean '{near[0]}'? " if near else ""
                raise ValueError(f"unknown {what} '{key}'; {hint}use one of {', '.join(known)}")
    return data


def interpolate_log(points: Sequence[tuple[float, float]], size: float) -> float:
    """Piecewise-linear in log10(size) through ``points`` (sorted by size), clamped at
    both ends: the one rule every efficiency curve follows, calibrated or preset."""
    if size <= points[0][0]:
        return points[0][1]
    if size >= points[-1][0]:
        return points[-1][1]
    lx = math.log10(size)
    for (x0, e0), (x1, e1) in itertools.pairwise(points):
        if size <= x1:
            w = (lx - math.log10(x0)) / (math.log10(x1) - math.log10(x0))
            return e0 + w * (e1 - e0)
    return points[-1][1]  # unreachable: size < points[-1][0] here
