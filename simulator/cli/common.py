"""What the commands share: registering a subcommand with its help and worked example,
the scenario and search arguments, loading a scenario with its warnings, the result
cache, and the parsers of option values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from simulator.errors import Problem, UserError

if TYPE_CHECKING:
    from simulator.search.cache import ResultCache
    from simulator.spec.scenario import Scenario

Subparsers = argparse._SubParsersAction


def add_command(sub: Subparsers, name: str, help_: str, example: str,
                exit_codes: bool = False) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` shows its help line and worked example (and, with
    ``exit_codes``, the exit-status table: the commands that give a memory verdict)."""
    from simulator.cli.exit_codes import epilog

    return sub.add_parser(name, help=help_, description=help_,
                          epilog=f"{example}\n\n{epilog()}" if exit_codes else example,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def scenario_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("scenario", type=Path, help="scenario YAML file")
    q.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY.PATH=VALUE", help="override a scenario key (repeatable)")


def search_args(q: argparse.ArgumentParser) -> None:
    """Where a search runs and what it remembers (sweep and plan)."""
    q.add_argument("--workers", type=int, default=None, help="local processes (default: cores)")
    q.add_argument("--dask", default=None, metavar="local:W|tcp://HOST:8786",
                   help="run on a Dask cluster: W local workers, or an existing scheduler")
    q.add_argument("--cache", type=Path, default=None, metavar="DIR", help="result cache "
                   "(default OUT/cache, or ~/.cache/clustersim without --out)")
    q.add_argument("--no-cache", action="store_true", help="compute every point again")
    q.add_argument("--no-plots", action="store_true", help="skip the PNG")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (``2e7`` and ``20_000_000`` are accepted)."""
    try:
        value = float(text) if "e" in text.lower() else int(text)
        whole = value == int(value) and value >= 1
    except (ValueError, OverflowError):
        whole = False
    if not whole:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(value)


def int_list(flag: str, text: str) -> tuple[int, ...]:
    """``1,2,4`` as (1, 2, 4)."""
    values = tuple(int(v) for v in text.split(",") if v.strip().isdigit())
    if not values or min(values) < 1 or len(values) != len(text.split(",")):
        raise UserError([Problem(flag, text, "expected positive whole numbers separated by "
                                 "commas, e.g. 1,2,4")])
    return values


def load(args: argparse.Namespace) -> Scenario:
    """The command's scenario, its warnings on stderr."""
    from simulator.spec.load import load_scenario
    from simulator.spec.rules import scenario_warnings

    s = load_scenario(args.scenario, args.overrides)
    for line in scenario_warnings(s):
        print(line, file=sys.stderr)
    return s


def result_cache(args: argparse.Namespace, out: Path | None) -> ResultCache | None:
    from simulator.search.cache import ResultCache

    if args.no_cache:
        return None
    default = out / "cache" if out else Path("~/.cache/clustersim")
    return ResultCache(args.cache or default)


def computed_line(cache: ResultCache | None, what: str) -> str:
    if cache is None:
        return f"cache off: every {what} computed"
    return f"{cache.stored} {what}(s) computed, {cache.hits} from the cache ({cache.root})"
