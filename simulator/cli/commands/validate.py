"""``clustersim validate``: check a scenario and give its memory verdict; exit 0, 2 with
one line per problem, or 3 when the layout does not fit in GPU memory."""

from __future__ import annotations

import argparse
import sys

from simulator.cli.common import (
    Subparsers,
    add_command,
    load,
    scenario_args,
)
from simulator.cli.exit_codes import OK, allow_oom_arg, fit_status, memory_verdict
from simulator.errors import UserError

HELP = ("check a scenario and give its memory verdict (the analytic memory model, "
        "milliseconds); exit 0, 2 with one line per problem, or 3 when it does not fit")
EXAMPLE = ("example:\n"
           "  clustersim validate scenarios/gpt3-175b-1024.yaml")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "validate", HELP, EXAMPLE, exit_codes=True)
    scenario_args(q)
    allow_oom_arg(q)
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.analysis.memory import memory_report, stage_rows
    from simulator.builder.budget import DEFAULT_MAX_TASKS, check_stages, engine_cost

    s = load(args)
    cost = engine_cost(s, s.simulation.fidelity)
    if cost.tasks > DEFAULT_MAX_TASKS:
        print(f"warning: an engine run would build about {cost.tasks:.2g} tasks "
              f"(~{cost.memory_bytes / 1e9:.3g} GB), above the default limit; `run` will ask "
              "for --method analytic or --max-tasks", file=sys.stderr)
    par = s.parallel
    extra = "".join(f" · {name} {deg}" for name, deg in (("cp", par.cp), ("ep", par.ep))
                    if deg > 1)
    print(f"{args.scenario}: ok ({s.name}: {par.world} GPUs, tp {par.tp} · "
          f"pp {par.pp} · dp {par.dp}{extra}, {par.schedule}, m = {s.microbatches})")
    try:
        check_stages(s)  # a valid scenario whose stages are too many to tabulate
    except UserError as exc:
        print(f"memory: not estimated ({exc.lines()[0]})")
        return OK
    verdict = memory_verdict(stage_rows(memory_report(s)))
    print(verdict.line())
    return fit_status(verdict, args.allow_oom)
