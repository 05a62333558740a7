"""A run's timeout and its tasks' offsets (:func:`simulator.engine.compile.run_sums`)
against summing task by task.

The engine holds a run of compute tasks for their durations summed in order
(``total = 0.0``, then ``total += d`` per task) and gives each task the sum before it.
``run_sums`` does these additions as one vector addition per position in a run, over
every run at least that long, and finishes the few longest runs one by one; the
floating-point additions and their order are the same, so every figure must equal the
plain loop's bit for bit, whatever the runs' lengths and durations.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.engine.compile import VECTOR, run_layout, run_sums

DURATION = st.one_of(st.floats(0.0, 1e3, allow_nan=False), st.just(0.0), st.just(-0.0),
                     st.floats(1e-12, 1e-6), st.just(1e17))


def _loop(runs: list[list[int]], durations: list[float]) -> tuple[list[str], list[str]]:
    """The engine's sums as it first computed them: one Python addition per task."""
    totals, prefix = [], []
    for run in runs:
        total = 0.0
        for i in run:
            prefix.append(total.hex())
            total += durations[i]
        totals.append(total.hex())
    return totals, prefix


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(1, 3), st.integers(1, VECTOR + 40)),
                        min_size=0, max_size=3 * VECTOR), data=st.data())
def test_vector_sums_equal_the_loop(lengths: list[int], data: st.DataObject) -> None:
    n = sum(lengths)
    durations = data.draw(st.lists(DURATION, min_size=n, max_size=n))
    order = data.draw(st.permutations(range(n)))  # runs need not be in index order
    runs, k = [], 0
    for length in lengths:
        runs.append(order[k:k + length])
        k += length
    totals, prefix = run_sums(run_layout(runs), durations)
    assert ([float(x).hex() for x in totals], [float(x).hex() for x in prefix]) == \
        _loop(runs, durations)


def test_many_long_runs_go_through_the_vector_path() -> None:
    """Enough runs longer than :data:`VECTOR` that every position is one vector
    addition, and a single long run that is summed alone."""
    rng = np.random.default_rng(7)
    for lengths in ([VECTOR + 5] * (VECTOR + 1), [1] * VECTOR + [500]):
        n = sum(lengths)
        durations = (rng.random(n) * 10.0 ** rng.integers(-9, 3, n)).tolist()
        runs, k = [], 0
        for length in lengths:
            runs.append(range(k, k + length))
            k += length
        totals, prefix = run_sums(run_layout(runs), durations)
        assert ([float(x).hex() for x in totals], [float(x).hex() for x in prefix]) == \
            _loop([list(r) for r in runs], durations)
