"""What every section of a scenario shares: frozen models that refuse unknown keys,
the bounds on counts and sizes, and the validators of whole numbers and names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_SIZE = 10**9  # a bound on every count and size: larger is a typo, not a model
MAX_STAGES = 100_000  # pp × virtual_stages: per-stage tables and closed forms loop over them


class Frozen(BaseModel):
    """A scenario section: frozen, unknown keys refused, every number finite; each
    field's docstring is its ``description`` in the JSON Schema (``clustersim schema``)
    and in the scenario reference."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False,
                              use_attribute_docstrings=True)


def not_bool(value: Any) -> Any:
    """Literal[0, 1, ...] would take ``true`` as 1: a boolean is not a number here."""
    if isinstance(value, bool):
        raise ValueError("must be a whole number, not true/false")
    return value


def printable(text: str) -> str:
    if not text.isprintable():
        raise ValueError("has control characters; use printable text")
    return text


def one_of(names: Iterable[str]) -> str:
    """The choices as pydantic words a Literal's: ``'a', 'b' or 'c'``."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def registered(names: Callable[[], Iterable[str]]) -> Any:
    """A text field that must name an entry of a registry: ``names()`` is read when a
    scenario is validated (an entry registered after import is accepted, an unknown
    name is "must be one of ...", as for a Literal) and when the schema is made (its
    ``enum``)."""

    def check(value: str) -> str:
        choices = list(names())
        if value not in choices:
            raise ValueError(f"must be one of {one_of(choices)}")
        return value

    def schema(out: dict[str, Any]) -> None:
        out["enum"] = list(names())

    return Annotated[str, AfterValidator(check), Field(json_schema_extra=schema)]


def divisor_list(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def divisors_text(n: int) -> str:
    """The first twelve divisors of ``n``, for a fix that lists them."""
    divs = divisor_list(n)
    return ", ".join(map(str, divs[:12])) + (", ..." if len(divs) > 12 else "")
