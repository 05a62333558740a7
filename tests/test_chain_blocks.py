"""A laid copy priced in one loop (:func:`simulator.engine.chains._block`) against the
same steps priced one by one (:func:`simulator.engine.chains._walk`).

Where a chain reaches a laid copy whose steps are all runs leading into one plan's
collective (:class:`simulator.engine.blocks.Block`), the chain carries the time through
them in one loop, with the link's busy seconds summed in a local, and their spans are
written after the run, every copy of a block at once (:mod:`simulator.engine.laid`), or
step by step where a copy's row fails its check. Every span, collective start, last
arrival, link busy second (in the network's order), flow count and report figure must be
what the step-by-step pricing of the same build and compile gives, to the bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.builder.workload import build_workload
from simulator.engine import blocks, chains, laid
from simulator.engine.blocks import Block, block
from simulator.engine.compile import COLL, RUN, laid_layout, run_layout
from simulator.engine.engine import Engine
from tests.test_chains import LAYOUTS, _scenario, same_figures
from tests.test_lazy_copies import _compare as lazy_vs_eager
from tests.test_lazy_copies import accepted


def _run(s: Any, blocks: bool) -> tuple[Engine, Any, int]:
    """A folded run with laid copies priced at once (``blocks``) or step by step; how
    many copies were priced at once."""
    priced = [0]
    real = chains._block

    def counted(*args: Any) -> Any:
        got = real(*args) if blocks else None
        priced[0] += got is not None
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chains, "_block", counted)
        e = Engine(build_workload(s, fidelity="folded"), s.hardware)
        return e, e.run(), priced[0]


def _compare(s: Any, *, rows: bool = True) -> int:
    """Blocks priced at once against step by step (``rows`` False: every block's spans
    written step by step after the run, as a row that fails the check would be)."""
    with pytest.MonkeyPatch.context() as mp:
        if not rows:
            mp.setattr(laid, "_exact", lambda before, *_: np.zeros(before.shape[1], bool))
        ea, a, priced = _run(s, True)
    eb, b, none = _run(s, False)
    assert none == 0
    assert ea.merged == eb.merged and a.events == b.events
    same_figures(s, ea, a, eb, b)
    return priced


#: layouts with one stream a rank (no collective beside the compute holds SMs, so runs
#: lead into collectives), and GPUs a node that keep each TP group inside one node and
#: its pipeline's sends between nodes (so TP's links are private): their laid copies
#: are priced at once
ONE_STREAM = [
    ({"tp": 2, "pp": 2, "dp": 1}, 2),
    ({"tp": 2, "pp": 4, "dp": 1}, 2),
    ({"tp": 4, "pp": 2, "dp": 1, "schedule": "interleaved", "virtual_stages": 2}, 4),
]


@pytest.mark.parametrize(("parallel", "gpus_per_node"), ONE_STREAM,
                         ids=["pp2", "pp4", "interleaved"])
def test_a_pipeline_prices_its_laid_copies_at_once_and_runs_the_same(
        parallel: dict[str, Any], gpus_per_node: int) -> None:
    """Eight micro-batches: copies are laid and priced at once, to the same figures."""
    s = _scenario(parallel, gpus_per_node=gpus_per_node, batch=8)
    assert _compare(s) > 0
    assert _compare(s, rows=False) > 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parallel=st.one_of(LAYOUTS, st.sampled_from([p for p, _ in ONE_STREAM])),
       gpus_per_node=st.sampled_from([2, 4, 8]),
       batch=st.integers(2, 8))
def test_blocks_change_no_figure(parallel: dict[str, Any], gpus_per_node: int,
                                 batch: int) -> None:
    _compare(accepted(parallel, gpus_per_node, batch))


def test_block_takes_only_runs_into_one_collective() -> None:
    """A kept copy's steps form a block only where each is a run leading into the same
    plan's collective, none waits on a task and none but the last is waited on."""
    phases: Any = [([("nvl", 1.0)], 1e-6)]
    steps = [(COLL, (), 1, phases, 0, None, 0, 0), (COLL, (), 3, phases, 0, None, 1, 1)]
    assert block(steps) == Block(phases, 0, [0, 1], [1, 3])
    other: Any = [([("nvl", 1.0)], 1e-6)]
    for bad in [(RUN, (), 2, -1, True, None, 0, -1),  # a run of its own
                (COLL, (), 3, phases, 0, None, 0, -1),  # no run leads into it
                (COLL, (), 3, other, 0, None, 0, 1),  # another plan
                (COLL, (), 3, phases, 1, None, 0, 1),  # another group
                (COLL, (7,), 3, phases, 0, None, 0, 1)]:  # a dependency
        assert block([steps[0], bad]) is None
    waited = (COLL, (), 1, phases, 0, None, 1, 0)  # waited on, not last
    assert block([waited, steps[1]]) is None
    assert block([]) is None


def test_a_copy_a_run_enters_is_laid_with_the_copy_before_it() -> None:
    """The first stage's forward follows its backward, whose last compute runs on into
    it (the last stage's backward its forward likewise): the two copies are laid as a
    pair, left unmade, and every figure and task is the eager build's."""
    s = _scenario({"tp": 2, "pp": 2, "dp": 1}, gpus_per_node=2, batch=8)
    pairs = []
    real = blocks.Blocks.lay

    def lay(self: blocks.Blocks, key: tuple[Any, ...], p: int) -> bool:
        laid = real(self, key, p)
        if laid and len(key) == 4:  # (record, dependents) of each of two copies
            pairs.append(p)
        return laid

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks.Blocks, "lay", lay)
        lazy_vs_eager(s)
    assert len(pairs) > 2


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=6),
       st.lists(st.integers(0, 5), min_size=1, max_size=12), st.data())
def test_laid_layout_is_the_runs_moved(kept: list[tuple[int, int]], order: list[int],
                                       data: st.DataObject) -> None:
    """:func:`simulator.engine.compile.laid_layout` against :func:`run_layout` of the
    same runs, each laid one moved to its position: the same three arrays."""
    rel = [range(a, a + n) for n, a in kept]  # one kept list of runs, relative
    runs: list[range] = []
    moved: list[tuple[int, int, int]] = []
    rels: list[list[range]] = []
    absolute: list[range] = []
    for k in order:
        if k == 0:  # a run compiled where it is
            at = data.draw(st.integers(0, 100))
            runs.append(range(at, at + k + 1))
            absolute.append(runs[-1])
            continue
        at = data.draw(st.integers(0, 1000))
        moved.append((len(runs), len(rel), at))
        rels.append(rel)
        runs += rel
        absolute += [range(r.start + at, r.stop + at) for r in rel]
    got = laid_layout(runs, moved, rels)
    want = run_layout(absolute)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype
               for x, y in zip(got, want, strict=True))
