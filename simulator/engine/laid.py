"""The spans of laid copies a chain priced at once, written after the run.

A chain that reaches a laid copy whose steps are all runs leading into one plan's
collective (:class:`simulator.engine.blocks.Block`) carries only the time through them
(:func:`simulator.engine.chains.forward`) — per step a run's end ``t0 = t + total``,
the wait for it, the flow alone on its private link and its α — and keeps where it
started and ended (``Engine.priced``). Nothing reads the spans before the run is over,
so they are written here, every copy of a block at once: the same additions, in the
same order, as one accumulation along each copy's row (``numpy.add.accumulate`` adds
left to right), ``t + total`` then ``+ alone`` then ``+ α`` per step. That is the
chain's own arithmetic where its wait added nothing but the run's end
(``t + (t0 - t) == t0``, with ``t0 >= t``) — checked for every step, and each row's last
time held to the chain's; a row where either fails is priced again step by step, as
the chain did. ``tests/test_chain_blocks.py`` holds every span to the step-by-step
pricing.

Nothing here knows what a transformer is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from simulator.engine.blocks import Block
    from simulator.engine.engine import Engine


def settle(e: Engine) -> None:
    """Write the spans of every laid copy priced at once (``e.priced``, then emptied):
    each run's start, each collective's arrival (``start``), transfer start (``begin``)
    and end."""
    groups: dict[tuple[int, int, float, float], list[tuple[Any, ...]]] = {}
    for row in e.priced:
        groups.setdefault((id(row[0]), id(row[1]), row[6], row[7]), []).append(row)
    e.priced = []
    views = tuple(np.frombuffer(a, np.float64) for a in (e.run_t0, e.start, e.begin, e.end))
    arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # an instance's ids, totals
    for rows in groups.values():
        inst = rows[0][0]
        got = arrays.get(id(inst))
        if got is None:
            got = arrays[id(inst)] = inst.id_array(), inst.total_array()
        _settle(e, rows, views, *got)


def _settle(e: Engine, rows: list[tuple[Any, ...]], views: tuple[np.ndarray, ...],
            ids: np.ndarray, totals: np.ndarray) -> None:
    """The copies of one block of one instance, priced with one α and flow duration
    (``ids``, ``totals``: the instance's as arrays): one column per copy, accumulated
    down its steps' additions."""
    inst, blk, _, _, _, _, alone, alpha = rows[0]
    run_t0, starts, begin, ends = views
    _, _, ps, rs, firsts, lasts, _, _ = zip(*rows, strict=True)
    n = len(blk.leads)
    runs = np.asarray(blk.leads, np.int64)[:, None] + np.asarray(rs, np.int64)
    add = np.empty((3 * n + 1, len(rows)))
    add[0] = firsts
    add[1::3] = totals[runs]
    add[2::3] = alone
    add[3::3] = alpha
    t = np.add.accumulate(add, axis=0)
    before, arrive, end = t[0:3 * n:3], t[1::3], t[3::3]
    ok = _exact(before, arrive, t[-1], np.asarray(lasts))
    # the chain's waits (``t0 - t > 0``, an event each: :func:`chains._block`)
    e.merged += int(np.count_nonzero(arrive[:, ok] > before[:, ok]))
    gids = ids[np.asarray(blk.at, np.int64)[:, None] + np.asarray(ps, np.int64)[ok]]
    run_t0[inst.run_base + runs[:, ok]] = before[:, ok]
    starts[gids] = arrive[:, ok]
    begin[gids] = arrive[:, ok]
    ends[gids] = end[:, ok]
    for row, good in zip(rows, ok.tolist(), strict=True):
        if not good:
            _step_by_step(e, row)


def _exact(before: np.ndarray, arrive: np.ndarray, last: np.ndarray,
           chained: np.ndarray) -> np.ndarray:
    """Per copy (column), whether its accumulation is the chain's arithmetic: every wait
    added the run's end exactly (``t + (t0 - t) == t0``, ``t0 >= t``) and its last time
    is the chain's (``chained``)."""
    return ((arrive >= before) & (before + (arrive - before) == arrive)).all(axis=0) \
        & (last == chained)


def _step_by_step(e: Engine, row: tuple[Any, ...]) -> None:
    """One laid copy's spans priced as the chain priced it, step by step."""
    inst, blk, p, r, t, _, alone, alpha = row
    b: Block = blk
    totals, ids = inst.totals, inst.ids
    for lead, a in zip(b.leads, b.at, strict=True):
        e.run_t0[inst.run_base + r + lead] = t
        t0 = t + totals[r + lead]
        wait = t0 - t
        if wait > 0:
            t = t + wait
            e.merged += 1  # as the chain counted it (:func:`_settle`)
        gid = ids[a + p]
        e.begin[gid] = t
        t = t + alone + alpha
        e.start[gid], e.end[gid] = t0, t
