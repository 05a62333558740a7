"""``clustersim run``: simulate one training step and write results.json and the timelines."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.cli.common import (
    Subparsers,
    add_command,
    load,
    positive_int,
    scenario_args,
)
from simulator.cli.exit_codes import allow_oom_arg, fit_status, memory_verdict
from simulator.errors import Problem, UserError
from simulator.limits import MAX_RANKS

if TYPE_CHECKING:
    from simulator.api import Timings
    from simulator.spec.scenario import Scenario

HELP = "simulate one training step and write results.json and the timelines"
EXAMPLE = ("examples:\n"
           "  clustersim run scenarios/gpt3-175b-1024.yaml --out out/gpt3\n"
           "  clustersim run scenarios/gpt3-175b-1024.yaml --set parallel.schedule=gpipe "
           "--no-plots\n"
           "  clustersim run scenarios/llama2-7b-8gpu-ddp.yaml --set parallel.zero=1 --method "
           "analytic\n"
           "  clustersim run scenarios/gpt3-175b-1024.yaml --what-if --no-plots\n"
           "  clustersim run scenarios/llama2-7b-8gpu-ddp.yaml --set cluster.system=cpu.yaml "
           "--uncertainty 200 --seed 1 --method analytic --allow-oom")
MAX_STEPS = 100_000  # --steps: each step is one simulation


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "run", HELP, EXAMPLE, exit_codes=True)
    scenario_args(q)
    q.add_argument("--out", type=Path, default=None, help="output directory (default "
                   "out/<scenario name>, or out/<name>-set-<digest of the --set overrides> "
                   "with overrides, so differently overridden runs never share one)")
    q.add_argument("--method", choices=["engine", "analytic"], default=None,
                   help="discrete-event engine (default) or closed-form estimate")
    q.add_argument("--fidelity", choices=["folded", "full"], default=None,
                   help="folded: one rank per class of identical ranks stands for its "
                   "peers (one per stage when the cluster is symmetric; default); full: all")
    q.add_argument("--no-plots", action="store_true", help="skip the PNGs (faster)")
    q.add_argument("--what-if", action="store_true", help="also re-simulate with each cost "
                   "class (GEMM, attention, memory-bound, each link class) 10%% faster and "
                   "print what bounds the step (results.json: what_if)")
    q.add_argument("--steps", type=positive_int, default=1, metavar="N",
                   help="simulate N consecutive steps with fresh jitter (variability.jitter) "
                        "and report the step-time distribution (p50, p95, p99, max) and the "
                        "wait for the slowest rank (engine)")
    q.add_argument("--uncertainty", default=None, metavar="N",
                   help="also simulate N samples of the hardware profile's fitted terms, "
                   "each scaled by a lognormal factor with the profile's relative spread "
                   "(its uncertainty section, written by calibrate), and report step time "
                   "and MFU as p5/p50/p95 (results.json: uncertainty, step_time_s_p5 ...)")
    q.add_argument("--seed", default="0", metavar="S",
                   help="seed of the --uncertainty samples (default 0)")
    q.add_argument("--max-tasks", type=positive_int, default=None, metavar="N",
                   help="refuse engine runs estimated above N tasks (default 2.5e7, about "
                   "40 GB); checked before building")
    q.add_argument("--max-ranks", type=positive_int, default=MAX_RANKS, metavar="N",
                   help=f"refuse clusters of more than N GPUs (default {MAX_RANKS:,}: the "
                   "groups of every rank are walked, about 3.5 s a million)")
    q.add_argument("--timeline", choices=["parquet", "csv", "both"], default="parquet",
                   help="span table format: timeline.parquet (default), timeline.csv, or both")
    q.add_argument("--trace-ranks", default="stages", metavar="all|stages|R,R,...",
                   help="ranks in trace.json: stages (default: each pipeline stage's lowest "
                   "rank), all, or a list such as 0,5,17")
    q.add_argument("--trace-format", choices=["json", "json.gz"], default="json",
                   help="trace.json (default) or trace.json.gz, gzipped (about 10x "
                   "smaller; Perfetto opens it as it is)")
    allow_oom_arg(q)
    q.set_defaults(func=run)


def _check(args: argparse.Namespace, s: Scenario) -> None:
    """Refuse what cannot run before simulating: too many steps, many steps without the
    engine, an engine run above the task budget."""
    if args.steps > MAX_STEPS:
        raise UserError([Problem("--steps", args.steps, f"at most {MAX_STEPS:,} steps (each is "
                                 "a simulation); sample fewer")])
    if args.steps > 1 and (args.method or s.simulation.method) != "engine":
        raise UserError([Problem("--steps", args.steps, "many steps need the engine (the "
                                 "analytic method has no jitter); drop --method analytic")])
    if (args.method or s.simulation.method) == "engine":
        from simulator.builder.budget import check_engine_cost

        check_engine_cost(s, args.fidelity or s.simulation.fidelity, args.max_tasks)


def _extras(args: argparse.Namespace, s: Scenario, results: dict[str, Any],
            samples: int | None, seed: int) -> None:
    """Many steps, the uncertainty samples and the what-if, into ``results``."""
    if args.steps > 1 and results["method"] == "engine":
        from simulator.analysis.steps import many_steps

        results["steps"] = many_steps(s, args.steps, results, args.fidelity)
    if samples is not None:
        from simulator.analysis.uncertainty import flat_keys, monte_carlo, print_start

        print_start(samples, s.hardware)
        results["uncertainty"] = monte_carlo(s, samples, seed, results)
        results.update(flat_keys(results["uncertainty"]))
    if args.what_if:
        from simulator.analysis.whatif import CLASS_LABELS, what_if

        def say(name: str) -> None:
            print(f"what-if: {CLASS_LABELS[name]} 10% faster ...", file=sys.stderr, flush=True)

        results["what_if"] = what_if(s, results["step_time_s"], results["method"],
                                     results.get("fidelity"), say)


def _summary(results: dict[str, Any], wall: dict[str, float]) -> list[str]:
    """The run's summary, then each extra's."""
    from simulator.analysis.extras import extras_lines
    from simulator.analysis.report import summary_lines

    lines = summary_lines(results, wall) + extras_lines(results)
    if "what_if" in results:
        from simulator.analysis.whatif import what_if_lines

        lines += what_if_lines(results["what_if"])
    return lines


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.rank_selection import parse_rank_selection
    from simulator.outputs.run_dir import check_out_dir, replaced_run_note, run_out_dir, staged_run

    samples, seed = None, 0
    if args.uncertainty is not None:  # a bad flag fails before the scenario is read
        from simulator.analysis.uncertainty import parse_samples, parse_seed

        samples, seed = parse_samples(args.uncertainty), parse_seed(args.seed)
    started = time.perf_counter()
    s = load(args)
    trace_ranks = parse_rank_selection(args.trace_ranks)
    out = args.out or run_out_dir(s.name, args.overrides)
    check_out_dir(out)  # before simulating: a bad --out is one line, not a lost run
    _check(args, s)
    note = replaced_run_note(out, s.to_dict())
    if note:
        print(note, file=sys.stderr)
    from simulator.api import run_scenario, write_outputs  # pandas: after the checks

    print(f"simulating {s.name} ({s.parallel.world} GPUs) ...", file=sys.stderr)
    timings: Timings = {}
    simulating = time.perf_counter()
    run = run_scenario(s, args.method, args.fidelity, progress=True, trace_ranks=trace_ranks,
                       max_tasks=args.max_tasks, max_ranks=args.max_ranks, timings=timings)
    results, spans = run.results, run.spans
    _extras(args, s, results, samples, seed)
    writing = time.perf_counter()
    with staged_run(out) as staging:
        written = write_outputs(staging, results, spans, plots=not args.no_plots,
                                timeline=args.timeline, trace=run.trace,
                                trace_format=args.trace_format)
    # build: reading the scenario and building the workload; simulate: the engine (or
    # the estimate), the accounting and the extras; write: every output file
    build = simulating - started + timings.get("build", (0.0, 0.0))[0]
    wall = {"build": build, "simulate": writing - started - build,
            "write": time.perf_counter() - writing}
    print("\n".join(_summary(results, wall)))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    return fit_status(memory_verdict(results["memory"]), args.allow_oom, written=True)
