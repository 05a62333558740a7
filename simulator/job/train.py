"""``clustersim train``: days, dollars and energy to train a scenario on N tokens.

One simulated step (engine or analytic) gives the step time; the scenario's
``reliability:``, ``checkpoint:`` and ``cost:`` sections give the failure rates,
the checkpoint cost and the prices (:mod:`simulator.job.reliability`); the job model
(:mod:`simulator.job.lifecycle`) runs the whole training ``--seeds`` times. The interval
between checkpoints is the scenario's (or ``--checkpoint-interval``): seconds,
Young's, Daly's, or ``auto``: each interval on a grid of √2 steps around
Young's (×1/8 to ×8) is simulated on the same failures, and the best mean
goodput wins. The scan leaves out intervals that need more than
:data:`SCAN_MAX_CHECKPOINTS` checkpoints a run (each costs a few SimPy events):
with asynchronous checkpoints Young's interval can be a few steps, and the scan
then starts at that floor. A given interval (seconds, young, daly) is simulated
as asked, however many checkpoints it takes.

Outputs (``--out DIR``): ``train.json`` (p5/p50/p95 over the runs of time to
train, goodput, GPU-hours, energy, cost; the rates, the checkpoint and the
interval scan), ``train_timeline.csv`` (the events of the median run) and
``train.png`` (its useful work over wall-clock time), each written atomically.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from simulator.job.events import check_events, expected_events
from simulator.job.lifecycle import JobRun, JobSpec, run_many
from simulator.job.reliability import (
    checkpoint_cost,
    daly_interval,
    job_rates,
    power_W,
    young_interval,
)
from simulator.limits import MAX_JOB_EVENTS
from simulator.outputs.progress import progress_bar
from simulator.spec.scenario import Scenario

SCAN_SEEDS = 8  # runs per interval of the auto scan
SCAN_POINTS = range(-6, 7)  # Young's interval × √2^i
# the scan skips intervals with more checkpoints than this per run: a run costs
# about 10 µs of CPU per checkpoint, and below it the scan would take minutes
SCAN_MAX_CHECKPOINTS = 50_000
PERCENTILES = (5, 50, 95)


def job_spec(s: Scenario, tokens: float, step_time_s: list[float] | tuple[float, ...],
             every: int = 1) -> JobSpec:
    """The job of training ``tokens`` with steps drawn from ``step_time_s``."""
    rates = job_rates(s)
    steps = math.ceil(tokens / (s.training.global_batch * s.model.seq_len))
    per_s = {c: r / 3600 for c, r in rates.failures_per_h.items()}
    return JobSpec(steps, tuple(step_time_s), min(every, steps), checkpoint_cost(s),
                   s.reliability.restart_s, per_s, rates.planned_per_h / 3600)


def _every(spec: JobSpec, interval_s: float) -> int:
    if not math.isfinite(interval_s):
        return spec.steps
    return int(min(spec.steps, max(1, round(interval_s / spec.mean_step_s))))


def choose_interval(spec: JobSpec, choice: str | float, scan_seeds: int = SCAN_SEEDS,
                    max_events: int = MAX_JOB_EVENTS) -> tuple[JobSpec, dict[str, Any]]:
    """The spec with its checkpoint interval set, and how it was chosen. The ``auto``
    scan spends at most half of ``max_events`` (estimated, :mod:`simulator.job.events`):
    intervals that would cost more are left out, and none left is a UserError."""
    delta = spec.checkpoint.blocking_s
    rate = sum(spec.failures_per_s.values())
    mtbf = 1 / rate if rate > 0 else math.inf
    young, daly = young_interval(delta, mtbf), daly_interval(delta, mtbf)
    info: dict[str, Any] = {"choice": choice, "young_s": young, "daly_s": daly, "scan": []}
    if isinstance(choice, float | int) and not isinstance(choice, bool):
        every = _every(spec, float(choice))
    elif choice in ("young", "daly"):
        every = _every(spec, young if choice == "young" else daly)
    else:
        floor = math.ceil(spec.steps / SCAN_MAX_CHECKPOINTS)
        candidates = _affordable(spec, sorted({max(floor, _every(spec, young * 2 ** (i / 2)))
                                               for i in SCAN_POINTS}), scan_seeds, max_events)
        info["scan_floor_steps"] = floor
        best = (-1.0, spec.steps)
        with progress_bar(len(candidates), "checkpoint intervals") as bar:
            for k in candidates:
                trial = _with_every(spec, k)
                goodput = float(np.mean([r.goodput for r in run_many(trial,
                                                                     range(scan_seeds))]))
                info["scan"].append({"interval_s": k * spec.mean_step_s, "every_steps": k,
                                     "goodput": goodput})
                best = max(best, (goodput, k))
                bar.update()
        every = best[1]
    info.update(interval_s=every * spec.mean_step_s, every_steps=every)
    return _with_every(spec, every), info


def _affordable(spec: JobSpec, candidates: list[int], seeds: int,
                max_events: int) -> list[int]:
    """The scan's intervals, the most expensive left out until the scan's estimate is at
    most half of ``max_events``; none left is a UserError with the cheapest's figure."""
    cost = {k: seeds * expected_events(_with_every(spec, k)) for k in candidates}
    kept = sorted(candidates, key=lambda k: cost[k])
    while kept and sum(cost[k] for k in kept) > max_events // 2:
        kept.pop()
    if not kept:
        check_events(_with_every(spec, min(cost, key=lambda k: cost[k])), seeds,
                     max_events // 2, "job events for the auto scan's cheapest interval")
    return sorted(kept)


def _with_every(spec: JobSpec, every: int) -> JobSpec:
    from dataclasses import replace

    return replace(spec, checkpoint_every=every)


def _percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}


def train_results(s: Scenario, spec: JobSpec, runs: list[JobRun], step: dict[str, Any],
                  interval: dict[str, Any], tokens: float) -> dict[str, Any]:
    """The train.json contract: the figures over the runs, and what they came from."""
    rates = job_rates(s)
    gpu_W, host_W = power_W(s)
    it_W = s.parallel.world * gpu_W + s.cluster.nodes * host_W
    walls = [r.wall_s for r in runs]
    gpu_hours = [w / 3600 * s.parallel.world for w in walls]
    ck = spec.checkpoint
    return {
        "scenario": s.name, "tokens": tokens, "steps": spec.steps,
        "tokens_per_step": s.training.global_batch * s.model.seq_len,
        "step_time_s": spec.mean_step_s, "method": step["method"],
        "fidelity": step.get("fidelity"), "gpus": s.parallel.world, "seeds": len(runs),
        "time_to_train_days": _percentiles([w / 86400 for w in walls]),
        "goodput": _percentiles([r.goodput for r in runs]),
        "gpu_hours": _percentiles(gpu_hours),
        "energy_MWh": _percentiles([w * it_W * s.cost.pue / 3.6e9 for w in walls]),
        "cost_usd": _percentiles([h * s.cost.usd_per_gpu_hour for h in gpu_hours]),
        "failures": _percentiles([float(sum(r.failures.values())) for r in runs]),
        "planned_interruptions": _percentiles([float(r.planned) for r in runs]),
        "breakdown_days": {k: float(np.mean([r.breakdown_s[k] for r in runs])) / 86400
                           for k in runs[0].breakdown_s},
        "mean_loss_per_failure_s": float(np.nanmean([r.mean_loss_per_failure_s for r in runs]))
        if any(sum(r.failures.values()) for r in runs) else None,
        "expected_loss_per_failure_s": interval["interval_s"] / 2 + spec.restart_s + ck.reload_s,
        "reliability": {"preset": s.reliability.preset, "mtbf_h": rates.mtbf_h,
                        "components": rates.counts,
                        "failures_per_day": {c: r * 24 for c, r in rates.failures_per_h.items()},
                        "planned_per_day": rates.planned_per_h * 24,
                        "restart_s": spec.restart_s},
        "checkpoint": {"bytes": ck.bytes, "asynchronous": s.checkpoint.asynchronous,
                       "blocking_s": ck.blocking_s, "durable_s": ck.durable_s,
                       "reload_s": ck.reload_s, **interval},
        "power": {"gpu_W": gpu_W, "host_W": host_W, "pue": s.cost.pue, "it_kW": it_W / 1e3},
        "usd_per_gpu_hour": s.cost.usd_per_gpu_hour,
    }


def median_run(runs: list[JobRun]) -> JobRun:
    """The run whose wall time is the median (the lower one of an even count)."""
    return sorted(runs, key=lambda r: (r.wall_s, r.seed))[(len(runs) - 1) // 2]


def summary_lines(res: dict[str, Any]) -> list[str]:
    def pct(key: str, fmt: str) -> str:
        p = res[key]
        return f"p50 {p['p50']:{fmt}}  (p5 {p['p5']:{fmt}}, p95 {p['p95']:{fmt}})"

    rel, ck = res["reliability"], res["checkpoint"]
    per_day = ", ".join(f"{c} {v:.2f}" for c, v in rel["failures_per_day"].items() if v)
    loss = res["mean_loss_per_failure_s"]
    return [
        f"{'scenario':<20}  {res['scenario']} on {res['gpus']:,} GPUs",
        f"{'step':<20}  {res['step_time_s']:.3g} s ({res['method']}), "
        f"{res['tokens_per_step'] / 1e6:.3g}M tokens, {res['steps']:,} steps for "
        f"{res['tokens'] / 1e12:.3g}T tokens",
        f"{'failures':<20}  one every {rel['mtbf_h']:.3g} h ({rel['preset']} rates; per day: "
        f"{per_day or 'none'}), restart {rel['restart_s']:g} s + reload {ck['reload_s']:.3g} s",
        f"{'checkpoint':<20}  {ck['bytes'] / 1e9:,.0f} GB, stalls {ck['blocking_s']:.3g} s "
        f"({'async' if ck['asynchronous'] else 'sync'}), every {ck['interval_s']:,.0f} s = "
        f"{ck['every_steps']} steps ({ck['choice']}; Young {ck['young_s']:,.0f} s, "
        f"Daly {ck['daly_s']:,.0f} s)",
        f"{'loss per failure':<20}  "
        + (f"{loss:,.0f} s simulated, {res['expected_loss_per_failure_s']:,.0f} s expected "
           "(τ/2 + restart + reload)" if loss is not None else "no failures"),
        f"{'time to train':<20}  {pct('time_to_train_days', '.1f')} days, "
        f"{res['seeds']} runs",
        f"{'goodput':<20}  {pct('goodput', '.1%')}",
        f"{'where the time goes':<20}  " + ", ".join(
            f"{k.replace('_', ' ')} {v:.2f} d" for k, v in res["breakdown_days"].items())
        + " (mean)",
        f"{'failures':<20}  {pct('failures', '.0f')}",
        f"{'GPU-hours':<20}  {pct('gpu_hours', ',.0f')}",
        f"{'energy MWh':<20}  {pct('energy_MWh', ',.0f')}  ({res['power']['it_kW']:,.0f} kW IT "
        f"× PUE {res['power']['pue']:g})",
        f"{'cost USD':<20}  {pct('cost_usd', ',.0f')}  "
        f"(${res['usd_per_gpu_hour']:g} per GPU-hour)",
    ]
