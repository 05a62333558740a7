"""Interval algebra over ``[start, end)`` pairs: union, difference, intersection, length.

Busy time is the length of a union (two kernels of one class on two streams count
once); exposed communication is communication minus compute. Every function takes and
returns sorted, disjoint lists except :func:`union`, which makes one from any pairs.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of ``[start, end)`` intervals (empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a`` minus ``b``; both sorted and disjoint."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a`` within ``b``; both sorted and disjoint."""
    return subtract(a, subtract(a, b))
