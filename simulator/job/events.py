"""How many events a job simulation will take, estimated before it runs.

The job model (:mod:`simulator.job.lifecycle`) spends a few SimPy events on each
segment of ``checkpoint_every`` steps, each interruption and each restart. A
segment of length T = k·τ + δ (k steps of τ, a checkpoint stall δ) under
failures at rate λ completes on the first try with probability e^(−λT), so it is
tried e^(λT) times on average (the geometric law), and each failed try is a
failure, a rollback and a restart, itself retried e^(λ(R+L)) times (restart R,
reload L). Planned interruptions add their rate times the wall time; an interruption
costs about a hundred checkpoints of CPU (:data:`INTERRUPTION_WEIGHT`). When λT is
large the estimate explodes, as the run would: a failure every 3.6 s against a
7 s step never finishes a step. ``clustersim train`` refuses a job whose
estimate passes ``--max-events`` (:data:`simulator.limits.MAX_JOB_EVENTS`) instead
of running it.
"""

from __future__ import annotations

import math

from simulator.job.lifecycle import JobSpec
from simulator.limits import MAX_JOB_EVENTS

EVENTS_PER_TRY = 3.0  # a segment's timeout, its checkpoint, a log entry
#: An interruption costs about a hundred times a checkpoint (its cause is drawn, the
#: trainer unwinds and restarts): measured, ~200 µs against ~2 µs
INTERRUPTION_WEIGHT = 100.0
_EXP_CAP = 700.0  # e^700 ~ 1e304: "never", still a float


def expected_counts(spec: JobSpec) -> tuple[float, float]:
    """(segment tries, interruptions) expected in one run of ``spec`` (module notes)."""
    rate = sum(spec.failures_per_s.values())
    k = max(1, spec.checkpoint_every)
    segments = math.ceil(spec.steps / k)
    segment_s = k * spec.mean_step_s + spec.checkpoint.blocking_s
    tries = math.exp(min(rate * segment_s, _EXP_CAP))
    down_s = spec.restart_s + spec.checkpoint.reload_s
    restarts = math.exp(min(rate * down_s, _EXP_CAP))
    failures = segments * (tries - 1.0)
    wall_s = segments * segment_s * tries + failures * down_s * restarts
    return segments * tries, failures * restarts + spec.planned_per_s * wall_s


def expected_events(spec: JobSpec) -> float:
    """Expected cost of one run of ``spec`` in events, an interruption weighing
    :data:`INTERRUPTION_WEIGHT` (about 2 µs of CPU an event)."""
    tries, interruptions = expected_counts(spec)
    return EVENTS_PER_TRY * tries + INTERRUPTION_WEIGHT * interruptions


def check_events(spec: JobSpec, runs: int, max_events: int = MAX_JOB_EVENTS,
                 what: str = "job events") -> None:
    """Refuse ``runs`` runs of ``spec`` estimated above ``max_events`` events."""
    from simulator.errors import Problem, UserError

    total = runs * expected_events(spec)
    if total <= max_events:
        return
    rate = sum(spec.failures_per_s.values())
    mtbf = f"one failure every {1 / rate:,.3g} s" if rate > 0 else "no failures"
    shown = f"about {total:,.0f}" if total < 1e15 else \
        f"about {total:.3g}" if total < 1e300 else "unboundedly many"
    raise UserError([Problem(
        "--max-events", max_events, f"{spec.steps:,} steps of {spec.mean_step_s:.3g} s, a "
        f"checkpoint every {spec.checkpoint_every:,} step(s), {mtbf}: {shown} {what} over "
        f"{runs} run(s), over the limit; train fewer tokens, checkpoint less often, fewer "
        "--seeds or a longer MTBF (reliability.*_mtbf_h), or raise --max-events")])
