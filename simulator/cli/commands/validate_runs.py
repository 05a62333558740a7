"""``clustersim validate-runs``: simulate every row of a table of published (or your
own) measured runs and set it beside the measurement, by row and by regime."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from simulator.cli.common import Subparsers, add_command, positive_int

HELP = ("simulate every row of a table of measured runs and compare, by row and by "
        "regime: runs.csv, regimes.csv, runs.md, scatter.png, weak scaling where rows "
        "differ only in GPU count: scaling.csv (and by cost class: classes.csv, split.csv)")
EXAMPLE = ("examples:\n"
           "  clustersim validate-runs docs/validation/published/llm-foundry.csv "
           "--out out/llm-foundry\n"
           "  clustersim validate-runs my-runs.csv --method engine --rows h100 --workers 2\n"
           "  clustersim validate-runs my-runs.csv --by-class")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "validate-runs", HELP, EXAMPLE)
    q.add_argument("table", type=Path, help="CSV of runs (the columns of "
                   "docs/validation/published/llm-foundry.csv)")
    q.add_argument("--method", choices=["analytic", "engine"], default="analytic",
                   help="closed form (default, milliseconds a row) or the engine (folded)")
    q.add_argument("--rows", default=None, metavar="TEXT",
                   help="only the rows whose name contains TEXT (case ignored)")
    q.add_argument("--out", type=Path, default=None, help="output directory "
                   "(default out/validate-runs-<table>)")
    q.add_argument("--workers", type=positive_int, default=None,
                   help="local processes (default: cores)")
    q.add_argument("--no-plots", action="store_true", help="skip scatter.png")
    q.add_argument("--by-class", action="store_true",
                   help="also split each simulated step by cost class (GEMM, attention, "
                   "memory-bound, communication, the other; one more simulation per class) "
                   "and fit the factor per class that best turns simulated into measured "
                   "times, over all rows and per GPU: classes.csv; and the attention "
                   "kernels' factor against the rest's, also per GPU, attention kernel and "
                   "head dimension: split.csv")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.progress import progress_bar
    from simulator.outputs.run_dir import check_out_dir, default_out_dir
    from simulator.published.classes import fit_classes, fit_split
    from simulator.published.compare import REGIMES, compare_rows, kernel_group, regime_summary
    from simulator.published.report import summary_lines, write_report
    from simulator.published.rows import read_rows
    from simulator.search.executors import open_executor

    rows = read_rows(args.table)
    if args.rows:
        rows = [r for r in rows if args.rows.lower() in r.name.lower()]
    out = args.out or default_out_dir(f"validate-runs-{args.table.stem}")
    check_out_dir(out)
    print(f"simulating {len(rows)} run(s) ({args.method}) ...", file=sys.stderr)
    with open_executor(None, args.workers) as pool, progress_bar(len(rows), "runs") as bar:
        table = compare_rows(rows, args.method, pool, bar.update, by_class=args.by_class)
    regimes = regime_summary(table)
    fits = fit_classes(table, REGIMES["gpu"]) if args.by_class else None
    split = fit_split(table, (REGIMES["gpu"], kernel_group)) if args.by_class else None
    meta = {"table": str(args.table), "method": args.method, "rows_filter": args.rows,
            "by_class": args.by_class}
    written = write_report(out, table, regimes, meta, plots=not args.no_plots, fits=fits,
                           split=split)
    print("\n".join(summary_lines(table, regimes, fits, split)))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    return 0
