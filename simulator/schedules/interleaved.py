"""Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank,
the bubble v times smaller for v times the pipeline traffic.

The order is Megatron-Core's (``megatron/core/pipeline_parallel/schedules.py``,
``forward_backward_pipelining_with_interleaving``): the micro-batches run in groups of
N = ``microbatch_group_size_per_vp_stage`` (default p, flag
``--microbatch-group-size-per-virtual-pipeline-stage``), each group through chunk 0, then
chunk 1, ...; the last group takes what remains (``get_schedule_table``). Backwards follow
the same table with the chunks reversed. Rank r runs 2 (p − r − 1) + (v − 1) N forwards
as warm-up (``get_pp_rank_microbatches``), all m·v of them when that is as many or more
(``are_all_microbatches_in_warmup``), then one forward and one backward in turn, then the
remaining backwards. Megatron refuses N outside [p, m] and a last group of fewer than p
micro-batches, so with the default N = p, m must be a multiple of p.
"""

from __future__ import annotations

from simulator.schedules.action import Action, Kind, Schedule, check_sizes
from simulator.schedules.spec import Requirement, ScheduleSpec


def schedule_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward a rank runs, in order: groups of ``group``
    micro-batches through every chunk, the last group whatever remains."""
    table = []
    for first in range(0, m, group):
        last = m if first + group >= m else first + group
        table += [(mb, chunk) for chunk in range(v) for mb in range(first, last)]
    return table


def warmup_forwards(p: int, m: int, v: int, rank: int, group: int | None = None) -> int:
    """Megatron-Core's warm-up count: 2 (p − rank − 1) + (v − 1) N, at most m·v."""
    n = p if group is None else group
    return min(2 * (p - rank - 1) + (v - 1) * n, m * v)


def _interleaved_rank(rank: int, p: int, m: int, v: int, group: int) -> tuple[Action, ...]:
    table, total = schedule_table(m, v, group), m * v

    def action(k: int, kind: Kind) -> Action:
        microbatch, chunk = table[k]
        if kind != "F":
            chunk = v - 1 - chunk
        return Action(chunk * p + rank, kind, microbatch)

    warmup = warmup_forwards(p, m, v, rank, group)
    order = [action(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(warmup + k, "F"), action(k, "B")]
    order += [action(k, "B") for k in range(total - warmup, total)]
    return tuple(order)


def group_problem(p: int, m: int, group: int) -> str | None:
    """Why Megatron-Core refuses micro-batch group size ``group``, or None."""
    if not p <= group <= m:
        return f"the micro-batch group size N={group} must lie in [p={p}, m={m}]"
    if 0 < m % group < p:
        return (f"the last micro-batch group holds m mod N = {m % group} < p={p} "
                f"micro-batches (m={m}, N={group})")
    return None


def interleaved_1f1b(p: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Megatron-Core's interleaved 1F1B with v model chunks per rank and micro-batch
    groups of ``group`` (default p)."""
    check_sizes(p, m)
    if v < 2:
        raise ValueError(f"interleaved 1F1B needs v >= 2 chunks per rank; got v={v}")
    n = p if group is None else group
    problem = group_problem(p, m, n)
    if problem is not None:
        raise ValueError(f"interleaved 1F1B: {problem}")
    ranks = tuple(_interleaved_rank(r, p, m, v, n) for r in range(p))
    return Schedule("interleaved", p, m, v, ranks)


def _interleaved_time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Megatron interleaving (Narayanan et al. 2021): the bubble shrinks by v."""
    return (m + (p - 1) / v) * (f + b + w)


def _interleaved_in_flight(p: int, m: int, v: int, stage: int) -> float:
    """Rank r warms up with 2(p − r − 1) + (v − 1)p chunk forwards and holds one more
    at its first backward, each chunk 1/v of the stage (at rank 0: p(1 + (p − 1)/(pv)))."""
    return min(warmup_forwards(p, m, v, stage) + 1, m * v) / v


def _interleaved_requirements(p: int, m: int, v: int) -> list[Requirement]:
    if m % p:
        return [Requirement("microbatches", f"interleaving needs micro-batches per pipeline "
                                            f"(m = {m}) to be a multiple of pp({p})", p)]
    return []


INTERLEAVED = ScheduleSpec(interleaved_1f1b, _interleaved_in_flight, _interleaved_time,
                           chunks=(2, None), requirements=_interleaved_requirements)
