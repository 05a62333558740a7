"""What the simulator knows of one schedule (:class:`ScheduleSpec`): how to build it,
what it requires of (p, m, v), its peak in-flight micro-batches per stage, the
micro-batches whose logits the last stage holds, its closed-form pipeline time and its
traits (whether it splits the backward, how many chunks a rank runs, whether it flushes
with p − 1 idle slots per stage). Callers ask a trait, never a schedule's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from simulator.schedules.action import Placement, Schedule


@dataclass(frozen=True)
class Requirement:
    """A condition a schedule puts on (p, m, v) that is not met; ``field`` says
    which input must change. For ``microbatches``, m must be a multiple of
    ``multiple``."""

    field: Literal["virtual_stages", "microbatches", "pp"]
    text: str
    multiple: int = 1
    least: int = 0  # for ``microbatches``: m must also be at least this


def no_requirements(p: int, m: int, v: int) -> list[Requirement]:
    return []


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything the simulator knows of one schedule; adding a schedule is one entry.

    Stage times ``f``, ``b``, ``w`` are one micro-batch's forward, backward-input
    and backward-weight through a whole stage (all its chunks; with two ``directions``
    a micro-batch passes one of the rank's two chunks, so they are a chunk's).
    """

    build: Callable[[int, int, int], Schedule]  # (p, m, v) -> per-rank actions
    # (p, m, v, stage) -> peak micro-batches whose activations the stage holds, in
    # whole-stage units (a chunk is 1/v of the stage)
    in_flight: Callable[[int, int, int, int], float]
    # (p, m, v, f, b, w) -> the pipeline phase, first forward to last backward, in
    # closed form for balanced stages and free communication
    pipeline_time: Callable[[int, int, int, float, float, float], float]
    # m -> micro-batches whose logits the last stage holds at once: 1 where it runs each
    # micro-batch's backward right after its forward (GPipe runs all m forwards first)
    logits_held: Callable[[int], int] = lambda m: 1
    chunks: tuple[int, int | None] = (1, 1)  # virtual stages per rank: (min, max or None)
    # beyond ``chunks``: what (p, m, v) must satisfy
    requirements: Callable[[int, int, int], list[Requirement]] = no_requirements
    # the backward runs as I (input gradient) and W (weight gradient) actions, so the
    # weight-gradient GEMMs are work of their own that TP overlap cannot hide behind
    split_backward: bool = False
    # where the virtual stages sit: "loop" (stage s on rank s mod p) or "v" (ZB-V: stage s
    # < p on rank s, else on 2p − 1 − s; the output layer then sits on rank 0)
    placement: Placement = "loop"
    # a synchronous flush that idles p − 1 slots per stage: its bubble is
    # (p − 1)/(m + p − 1) of the step, which the scenario warns about when m < 4p
    flush: bool = False
    # 2: the micro-batches run in two directions (DualPipe), each through the whole model
    # cut into pp · v / 2 stages: virtual stage k holds model stage k mod (pp · v / 2)
    directions: int = 1

    @property
    def chunked(self) -> bool:
        """Whether a rank may run more than one model chunk (virtual stages)."""
        return self.chunks[1] != 1


def flush_time(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """GPipe and 1F1B: (m + p − 1) × t_stage (each idles p − 1 slots per stage)."""
    return (m + p - 1) * (f + b + w)


def until_backward(p: int, m: int, v: int, stage: int) -> float:
    """1F1B and ZB-H1 (whose I frees what 1F1B's B frees): min(p − stage, m)."""
    return float(min(p - stage, m))
