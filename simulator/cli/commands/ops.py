"""``clustersim ops``: one layer's kernel-level ops under the scenario's stack: time,
bound, share."""

from __future__ import annotations

import argparse

from simulator.cli.common import (
    Subparsers,
    add_command,
    load,
    scenario_args,
)

HELP = "one layer's kernel-level ops under the scenario's stack: time, bound, share"
EXAMPLE = ("examples:\n"
           "  clustersim ops scenarios/gpt3-175b-1024.yaml --set stack=megatron-2021\n"
           "  clustersim ops scenarios/llama2-7b-8gpu-fsdp.yaml --csv ops.csv")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "ops", HELP, EXAMPLE)
    scenario_args(q)
    q.add_argument("--csv", metavar="FILE", help="also write the table as CSV to FILE")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.ops_table import format_table, op_rows, to_csv
    from simulator.outputs.writing import atomic_output, check_file_destination

    if args.csv:  # before the table: a bad --csv is one line, not a table and a line
        check_file_destination(args.csv, "--csv")
    s = load(args)
    rows = op_rows(s)
    print(format_table(s, rows))
    if args.csv:
        with atomic_output(args.csv, "--csv") as tmp:
            tmp.write_text(to_csv(rows), encoding="utf-8")
        print(f"wrote {args.csv}")
    return 0
