"""User-facing errors: one line per problem, naming the field, the value and the fix.

The CLI turns a :class:`UserError` into those lines on stderr and exit status 2,
with no traceback. Library code raises it for anything a user can fix (a bad
scenario, an unknown preset, a file that is not YAML); everything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where (dotted field path), what, how to fix it."""

    field: str
    value: object
    fix: str

    def __str__(self) -> str:
        value = _short(self.value)
        field = _oneline(self.field)
        return f"{field} = {value}: {_oneline(self.fix)}" if field else _oneline(self.fix)


def _oneline(text: str) -> str:
    """Escape control characters so that a problem always prints as one line."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class UserError(Exception):
    """An input problem the user can fix; carries one or more :class:`Problem` lines."""

    def __init__(self, problems: Iterable[Problem | str]) -> None:
        self.problems: tuple[Problem | str, ...] = tuple(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems]


class ScenarioError(UserError):
    """The scenario does not validate; ``problems`` lists every rule it breaks."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM: ``signal_name`` says which; ``message`` what long work
    kept and how to resume it (empty when there is nothing to say)."""

    def __init__(self, signal_name: str = "SIGINT", message: str = "") -> None:
        super().__init__(message or signal_name)
        self.signal_name = signal_name
        self.message = message
