"""The accounting's vocabulary: the category names every output uses, and nothing else.

Compute categories, one transfer and one peer-wait category per communication kind,
and the idle ones. The communication kinds are the strategies' (each declares the kinds
its tasks carry, :mod:`simulator.strategies.base`): the built-in ones in the display
order below, then any kind a strategy registered beside them adds
(:func:`comm_kinds`). A kind is a category's prefix, ``tp_transfer``, ``tp_wait``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from simulator.builder.tasks import Task
from simulator.strategies import registry
from simulator.strategies.base import Strategy

COMPUTE_CATEGORIES = ("forward", "backward_input", "backward_weight", "recompute", "optimizer")
#: The built-in strategies' communication kinds, in display order.
COMM_KINDS = ("tp", "pp", "dp", "zero", "offload", "embedding_tie", "ep", "cp")
COMM_CATEGORIES = tuple(f"{k}_{part}" for k in COMM_KINDS for part in ("transfer", "wait"))
#: Peer-wait: at a collective until its last member arrives (waiting for the slowest rank).
WAIT_CATEGORIES = tuple(f"{k}_wait" for k in COMM_KINDS)
IDLE_CATEGORIES = ("pipeline_bubble", "imbalance_idle", "tail")
#: Every category of the built-in strategies, in display order. Each rank's entries sum to
#: the step time.
CATEGORIES = COMPUTE_CATEGORIES + COMM_CATEGORIES + IDLE_CATEGORIES
#: Task kinds that are compute (the rest are communication kinds or the optimizer).
COMPUTE_KINDS = frozenset({"forward", "backward", "weight_grad", "recompute"})
KIND_CATEGORY = {"forward": "forward", "weight_grad": "backward_weight",
                 "recompute": "recompute", "optimizer": "optimizer"}
PIPELINE = "pipeline"  # pipeline idle before it is split into bubble and imbalance


@dataclass(frozen=True)
class Vocabulary:
    """The categories of one registry: its kinds, categories, and each category's column
    in the breakdown's arrays (with :data:`PIPELINE` last)."""

    kinds: tuple[str, ...]
    categories: tuple[str, ...]
    column: dict[str, int]
    kind_code: dict[str, int]  # forward 0 ... optimizer 4, then the kinds from 5
    own_column: np.ndarray
    transfer_column: np.ndarray
    wait_column: np.ndarray
    kind_set: frozenset[str]

    @property
    def waits(self) -> tuple[str, ...]:
        return tuple(f"{k}_wait" for k in self.kinds)


@lru_cache(maxsize=8)
def _vocabulary(strategies: tuple[Strategy, ...]) -> Vocabulary:
    extra = (k for s in strategies for k in s.kinds if k not in COMM_KINDS)
    kinds = COMM_KINDS + tuple(dict.fromkeys(extra))
    comm = tuple(f"{k}_{part}" for k in kinds for part in ("transfer", "wait"))
    cats = COMPUTE_CATEGORIES + comm + IDLE_CATEGORIES
    column = {c: i for i, c in enumerate((*cats, PIPELINE))}
    code = {"forward": 0, "backward": 1, "weight_grad": 2, "recompute": 3, "optimizer": 4,
            **{k: 5 + i for i, k in enumerate(kinds)}}
    own = np.array([column[c] for c in COMPUTE_CATEGORIES], dtype=np.int64)
    return Vocabulary(kinds, cats, column, code, own,
                      np.array([column[f"{k}_transfer"] for k in kinds], dtype=np.int64),
                      np.array([column[f"{k}_wait"] for k in kinds], dtype=np.int64),
                      frozenset(kinds))


def vocabulary() -> Vocabulary:
    """The vocabulary of the strategies registered now."""
    return _vocabulary(registry.strategies())


def comm_kinds() -> tuple[str, ...]:
    """Every communication kind: the built-in ones, then any a strategy adds."""
    return vocabulary().kinds


def categories() -> tuple[str, ...]:
    """Every category, in display order (:data:`CATEGORIES` and a strategy's own)."""
    return vocabulary().categories


def label(category: str) -> str:
    """Display name: ``tp_transfer`` → ``tp transfer``, ``embedding_tie_wait`` →
    ``embedding-tie wait``."""
    return category.replace("embedding_tie", "embedding-tie").replace("_", " ")


def is_comm(task: Task) -> bool:
    return task.kind in vocabulary().kind_set


def comm_category(task: Task, part: str) -> str:
    return f"{task.kind}_{part}"


def own_categories(task: Task, start: float, end: float, begin: float) -> list[tuple[str, float]]:
    """The categories of a task's own span; ``begin`` is when its transfer started."""
    if is_comm(task):
        wait = max(0.0, min(begin, end) - start)
        return [(comm_category(task, "wait"), wait), (comm_category(task, "transfer"), end - start
                                                      - wait)]
    if task.kind == "backward":
        w = min(task.weight_s, end - start)
        return [("backward_input", end - start - w), ("backward_weight", w)]
    return [(KIND_CATEGORY.get(task.kind, "optimizer"), end - start)]
