"""``clustersim schema``: print the scenario JSON Schema (for editors)."""

from __future__ import annotations

import argparse
import json

from simulator.cli.common import (
    Subparsers,
    add_command,
)

HELP = "print the scenario JSON Schema (for editors)"
EXAMPLE = ("example:\n"
           "  clustersim schema > scenario.schema.json")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "schema", HELP, EXAMPLE)
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator.spec.scenario import Scenario

    print(json.dumps(Scenario.model_json_schema(), indent=2))
    return 0
