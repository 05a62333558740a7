"""The CLI reference, written from the parser itself.

Every command ``clustersim --help`` lists (the simulator's own, :data:`COMMANDS`, and
those installed packages add through the ``clustersim.commands`` entry points), each
with its usage, its arguments and options (value, default, help) and its worked
example, read from the same parser the command line uses: a command or a flag added
later appears without anyone editing the page. The documentation site's build calls
:func:`cli_reference` (``docs/hooks/reference.py``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

from simulator.cli.main import _parser

SUPPRESS = argparse.SUPPRESS


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return dict(_subparsers(parser).choices)


def help_lines() -> dict[str, str]:
    """Command -> the help line ``clustersim --help`` lists for it."""
    return {a.dest: a.help or "" for a in _subparsers(_parser(None))._choices_actions}


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's full parser, in ``--help`` order: a plugin command's options are
    registered only when it is the command being run, so each is asked for by name."""
    names = list(_subcommands(_parser(None)))
    return {name: _subcommands(_parser(name))[name] for name in names}


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.metavar is not None:
        return f"`{action.metavar}`"
    return f"`{action.dest.upper()}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, SUPPRESS, [], False):
        return ""
    return f"`{action.default}`"


def _rows(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        if action.help == SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        text = " ".join((action.help or "").split()).replace("%%", "%")
        if "%(" in text:
            text = text % {**vars(action), "prog": parser.prog}
        cells = [name, _value(action), _default(action), text]
        yield "| " + " | ".join(c.replace("|", "\\|") if c is text else c for c in cells) + " |"


def command_reference(name: str, parser: argparse.ArgumentParser) -> str:
    """One command: its help line, usage, a table of its arguments, its example."""
    lines = [f"## `clustersim {name}`", "", " ".join((parser.description or "").split()), "",
             "```", parser.format_usage().strip(), "```", "",
             "| argument | value | default | what it does |", "| --- | --- | --- | --- |",
             *_rows(parser), ""]
    if parser.epilog:
        lines += ["```", parser.epilog.strip(), "```", ""]
    return "\n".join(lines)


def cli_reference() -> str:
    """Every command's reference, in ``clustersim --help`` order (usage lines wrapped at
    100 columns whatever the terminal)."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parsers = command_parsers()
        index = [f"- [`{n}`](#clustersim-{n}): {line}" for n, line in help_lines().items()]
        return "\n".join([*index, "", *(command_reference(n, p) for n, p in parsers.items())])
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
