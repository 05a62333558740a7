"""The planner's terms memo: each term of the memory model and the estimate, looked up
by the candidate's knobs the term reads.

:func:`~simulator.analysis.memory.stage_breakdown` and
:func:`~simulator.analysis.analytic.estimate.analytic_estimate` ask for their costlier
terms by name and stage through a :class:`~simulator.analysis.priced.Price`. Each term
reads a few of a candidate's knobs: a stage's parameter states and the DP reduction do
not read the micro-batch, the recomputation or sequence parallelism; the activations and
the pipeline phase do not read the ZeRO stage or the hybrid-sharding degree. The
thousands of candidates of a plan that differ only in knobs a term does not read share
it: :class:`TermsMemo` keys each term by the stage and the candidate's every knob but
those :data:`IGNORES` names for it, so a knob a strategy registers later is part of
every key, and a term not named there is computed afresh. ``tests/test_plan_terms.py``
holds each term equal over the candidates that differ only in the knobs its key leaves
out, and ``tests/test_plan_fast.py`` every row to the one computed without the memo.

The memo is kept per process and per plan (:func:`memo`, beside the layer terms of
:mod:`simulator.search.shared`), emptied at :data:`MOST` entries.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, TypeVar

from simulator.analysis.priced import Price
from simulator.search.candidates import Candidate

T = TypeVar("T")

#: what the parameter states and their reduction do not read: the layer's knobs that
#: change its compute and activations but not its parameters
NOT_PARAMS = frozenset({"micro_batch", "recompute", "recompute_modules",
                        "sequence_parallel", "cp_comm", "cp_a2a"})
#: what the activations and the pipeline's compute do not read: how the states shard
NOT_SHARDING = frozenset({"zero", "dp_shard"})

#: what the CUDA context and the cuBLAS workspaces read of a candidate: the pipeline's
#: depth alone (which system a stage runs on)
ONLY_PP = frozenset({"tp", "cp", "dp", "ep", "schedule", "virtual_stages", "zero", "recompute",
                     "recompute_modules", "sequence_parallel", "micro_batch", "cp_comm",
                     "cp_a2a", "dispatcher", "dp_shard"})

#: the knobs each memoised term does not read, by the name the memory model and the
#: estimate ask for it (:mod:`simulator.analysis.priced`)
IGNORES: dict[str, frozenset[str]] = {
    "states": NOT_PARAMS,
    "activations": NOT_SHARDING,
    "cuda context": ONLY_PP,
    "cuBLAS workspaces": ONLY_PP,
    "NCCL buffers": NOT_PARAMS,
    "allocator rounding": NOT_SHARDING | {"cp_comm", "cp_a2a"},
    "pipeline": NOT_SHARDING,
    "gradients": NOT_PARAMS,
    "optimizer": NOT_PARAMS,
    # the model's and the executed FLOPs (the recomputation, by stage) and the GPUs
    "mfu ceiling": ONLY_PP - {"schedule", "virtual_stages", "recompute", "recompute_modules"},
}
MOST = 400_000  # entries kept in one process (a few hundred MB at most)


def key_picker(names: tuple[str, ...], ignored: frozenset[str]
               ) -> Callable[[Candidate], Any]:
    """What of a candidate (whose knobs are ``names``) a term that ignores ``ignored``
    is keyed by: the values of every other knob."""
    return operator.itemgetter(*(i for i, k in enumerate(names) if k not in ignored))


class TermsMemo:
    """One plan's memoised terms in this process, keyed by (term, stage, the knobs it
    reads)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.table: dict[tuple[Any, ...], Any] = {}
        self._picks = {name: key_picker(names, ignored) for name, ignored in IGNORES.items()}

    def price(self, cand: Candidate) -> Price:
        """The :class:`~simulator.analysis.priced.Price` of candidate ``cand``."""
        return _Priced(self, cand)

    def lookup(self, cand: Candidate, name: str, stage: int, compute: Callable[[], T]) -> T:
        """Term ``name`` of ``stage`` for candidate ``cand``, ``compute()`` unless known."""
        pick = self._picks.get(name)
        if pick is None:
            return compute()
        key = (name, stage, pick(cand))
        try:
            return self.table[key]
        except KeyError:
            if len(self.table) >= MOST:
                self.table.clear()
            out = self.table[key] = compute()
            return out


class _Priced:
    """:meth:`TermsMemo.lookup` for one candidate: a :class:`~simulator.analysis.priced.Price`."""

    def __init__(self, memo: TermsMemo, cand: Candidate) -> None:
        self.memo, self.cand = memo, cand

    def __call__(self, name: str, stage: int, compute: Callable[[], T]) -> T:
        return self.memo.lookup(self.cand, name, stage, compute)


@functools.lru_cache(maxsize=4)
def memo(key: str, names: tuple[str, ...]) -> TermsMemo:
    """The terms memo of the plan whose base scenario has
    :func:`~simulator.search.shared.base_key` ``key``, kept in this process."""
    del key  # the key only tells plans apart
    return TermsMemo(names)
