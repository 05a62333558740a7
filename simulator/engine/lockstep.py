"""Lock-step groups: at full fidelity, each tensor-parallel group simulated as one rank.

The TP ranks of a group run the same program (their stage's prototype,
:mod:`simulator.builder.program`) and meet at every one of the group's collectives.
Where nothing tells them apart — no slow GPU, no jitter, no degraded port, no
mixed-generation stage, task objects nobody edited, a network of their own (not a
colocation's) and NVLink domains that hold whole TP groups or that whole TP groups
span (so every rank's peers in other groups sit behind the same link classes as its
TP peers' do) — they arrive at each collective at the same instant, and every flow
of one is the image of the other's on its own links. The engine then runs the
group's first rank (TP index 0) alone: its TP collectives have one simulated
member and its flows stand for the group's ``tp`` flows on shared links (the weight
symmetry folding gives a representative, :mod:`simulator.system.network`); its DP,
PP, CP and tied-embedding peers are the other groups' first ranks, simulated as
before. After the run, each rank's spans are its group's first rank's, moved by
the id offset of its TP index (:func:`expand`): the same numbers the per-rank run
computes, bit for bit (``tests/test_lockstep.py`` compares every span, collective
start and report figure over TP, sequence parallelism, pipeline schedules, DP,
ZeRO-3 and context parallelism, and each fallback). One thing is a convention,
not a time: at a TP group's own collectives every member arrives at the same
instant, and the member named as the last arrival is, in the per-rank run,
whichever registered last in SimPy's queue; here it is TP index ``tp - 1``. Link
busy seconds are summed over the same links in another order (equal to 1e-12).

Nothing here knows what a transformer is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from simulator.builder.program import TaskView

if TYPE_CHECKING:
    from simulator.builder.program import SharedPrograms
    from simulator.builder.tasks import Workload


def lockstep_size(w: Workload, alone: bool) -> int:
    """The ranks one simulated rank stands for: the TP degree where every TP group of
    ``w`` provably runs in lock-step, else 1 (every rank simulated). ``alone``: the
    engine owns its network (no other job's flows on it)."""
    shared = w.shared
    if shared is None or not alone:  # every rank built (MoE, groups that do not share)
        return 1
    lay = shared.layout
    tp, ds = lay.tp, lay.domain_size
    if tp == 1 or w.weights is not None or w.link_factors or shared.factors:
        return 1  # per-rank compute factors, degraded or mixed-generation ports
    if isinstance(w.tasks, TaskView) and w.tasks.made():
        return 1  # task objects made (and maybe edited) for some ranks
    if ds % tp and tp % ds:  # a domain boundary inside a TP group
        return 1
    return tp


def lockstep_ranks(w: Workload, lock: int) -> set[int]:
    """The ranks simulated: each lock-step group's first, else every rank of ``w``."""
    return set(range(0, w.layout.world, lock)) if lock > 1 else set(w.programs)


def tp_collectives(shared: SharedPrograms, stage: int) -> np.ndarray:
    """Local indices of the stage prototype's collectives over its TP group."""
    lay = shared.layout
    group = lay.tp_group(stage * lay.per_stage)
    return np.fromiter((i for i, t in enumerate(shared.protos[stage])
                        if t.plan is not None and t.dst < 0 and t.group == group), np.int64)


def expand(shared: SharedPrograms, lock: int, start: np.ndarray, end: np.ndarray,
           begin: np.ndarray, last: np.ndarray) -> None:
    """Fill, in place, every rank's spans from its lock-step group's first rank's.

    Ids run rank by rank, TP index fastest, so a stage's block of ids is an array
    (groups, TP index, local index). ``begin`` (a collective's transfer start) is the
    first rank's; ``last`` (the member task that arrived last) moves with the rank,
    and at the group's own collectives, where all arrive together, the per-rank run's
    rendezvous names the last member to register (TP index ``lock - 1``, which runs
    the transfer and names no one)."""
    base = np.asarray(shared.base, np.int64)
    lengths = np.diff(base) // shared.layout.per_stage  # per stage, its prototype's tasks
    for q in range(shared.layout.pp):
        lo, hi, n = int(base[q]), int(base[q + 1]), int(lengths[q])
        for arr in (start, end, begin):
            block = arr[lo:hi].reshape(-1, lock, n)
            block[:, 1:, :] = block[:, :1, :]
        block = last[lo:hi].reshape(-1, lock, n)
        first = block[:, 0, :]
        known = first >= 0
        # a member of another stage (a tied embedding's group) moves by its stage's length
        step = lengths[np.searchsorted(base, first, side="right") - 1]
        for k in range(1, lock):
            block[:, k, :] = np.where(known, first + k * step, -1)
        coll = tp_collectives(shared, q)
        if len(coll):
            ids = (np.arange(block.shape[0], dtype=np.int64)[:, None] * lock + lock - 1) * n \
                + lo + coll[None, :]
            block[:, :lock - 1, :][:, :, coll] = ids[:, None, :]
            block[:, lock - 1, coll] = -1
