"""``clustersim colocate``: several scenarios on one cluster's shared fabric, each job's
step time together against alone (its slowdown) and the links they contended for."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from simulator.cli.common import Subparsers, add_command

HELP = ("run several scenarios on one cluster's shared fabric and report each job's "
        "slowdown against running alone: jobs.csv, links.csv, colocate.md")
EXAMPLE = ("examples:\n"
           "  clustersim colocate scenarios/colocate/two-jobs-dgx-h100.yaml "
           "--out out/two-jobs\n"
           "  clustersim colocate scenarios/colocate/two-jobs-dgx-h100.yaml "
           "--placement packed\n"
           "  clustersim colocate scenarios/colocate/two-jobs-dgx-h100.yaml "
           "--oversubscription 4 --steps 5")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "colocate", HELP, EXAMPLE)
    q.add_argument("cluster", type=Path, help="cluster YAML: the system, its nodes, the "
                   "fabric and the jobs (docs/colocate.md)")
    q.add_argument("--out", type=Path, default=None, help="output directory "
                   "(default out/colocate-<cluster name>)")
    q.add_argument("--placement", choices=["packed", "spread", "interleaved"], default=None,
                   help="place the jobs that list no nodes by this policy instead of the "
                   "file's")
    q.add_argument("--oversubscription", type=float, default=None, metavar="X",
                   help="the leaf uplinks' taper instead of the file's (1 = non-blocking)")
    q.add_argument("--steps", type=int, default=None, metavar="N",
                   help="measure N steps of every job instead of the file's")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.colocate.report import write_report
    from simulator.colocate.run import colocate
    from simulator.outputs.run_dir import check_out_dir, default_out_dir
    from simulator.spec.cluster_file import load_cluster_file, with_options

    spec, base = load_cluster_file(args.cluster)
    spec = with_options(spec, placement=args.placement,
                        oversubscription=args.oversubscription, steps=args.steps)
    out = args.out or default_out_dir(f"colocate-{spec.name}")
    check_out_dir(out)
    written, lines = write_report(out, colocate(spec, base, lambda line: print(
        line, file=sys.stderr)))
    print("\n".join(lines))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    return 0
