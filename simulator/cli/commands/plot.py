"""``clustersim plot``: re-draw the PNGs of a run, sweep (heatmap), plan (Pareto) or train
directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from simulator.cli.common import (
    Subparsers,
    add_command,
)
from simulator.errors import Problem, UserError

HELP = "re-draw the PNGs of a run, sweep (heatmap), plan (Pareto) or train directory"
EXAMPLE = ("example:\n"
           "  clustersim plot out/gpt3")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "plot", HELP, EXAMPLE)
    q.add_argument("run_dir", type=Path)
    q.add_argument("--axes", default=None, metavar="X,Y",
                   help="sweep heatmap axes (default: the first two swept keys)")
    q.set_defaults(func=run)


#: A search's or a job's directory by the file that marks it: (module, plotter, what).
DIRECTORIES = (("plan.csv", "simulator.outputs.plots.search", "plot_pareto", "plan"),
               ("train.json", "simulator.outputs.plots.job", "plot_training", "train"),
               ("sweep.csv", "simulator.outputs.plots.search", "plot_heatmap", "sweep"))


def _plot_output(args: argparse.Namespace, module: str, plotter: str, what: str) -> int:
    import importlib

    draw = getattr(importlib.import_module(module), plotter)
    extra = [args.axes.split(",") if args.axes else None] if what == "sweep" else []
    try:
        print(draw(args.run_dir, *extra))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        # a file the readers let through (its columns are there) whose content is not
        # what a clustersim output holds: one line, not a traceback from the figure
        raise UserError([Problem("run_dir", str(args.run_dir), f"is not a clustersim {what} "
                                 f"output ({type(exc).__name__}: {str(exc)[:60]}); write it "
                                 f"again with `clustersim {what} ... --out DIR`")]) from None
    return 0


def run(args: argparse.Namespace) -> int:
    from simulator.loading import local_path
    from simulator.outputs.run_dir import MANIFEST, check_run_dir, write_manifest

    args.run_dir = local_path(args.run_dir, "run_dir")
    for marker, module, plotter, what in DIRECTORIES:
        if (args.run_dir / marker).is_file():
            return _plot_output(args, module, plotter, what)
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
