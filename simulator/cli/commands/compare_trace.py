"""``clustersim compare-trace``: a real job's profiler traces, class by class and rank by
rank, beside the simulation of its scenario."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from simulator.cli.common import Subparsers, add_command, load, scenario_args

HELP = ("read every rank's PyTorch profiler traces of a real job and set each kernel class "
        "and each rank's exposed communication beside the simulation: classes.csv, "
        "ranks.csv, compare-trace.md, comparison.json, classes.png")
EXAMPLE = ("examples:\n"
           "  clustersim compare-trace runs/llama-8b/traces scenarios/llama2-7b-8gpu-ddp.yaml "
           "--out out/llama-traces\n"
           "  clustersim measure --tp 1 --pp 1 --dp 2 --steps 2 --device cpu --out runs/dp2\n"
           "  clustersim compare-trace runs/dp2/traces runs/dp2/scenario.yaml "
           "--set cluster.system=cpu.yaml")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "compare-trace", HELP, EXAMPLE)
    q.add_argument("traces", type=Path, help="directory of the job's Chrome traces "
                   "(*.json, *.pt.trace.json, *.json.gz), one or more per rank")
    scenario_args(q)
    q.add_argument("--fidelity", choices=["folded", "full"], default=None,
                   help="folded: a measured rank is set beside its stage's simulated rank "
                   "(default: the scenario's); full: every rank simulated")
    q.add_argument("--out", type=Path, default=None, help="output directory "
                   "(default out/compare-trace-<scenario name>)")
    q.add_argument("--no-plots", action="store_true", help="skip classes.png")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.run_dir import check_out_dir, default_out_dir
    from simulator.traces.compare import compare_traces
    from simulator.traces.report import class_lines, differing_lines, write_report

    s = load(args)
    out = args.out or default_out_dir(f"compare-trace-{s.name}")
    check_out_dir(out)
    print(f"reading {args.traces} and simulating {s.name} ...", file=sys.stderr)
    comparison = compare_traces(args.traces, s, args.fidelity)
    meta = {"traces": str(args.traces), "scenario": str(args.scenario),
            "overrides": list(args.overrides), "fidelity": comparison["results"]["fidelity"]}
    written = write_report(out, comparison, meta, plot=not args.no_plots)
    print("per step, mean over the measured ranks:")
    print("\n".join(class_lines(comparison["classes"])))
    print("\n".join(differing_lines(comparison)))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    return 0
