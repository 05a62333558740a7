"""What the commands share: registering a subcommand with its help and worked example,
the scenario and search arguments, loading a scenario with its warnings, the result
cache, and the parsers of option values.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

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
    q.add_argument("--workers", type=bounded_int(1, 1024), default=None,
                   help="local processes, 1 to 1024 (default: cores)")
    q.add_argument("--dask", default=None, metavar="local:W|tcp://HOST:8786",
                   help="run on a Dask cluster: W local workers, or an existing scheduler")
    q.add_argument("--cache", type=Path, default=None, metavar="DIR", help="result cache "
                   "(default OUT/cache, or ~/.cache/clustersim without --out)")
    q.add_argument("--no-cache", action="store_true", help="compute every point again")
    q.add_argument("--no-plots", action="store_true", help="skip the PNG")


# ASCII digits only (str.isdigit() takes '²', which int() refuses), _ between digits
_WHOLE = re.compile(r"[0-9](?:_?[0-9]){0,17}")
_EXPONENT = re.compile(r"[0-9]+(?:\.[0-9]*)?[eE]\+?[0-9]{1,2}")
MAX_LIST_VALUES = 64  # values in one comma-separated option


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 in ASCII digits (``2e7`` and ``20_000_000``
    are accepted)."""
    text = text.strip()
    if _WHOLE.fullmatch(text):
        value: float = int(text)
    elif _EXPONENT.fullmatch(text):
        value = float(text)
    else:
        value = 0
    if not (value >= 1 and value == int(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(value)


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high``."""
    def convert(text: str) -> int:
        value = int(text.strip()) if _WHOLE.fullmatch(text.strip()) else None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {low} to "
                                             f"{high:,}")
        return value
    convert.__name__ = "whole number"
    return convert


def int_list(flag: str, text: str) -> tuple[int, ...]:
    """``1,2,4`` as (1, 2, 4): whole numbers >= 1 in ASCII digits, repeats merged (``8,8``
    is (8,)), at most :data:`MAX_LIST_VALUES` values; else a one-line error on ``flag``."""
    items = [v.strip() for v in text.split(",")]
    if not all(_WHOLE.fullmatch(v) and int(v) >= 1 for v in items):
        raise UserError([Problem(flag, text, "expected positive whole numbers separated by "
                                 "commas, e.g. 1,2,4")])
    values = tuple(dict.fromkeys(int(v) for v in items))
    if len(values) > MAX_LIST_VALUES:
        raise UserError([Problem(flag, text, f"{len(values)} values; give at most "
                                 f"{MAX_LIST_VALUES}")])
    return values


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad option is one ``error:`` line (and exit 2), not the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {_oneline(message)} (see {self.prog} --help)\n")


def _oneline(text: str) -> str:
    return " ".join(text.split()) if text.isprintable() else \
        text.encode("unicode_escape").decode("ascii")


def load(args: argparse.Namespace) -> Scenario:
    """The command's scenario, its warnings on stderr."""
    from simulator.spec.load import load_scenario
    from simulator.spec.rules import scenario_warnings

    s = load_scenario(args.scenario, args.overrides)
    for line in scenario_warnings(s):
        print(line, file=sys.stderr)
    return s


def result_cache(args: argparse.Namespace, out: Path | None) -> ResultCache | None:
    from simulator.outputs.writing import check_dir_destination
    from simulator.search.cache import ResultCache

    if args.no_cache:
        return None
    default = out / "cache" if out else Path("~/.cache/clustersim")
    return ResultCache(check_dir_destination(args.cache or default, "--cache"))


def computed_line(cache: ResultCache | None, what: str) -> str:
    if cache is None:
        return f"cache off: every {what} computed"
    return f"{cache.stored} {what}(s) computed, {cache.hits} from the cache ({cache.root})"
