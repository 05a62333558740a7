"""``clustersim``: one console entry point with subcommands.

Example::

    clustersim run scenarios/gpt3-175b-1024.yaml --out out/gpt3
    clustersim run scenarios/llama2-7b-8gpu-ddp.yaml --set parallel.zero=2 --method analytic

User errors (a bad scenario, an unknown preset, a bad flag) print one line per
problem on stderr and exit with status 2, without a traceback; a layout that does
not fit in GPU memory exits with status 3 (:mod:`simulator.cli.exit_codes`).

Building the parser imports nothing heavy: each command's module
(:mod:`simulator.cli.commands`) imports what it runs inside ``run``, and the commands
of other packages (:data:`LAZY_COMMANDS`, from the ``clustersim.commands`` entry points:
:mod:`simulator.cli.registry`) are one help line each until one of them is the
command being run (or its ``--help`` asked for); only then is its module imported and
its ``add_parser`` called. ``clustersim --help`` and ``clustersim validate`` thus load no
calibration module beyond its command table, no torch, no matplotlib and no pandas.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import signal
import sys
import threading
from collections.abc import Sequence

from simulator import __version__
from simulator.cli.commands.run import EXAMPLE
from simulator.cli.common import OneLineParser
from simulator.cli.exit_codes import BROKEN_PIPE, INTERRUPTED, TERMINATED, USAGE, epilog
from simulator.cli.registry import COMMANDS, PluginCommands
from simulator.errors import Interrupted, Problem, UserError

#: The commands installed packages add: name -> (module with ``add_parser(sub)``, the help
#: line ``clustersim --help`` lists). A test checks each line against the one the module
#: registers.
LAZY_COMMANDS = PluginCommands()


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; ``command`` (the subcommand being run) is the only one of
    :data:`LAZY_COMMANDS` whose module is imported to register its full options, and
    the plugins' table is read only when ``command`` is not one of the simulator's."""
    p = OneLineParser(
        prog="clustersim", description="Discrete-event simulator of large-model training "
        "clusters.", epilog=f"{EXAMPLE}\n\n{epilog()}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"clustersim {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    own: set[str] = set()
    for module in COMMANDS:
        module.add_parser(sub)
        own.update(sub.choices)
    if command in own:
        return p
    for name, (module_name, help_) in LAZY_COMMANDS.items():
        if name == command:
            importlib.import_module(module_name).add_parser(sub)
        else:  # listed in `clustersim --help`; never parses (only the command run does)
            sub.add_parser(name, help=help_)
    return p


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: its first word that is not an option (the
    top-level options, --help and --version, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: long work stops the same way (what it finished kept, how to
    resume said), with its own exit status."""
    raise Interrupted("SIGTERM")


def _field_problems(exc: Exception) -> list[Problem] | None:
    """A pydantic ``ValidationError`` that escaped a command's own checks as one
    problem per field (None for any other exception: a bug keeps its traceback)."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is None or not isinstance(exc, pydantic.ValidationError):
        return None
    return [Problem(".".join(str(x) for x in err["loc"]), err.get("input"), err["msg"])
            for err in exc.errors()[:12]]


def _printable_output() -> None:
    """A path of non-UTF-8 bytes (held as surrogates) prints escaped, not as a crash."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _printable_output()
    args = _parser(_command(argv)).parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return int(args.func(args))
    except UserError as exc:
        for line in exc.lines():
            print(f"error: {line}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt as exc:
        name = getattr(exc, "signal_name", "SIGINT")
        message = getattr(exc, "message", "")
        print(f"interrupted ({name})" + (f": {message}" if message else ""), file=sys.stderr)
        return TERMINATED if name == "SIGTERM" else INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`clustersim diff A B | head`): stop quietly, and keep
        # Python from reporting the pipe again when it flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE
    except Exception as exc:  # last: the clauses above are Exceptions too
        problems = _field_problems(exc)
        if problems is None:
            raise
        return _print_problems(problems)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _print_problems(problems: list[Problem]) -> int:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return USAGE


if __name__ == "__main__":
    sys.exit(main())
