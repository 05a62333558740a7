"""``clustersim validate``: check a scenario; exit 0, or 2 with one line per problem."""

from __future__ import annotations

import argparse
import sys

from simulator.cli.common import (
    Subparsers,
    add_command,
    load,
    scenario_args,
)

HELP = "check a scenario; exit 0, or 2 with one line per problem"
EXAMPLE = ("example:\n"
           "  clustersim validate scenarios/gpt3-175b-1024.yaml")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "validate", HELP, EXAMPLE)
    scenario_args(q)
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.builder.budget import DEFAULT_MAX_TASKS, engine_cost

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
    return 0
