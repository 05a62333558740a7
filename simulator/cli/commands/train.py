"""``clustersim train``: time, goodput, energy and cost to train N tokens, with failures
and checkpoints (the job over days: :mod:`simulator.job`).

Ctrl-C or SIGTERM stops it with one line saying what was done (the step simulated, the
interval chosen, how many Monte Carlo runs) and what was written: nothing until the
runs are done, then each file whole, so no output is ever half-written. It keeps no
partial result to resume from: the runs are seeded and take seconds to minutes, so the
same command run again gives the same figures from scratch.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.cli.common import Subparsers, add_command, positive_int
from simulator.errors import Interrupted, Problem, UserError
from simulator.limits import MAX_JOB_EVENTS

if TYPE_CHECKING:
    from simulator.job.lifecycle import JobRun

HELP = "time, goodput, energy and cost to train N tokens, with failures and checkpoints"
EXAMPLE = ("example:\n  clustersim train scenarios/llama3-70b-2048-train.yaml --tokens 15e12 "
           "--out out/llama3-70b-train\n  clustersim train scenarios/llama3-70b-2048-train.yaml "
           "--tokens 15e12 --checkpoint-interval young --set checkpoint.asynchronous=true")


def _interval_arg(text: str) -> str:
    if text in ("auto", "young", "daly"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise UserError([Problem("--checkpoint-interval", text, "must be auto, young, daly or "
                                 "a positive number of seconds")])
    return repr(value)


def _check_args(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.tokens) and 0 < args.tokens <= 1e18):
        raise UserError([Problem("--tokens", args.tokens, "must be a positive number of tokens "
                                 "up to 1e18, e.g. 15e12")])
    if not 1 <= args.seeds <= 100_000:
        raise UserError([Problem("--seeds", args.seeds, "must be between 1 and 100000")])


@dataclass
class Progress:
    """What a train command has done so far, for the line an interruption prints."""

    done: list[str] = field(default_factory=list)  # finished stages, in order
    runs: list[JobRun] = field(default_factory=list)  # Monte Carlo runs finished
    seeds: int = 0  # runs asked for (0: not started)
    written: list[str] = field(default_factory=list)  # output files written whole

    def interrupted(self, out: Path | None) -> str:
        did = [*self.done]
        if self.seeds:
            did.append(f"{len(self.runs)} of {self.seeds} job runs done")
        where = ("no output asked" if out is None
                 else f"nothing written to {out} by this run" if not self.written
                 else f"{', '.join(self.written)} written whole to {out}, the rest not")
        return (f"{'; '.join(did) or 'nothing done yet'}; {where} (no file is left "
                "half-written); train keeps no partial runs: run the same command again")


def run_train(args: argparse.Namespace, progress: Progress | None = None) -> dict[str, Any]:
    """Load, simulate the step, run the job; write the outputs when ``args.out`` is set.
    ``progress`` is kept up to date as each stage ends."""
    from simulator.api import simulate_scenario
    from simulator.job.events import check_events
    from simulator.job.lifecycle import run_job, run_many
    from simulator.job.reliability import power_W
    from simulator.job.train import SCAN_SEEDS, choose_interval, job_spec, median_run, train_results
    from simulator.spec.load import load_scenario

    _check_args(args)
    progress = Progress() if progress is None else progress
    overrides = list(args.overrides)
    if args.checkpoint_interval is not None:
        overrides.append(f"checkpoint.interval={_interval_arg(args.checkpoint_interval)}")
    if args.usd_per_gpu_hour is not None:
        overrides.append(f"cost.usd_per_gpu_hour={args.usd_per_gpu_hour!r}")
    s = load_scenario(args.scenario, overrides)
    power_W(s)  # refuse a system without power figures before simulating
    if args.out is not None:
        from simulator.outputs.run_dir import check_out_dir

        check_out_dir(args.out)
    print(f"simulating one step of {s.name} ({s.parallel.world} GPUs) ...", file=sys.stderr)
    step, _ = simulate_scenario(s, args.method, args.fidelity)
    spec = job_spec(s, args.tokens, [step["step_time_s"]])
    progress.done.append(f"one step simulated ({step['step_time_s']:.3g} s)")
    print(f"choosing the checkpoint interval ({s.checkpoint.interval}) ...", file=sys.stderr)
    spec, interval = choose_interval(spec, s.checkpoint.interval, min(SCAN_SEEDS, args.seeds),
                                     args.max_events)
    progress.done.append(f"checkpoint interval chosen ({interval['interval_s']:,.0f} s)")
    check_events(spec, args.seeds + 1, args.max_events)  # the runs and the traced median
    print(f"running the job {args.seeds} times ...", file=sys.stderr)
    base = s.simulation.seed * 1_000_003
    progress.seeds = args.seeds
    runs = run_many(spec, [base + i for i in range(args.seeds)], "job runs", progress.runs)
    res = train_results(s, spec, runs, step, interval, args.tokens)
    if args.out is not None:
        _write(args.out, res, run_job(spec, median_run(runs).seed, trace=True), args.no_plot,
               progress.written)
    return res


def _write(out: Path, res: dict[str, Any], run: JobRun, no_plot: bool,
           written: list[str]) -> None:
    """train.json, train_timeline.csv (the median run's events) and train.png."""
    import pandas as pd

    from simulator.api import write_results
    from simulator.outputs.writing import atomic_output, output_lock

    table = pd.DataFrame(run.events, columns=["time_s", "steps", "event"])
    table["tokens"] = table["steps"] * res["tokens_per_step"]
    res["median_run_seed"] = run.seed
    with output_lock(out):
        out.mkdir(parents=True, exist_ok=True)
        with atomic_output(out / "train_timeline.csv") as tmp:
            table.to_csv(tmp, index=False)
        written.append("train_timeline.csv")
        write_results(out / "train.json", res)
        written.append("train.json")
        if not no_plot:
            from simulator.outputs.plots.job import plot_training

            plot_training(out)
            written.append("train.png")


def add_parser(sub: Subparsers) -> None:
    p = add_command(sub, "train", HELP, EXAMPLE)
    p.add_argument("scenario", type=Path, help="scenario YAML file")
    p.add_argument("--tokens", type=float, required=True, help="tokens to train, e.g. 15e12")
    p.add_argument("--out", type=Path, default=None,
                   help="write train.json, train_timeline.csv and train.png here")
    p.add_argument("--seeds", type=int, default=32, help="Monte Carlo runs (default 32)")
    p.add_argument("--checkpoint-interval", default=None, metavar="auto|young|daly|SECONDS",
                   help="override checkpoint.interval")
    p.add_argument("--usd-per-gpu-hour", type=float, default=None,
                   help="override cost.usd_per_gpu_hour")
    p.add_argument("--method", choices=["engine", "analytic"], default=None,
                   help="how the step time is simulated (default the scenario's)")
    p.add_argument("--fidelity", choices=["folded", "full"], default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY.PATH=VALUE", help="override a scenario key (repeatable)")
    p.add_argument("--max-events", type=positive_int, default=MAX_JOB_EVENTS, metavar="N",
                   help=f"refuse a job estimated above N simulated events, the interval scan "
                   f"and every run together (default {MAX_JOB_EVENTS:,})")
    p.add_argument("--no-plot", action="store_true", help="skip train.png")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    progress = Progress()
    try:
        res = run_train(args, progress)
    except KeyboardInterrupt as exc:  # SIGTERM arrives as Interrupted (simulator.cli.main)
        raise Interrupted(getattr(exc, "signal_name", "SIGINT"),
                          progress.interrupted(args.out)) from None
    from simulator.job.train import summary_lines

    print("\n".join(summary_lines(res)))
    if args.out is not None:
        print(f"wrote train.json, train_timeline.csv{'' if args.no_plot else ', train.png'} "
              f"to {args.out}/")
    return 0
