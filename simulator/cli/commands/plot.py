"""``clustersim plot``: re-draw the PNGs of a run, sweep (heatmap), plan (Pareto) or train
directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from simulator.cli.common import (
    Subparsers,
    add_command,
)

HELP = "re-draw the PNGs of a run, sweep (heatmap), plan (Pareto) or train directory"
EXAMPLE = ("example:\n"
           "  clustersim plot out/gpt3")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "plot", HELP, EXAMPLE)
    q.add_argument("run_dir", type=Path)
    q.add_argument("--axes", default=None, metavar="X,Y",
                   help="sweep heatmap axes (default: the first two swept keys)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.run_dir import MANIFEST, check_run_dir, write_manifest

    if (args.run_dir / "plan.csv").is_file():
        from simulator.outputs.plots.search import plot_pareto

        print(plot_pareto(args.run_dir))
        return 0
    if (args.run_dir / "train.json").is_file():
        from simulator.outputs.plots.job import plot_training

        print(plot_training(args.run_dir))
        return 0
    if (args.run_dir / "sweep.csv").is_file():
        from simulator.outputs.plots.search import plot_heatmap

        axes = args.axes.split(",") if args.axes else None
        print(plot_heatmap(args.run_dir, axes))
        return 0
    manifest = check_run_dir(args.run_dir)  # every file of one complete run, or one line
    from simulator.outputs.plots.run import plot_all  # matplotlib: after the checks

    written = plot_all(args.run_dir)
    from simulator.api import write_run_report
    from simulator.outputs.run_files import read_results

    written.append(write_run_report(args.run_dir, read_results(args.run_dir / "results.json")))
    names = sorted({*manifest["files"], *(p.name for p in written)})
    write_manifest(args.run_dir, [n for n in names if n != MANIFEST], manifest.get("run_id"))
    for path in written:
        print(path)
    return 0
