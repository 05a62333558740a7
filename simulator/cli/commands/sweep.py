"""``clustersim sweep``: evaluate a grid of overrides of one scenario; table and best points."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from simulator.cli.common import (
    Subparsers,
    add_command,
    computed_line,
    load,
    positive_int,
    result_cache,
    scenario_args,
    search_args,
)
from simulator.limits import MAX_POINTS

HELP = "evaluate a grid of overrides of one scenario; table and best points"
EXAMPLE = ("example:\n"
           "  clustersim sweep scenarios/gpt3-175b-1024.yaml --grid parallel.tp=4,8 --grid "
           "parallel.pp=8,16,32 --grid parallel.dp=auto --grid "
           "parallel.schedule=1f1b,interleaved --set parallel.virtual_stages=1\n"
           "  clustersim sweep scenarios/gpt3-175b-1024.yaml --grid parallel.pp=8,16 --grid "
           "training.micro_batch=1,2 --method engine --dask local:2 --out out/sw")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "sweep", HELP, EXAMPLE)
    scenario_args(q)
    q.add_argument("--grid", action="append", default=[], metavar="KEY.PATH=V1,V2,...",
                   help="an axis of the grid (repeatable); parallel.dp=auto fills dp in")
    q.add_argument("--method", choices=["analytic", "engine"], default="analytic",
                   help="analytic (default, milliseconds a point) or the engine")
    q.add_argument("--out", type=Path, default=None, help="write sweep.csv, sweep.parquet, "
                   "sweep.json and heatmap.png here")
    q.add_argument("--max-points", type=positive_int, default=MAX_POINTS, metavar="N",
                   help=f"refuse a grid of more points (default {MAX_POINTS:,})")
    search_args(q)
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.run_dir import check_out_dir
    from simulator.outputs.search_files import write_sweep
    from simulator.search.executors import open_executor
    from simulator.search.sweep import best, check_grid, invalid_lines, parse_grid, run_sweep

    axes = parse_grid(args.grid)  # a bad axis is one line, before the scenario is read
    from simulator.spec.rules import scenario_warnings

    said = set(scenario_warnings(load(args)))  # the base must validate; load warns once

    def warn(line: str) -> None:
        if line not in said:
            said.add(line)
            print(line, file=sys.stderr)

    if args.out:
        check_out_dir(args.out)
    n = check_grid(axes, args.max_points)  # before any point is made
    print(f"sweeping {n} point(s) ({args.method}) ...", file=sys.stderr)
    cache = result_cache(args, args.out)
    with open_executor(args.dask, args.workers) as pool:
        table = run_sweep(args.scenario, axes, args.overrides, args.method, pool, cache, warn,
                          args.max_points)
    print(computed_line(cache, "point"), file=sys.stderr)
    if args.out:
        meta = {"scenario": str(args.scenario), "axes": list(axes), "sets": args.overrides,
                "method": args.method}
        written = write_sweep(table, args.out, meta, plots=not args.no_plots)
        print(f"wrote {', '.join(p.name for p in written)} to {args.out}/")
    invalid = int((table["error"] != "").sum()) if "error" in table else 0
    top = best(table)
    if invalid:
        print(f"{invalid} invalid point(s):")
        print("\n".join(invalid_lines(table, list(axes))))
    print(f"{len(table) - invalid} valid point(s), {invalid} invalid; fastest that fit:")
    cols = [*axes, "tp", "pp", "dp", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction"]
    print(top[[c for c in dict.fromkeys(cols) if c in top]].to_string(index=False)
          if len(top) else "  none fits")
    return 0
