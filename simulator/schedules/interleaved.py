"""Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank,
the bubble v times smaller for v times the pipeline traffic.
"""

from __future__ import annotations

from simulator.schedules.action import Action, Kind, Schedule, check_sizes
from simulator.schedules.spec import Requirement, ScheduleSpec


def _chunk_and_microbatch(k: int, p: int, v: int, *, forward: bool) -> tuple[int, int]:
    """The k-th forward (or backward) of a rank: groups of p micro-batches per chunk."""
    group, offset = divmod(k, p * v)
    chunk = offset // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk, group * p + offset % p


def _interleaved_rank(rank: int, p: int, m: int, v: int) -> tuple[Action, ...]:
    total = m * v

    def action(k: int, kind: Kind) -> Action:
        chunk, microbatch = _chunk_and_microbatch(k, p, v, forward=kind == "F")
        return Action(chunk * p + rank, kind, microbatch)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [action(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(warmup + k, "F"), action(k, "B")]
    order += [action(k, "B") for k in range(total - warmup, total)]
    return tuple(order)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B with v model chunks per rank.

    Rank r warms up with 2 (p - r - 1) + (v - 1) p forwards (at most m v), then
    alternates one forward and one backward. Megatron runs everything as warm-up
    when m == p; this keeps the formula, which yields the same bubble.
    """
    check_sizes(p, m)
    if v < 2:
        raise ValueError(f"interleaved 1F1B needs v >= 2 chunks per rank; got v={v}")
    if m % p != 0:
        raise ValueError(
            f"interleaved 1F1B needs micro-batches m={m} to be a multiple of ranks p={p}"
        )
    ranks = tuple(_interleaved_rank(r, p, m, v) for r in range(p))
    return Schedule("interleaved", p, m, v, ranks)


def _interleaved_time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Megatron interleaving (Narayanan et al. 2021): the bubble shrinks by v."""
    return (m + (p - 1) / v) * (f + b + w)


def _interleaved_in_flight(p: int, m: int, v: int, stage: int) -> float:
    """Rank r warms up with 2(p − r − 1) + (v − 1)p chunk forwards and holds one more
    at its first backward, each chunk 1/v of the stage (at rank 0: p(1 + (p − 1)/(pv)))."""
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v) / v


def _interleaved_requirements(p: int, m: int, v: int) -> list[Requirement]:
    if m % p:
        return [Requirement("microbatches", f"interleaving needs micro-batches per pipeline "
                                            f"(m = {m}) to be a multiple of pp({p})", p)]
    return []


INTERLEAVED = ScheduleSpec(interleaved_1f1b, _interleaved_in_flight, _interleaved_time,
                           chunks=(2, None), requirements=_interleaved_requirements)
