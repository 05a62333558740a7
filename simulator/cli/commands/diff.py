"""``clustersim diff``: compare two run directories: step time, every category of the step
breakdown and peak memory, with deltas; diff.json and a waterfall diff.png."""

from __future__ import annotations

import argparse
from pathlib import Path

from simulator.cli.common import (
    Subparsers,
    add_command,
)

HELP = ("compare two run directories: step time, every category of the step breakdown and "
        "peak memory, with deltas; diff.json and a waterfall diff.png")
EXAMPLE = ("examples:\n"
           "  clustersim run scenarios/gpt3-175b-1024.yaml --out out/1f1b\n"
           "  clustersim run scenarios/gpt3-175b-1024.yaml --set parallel.schedule=gpipe "
           "--out out/gpipe\n"
           "  clustersim diff out/1f1b out/gpipe --out out/1f1b-vs-gpipe")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "diff", HELP, EXAMPLE)
    q.add_argument("run_a", type=Path, metavar="RUN_A", help="run directory (results.json)")
    q.add_argument("run_b", type=Path, metavar="RUN_B", help="run directory (results.json)")
    q.add_argument("--out", type=Path, default=None, help="where to write diff.json and "
                   "diff.png (default out/diff-<A>-vs-<B>)")
    q.add_argument("--no-plots", action="store_true", help="skip diff.png")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.diff import diff_lines, load_run, run_diff, write_diff

    a, b = load_run(args.run_a, "RUN_A"), load_run(args.run_b, "RUN_B")
    diff = run_diff(a, b, args.run_a, args.run_b)
    out = args.out or Path("out") / f"diff-{args.run_a.resolve().name}-vs-" \
        f"{args.run_b.resolve().name}"
    written = write_diff(out, diff, plot=not args.no_plots)
    print("\n".join(diff_lines(diff)))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    return 0
