"""Step curves (time, value) as the memory timeline records them: each value holds from
its time to the next point's."""

from __future__ import annotations

from collections.abc import Sequence

MAX_POINTS = 2000

Point = list[float]


def downsample(points: Sequence[Sequence[float]], max_points: int = MAX_POINTS) -> list[Point]:
    """At most ``max_points`` points: equal-time bins, each kept as its maximum (at the
    bin's first change) and its last value (at the bin's last change). The result is
    an upper envelope of the curve with the same peak and the same final value."""
    pts = [[float(t), float(v)] for t, v in points]
    if len(pts) <= max_points:
        return pts
    if max_points < 4:
        raise ValueError(f"max_points must be >= 4; got {max_points}")
    bins = (max_points - 1) // 2
    t0, t1 = pts[1][0], pts[-1][0]
    width = (t1 - t0) / bins or 1.0
    out = [pts[0]]
    i, n = 1, len(pts)
    while i < n:
        k = min(int((pts[i][0] - t0) / width), bins - 1)
        j = i
        while j + 1 < n and min(int((pts[j + 1][0] - t0) / width), bins - 1) == k:
            j += 1
        top = max(v for _, v in pts[i:j + 1])
        out.append([pts[i][0], top])
        if j > i and pts[j][1] != top:
            out.append([pts[j][0], pts[j][1]])
        i = j + 1
    return out
