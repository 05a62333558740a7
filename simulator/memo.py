"""Memos keyed by an object's identity, for frozen specs that are costly to hash (a
hardware profile, a GPU): the planner asks the same question of one spec for thousands of
candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

V = TypeVar("V")


def by_identity(table: dict[int, tuple[Any, V]], obj: object, make: Callable[[], V],
                most: int) -> V:
    """What ``make()`` gives for ``obj``, kept in ``table`` under ``id(obj)`` beside
    ``obj`` itself (so the id names no other object while the entry lives); a table of
    ``most`` entries is emptied before the next."""
    held = table.get(id(obj))
    if held is None or held[0] is not obj:
        if len(table) >= most:
            table.clear()
        held = table[id(obj)] = (obj, make())
    return held[1]
