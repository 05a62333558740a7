"""A validation row: a configuration measured ``--repeats`` times back to back, the runs
a hypervisor took too much of the CPU from set aside (and measured again, ``--retries``),
the rest pooled and their median step compared with the simulation.

On the project's 2-vCPU VM one run was one draw of a pace that wanders on a scale of
seconds, so a row pools runs (:func:`pool`) and says how far their medians lay apart
(``repeat``, the measurement's own repeatability), whether its steps scattered (a busy
machine) and what steal it ran under (:func:`pool_note`, :func:`steal_note`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.host import STEAL_LIMIT
from calibration.measured.validation_configs import MIN_SECONDS, MODEL_STEPS, Config

#: a row whose pooled steps scatter more than this (interquartile range over the median)
#: ran on a busy machine (on this project's VM a slow spell turns some steps 40% longer):
#: the row's note says so
SPREAD_LIMIT = 0.10
#: runs of each configuration, back to back, whose timed steps are pooled, where
#: ``--repeats`` leaves it: on the project's 2-vCPU VM two 20 s runs of one tiny-gpt
#: configuration differed by 8% on average (small-gpt 6%; 2026-12-05, 54 and 13 pairs,
#: the second run of each measured because the first one's steps scattered),
#: so one run was one draw of a pace that wanders on a scale of seconds. Two runs halve
#: that draw's variance, and their difference is the measurement's repeatability that the
#: table shows beside the error
#: (:func:`calibration.measured.validation_table.repeatability_sentence`)
REPEATS = {"cpu": 2, "cuda": 1}


def step_spread(times: list[float]) -> float:
    """The interquartile range of a run's step times over their median: the calibration's
    repeat spread (:func:`calibration.microbench.bench_timing.repeat_spread`) applied to
    steps, with inclusive quartiles (a run has few steps)."""
    from calibration.microbench.bench_timing import repeat_spread

    return repeat_spread(times, "inclusive")


@dataclass(frozen=True)
class Run:
    """One measured run of a configuration: its directory, timed steps and steal share."""
    out: Path
    steps: tuple[float, ...]
    steal: float | None

    @property
    def median(self) -> float:
        return statistics.median(self.steps)

    @property
    def stolen(self) -> bool:
        return (self.steal or 0.0) > STEAL_LIMIT


@dataclass(frozen=True)
class Pooled:
    """A configuration's runs as the row uses them: the runs pooled (every run the
    hypervisor did not take over :data:`STEAL_LIMIT` of the CPU from, or the least
    stolen one when it took it from all) and the runs set aside for steal."""
    runs: tuple[Run, ...]
    set_aside: tuple[Run, ...]

    @property
    def step_s(self) -> float:
        """The median of every pooled run's timed steps."""
        return statistics.median([t for r in self.runs for t in r.steps])

    @property
    def spread(self) -> float:
        return step_spread([t for r in self.runs for t in r.steps])

    @property
    def repeat(self) -> float | None:
        """How far the pooled runs' medians lie apart, over the pooled median (None with
        one run): the measurement's own repeatability."""
        if len(self.runs) < 2:
            return None
        medians = [r.median for r in self.runs]
        return (max(medians) - min(medians)) / self.step_s

    @property
    def steal(self) -> float | None:
        shares = [r.steal for r in self.runs if r.steal is not None]
        return max(shares) if shares else None


def pool(runs: list[Run]) -> Pooled:
    """The runs a row pools (:class:`Pooled`)."""
    calm = tuple(r for r in runs if not r.stolen)
    if calm:
        return Pooled(calm, tuple(r for r in runs if r.stolen))
    least = min(runs, key=lambda r: r.steal or 0.0)
    return Pooled((least,), tuple(r for r in runs if r is not least))


def pool_note(pooled: Pooled) -> str:
    """What the table says of a row's runs: steps scattered over :data:`SPREAD_LIMIT`,
    runs set aside for steal, or every run stolen."""
    notes = []
    if pooled.spread > SPREAD_LIMIT:
        notes.append(f"steps scattered {pooled.spread:.0%} (a busy machine)")
    if pooled.set_aside:
        shares = ", ".join(_pct(r.steal) for r in pooled.set_aside)
        notes.append(f"{len(pooled.set_aside)} run(s) set aside for steal ({shares})"
                     + ("; every run stolen, kept the least" if pooled.runs[0].stolen
                        else ""))
    return "; ".join(notes)


def steal_note(steal: float | None) -> str:
    """What the table says of a row measured while a hypervisor took the CPU."""
    if steal is None or steal <= STEAL_LIMIT:
        return ""
    return f"the hypervisor took {steal:.0%} of the CPU (steal) during the run"


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def repeats(args: argparse.Namespace) -> int:
    """Runs per configuration: ``--repeats``, else :data:`REPEATS` of the device."""
    given = getattr(args, "repeats", None)
    return REPEATS[args.device] if given is None else int(given)


def run_one(cfg: Config, args: argparse.Namespace, profile: str, run_dir: Path,
            model: str) -> dict[str, Any]:
    """Measure ``--repeats`` runs back to back (one more, up to ``--retries`` times, for
    each the hypervisor took over :data:`STEAL_LIMIT` of the CPU from) and compare the
    median of their pooled steps (:func:`pool`)."""
    from calibration.measured.compare import run_compare
    from calibration.measured.measure import run_measure

    steps, warmup = MODEL_STEPS[model]
    want = repeats(args)
    runs: list[Run] = []
    try:
        while sum(not r.stolen for r in runs) < want and len(runs) < want + args.retries:
            n = len(runs)
            out = run_dir if n == 0 else run_dir.with_name(f"{run_dir.name}-run{n + 1}")
            got = run_measure(
                cfg.tp, cfg.pp, cfg.dp, schedule=cfg.schedule, zero=cfg.zero,
                micro_batches=args.micro_batches, model=model, steps=args.steps or steps,
                warmup=args.warmup if args.warmup is not None else warmup,
                device=args.device, out_dir=str(out), threads=args.threads,
                timeout_s=args.timeout, micro_batch_size=args.micro_batch_size,
                powersgd_rank=cfg.powersgd_rank, experts=cfg.experts, ep=cfg.ep, cp=cfg.cp,
                slow_rank=cfg.slow_rank, slowdown=cfg.slowdown,
                sequence_parallel=cfg.sequence_parallel, min_seconds=min_seconds(args))
            runs.append(Run(out, tuple(got["step_times_s"]), got.get("cpu_steal")))
            if runs[-1].stolen:
                _say(f"[validation] {cfg.name}: the hypervisor took {_pct(runs[-1].steal)} "
                     f"of the CPU (limit {STEAL_LIMIT:.0%})"
                     + (", measuring again" if len(runs) < want + args.retries else ""))
        pooled = pool(runs)
        comparison = run_compare(pooled.runs[0].out, profile, step_time_s=pooled.step_s)
    except Exception as exc:
        return _row(cfg, None, f"failed: {str(exc).splitlines()[0][:160]}", model)
    slept = comparison.get("slowdown_as_slept")
    slept_note = "" if slept is None else \
        f"straggler as it ran: x{slept['compute_slowdown']:.2f} (asked x{cfg.slowdown:g})"
    row = _row(cfg, comparison, _join(pool_note(pooled), steal_note(pooled.steal), slept_note),
               model, pooled.steal)
    row.update(runs=len(pooled.runs), repeat=pooled.repeat)
    return row


def min_seconds(args: argparse.Namespace) -> float:
    """Seconds a run's timed steps span at least: ``--min-seconds``, else
    :data:`MIN_SECONDS` of the device."""
    given = getattr(args, "min_seconds", None)
    return MIN_SECONDS[args.device] if given is None else float(given)


def _row(cfg: Config, comparison: dict[str, Any] | None, note: str = "",
         model: str = "", steal: float | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"model": model, "config": cfg.name, "tp": cfg.tp, "pp": cfg.pp,
                           "dp": cfg.dp, "schedule": cfg.schedule, "zero": cfg.zero,
                           "cpu_steal": steal, "note": note}
    if comparison is not None:
        meas, sim, err = (comparison["measured"], comparison["simulated"],
                          comparison["relative_error"])
        row.update(measured_ms=meas["step_time_s"] * 1e3, simulated_ms=sim["step_time_s"] * 1e3,
                   step_error=err["step_time_s"], compute_error=err["compute_s"],
                   idle_measured=meas["idle_fraction"], idle_simulated=sim["idle_fraction"])
    return row


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"
