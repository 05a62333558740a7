"""The ``clustersim`` commands: the simulator's own (one module each under
:mod:`simulator.cli.commands`, in the order ``--help`` lists them) and those other
installed packages add through the ``clustersim.commands`` entry-point group.

A plugin's entry point names a table, command -> (module with ``add_parser(sub)``, its
help line), which costs no import beyond the table itself: ``clustersim --help`` lists
each plugin command by its help line, and only the command being run (or whose
``--help`` is asked for) has its module imported. The calibration package registers its
commands this way (:mod:`calibration.commands`); the simulator never names it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from types import ModuleType

from simulator.cli.commands import (
    colocate,
    compare_trace,
    diff,
    import_config,
    memory,
    ops,
    plan,
    plot,
    presets,
    run,
    schema,
    sweep,
    train,
    validate,
    validate_runs,
)

#: The simulator's commands, in ``--help`` order: each module has ``add_parser(sub)``.
COMMANDS: tuple[ModuleType, ...] = (validate, run, memory, ops, presets, schema, sweep, plan,
                                    plot, diff, train, validate_runs, import_config,
                                    colocate, compare_trace)
GROUP = "clustersim.commands"


class PluginCommands(Mapping[str, tuple[str, str]]):
    """Command -> (module, help line) of every installed plugin's table, read from the
    entry points the first time it is asked (a command of the simulator's own never
    asks, so it imports no plugin)."""

    def __init__(self, group: str = GROUP) -> None:
        self.group = group
        self._table: dict[str, tuple[str, str]] | None = None

    def _load(self) -> dict[str, tuple[str, str]]:
        if self._table is None:
            table: dict[str, tuple[str, str]] = {}
            for point in sorted(entry_points(group=self.group), key=lambda e: e.name):
                table.update(point.load())
            self._table = table
        return self._table

    def __getitem__(self, name: str) -> tuple[str, str]:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())
